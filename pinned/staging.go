package pinned

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// Stager moves data between device memory and an io.Writer or io.Reader through pinned buffers on
// its own non-blocking copy stream: the double-buffer pattern. While the CPU writes one chunk out
// (or reads the next one in), the copy engine moves the next (or the previous) chunk, ordered by one
// event per buffer, so copying and I/O overlap. One transfer runs at a time; a Stager is safe for
// concurrent use (transfers queue).
type Stager struct {
	dev      *vmm.Device
	stream   *vmm.Stream
	events   []*vmm.Event
	pool     *Pool
	ownsPool bool
	nbuf     int

	own     lifetime.Owner // its lock is held for a whole transfer; closed once Close freed all
	closing bool           // Close was called: transfers are refused
	// held are buffers of a transfer whose stream could not be drained: a copy may still be queued
	// into or out of them, so they stay out of the pool until a synchronization succeeds (reclaim).
	held []*Buffer
}

// StagerOptions tunes NewStager.
type StagerOptions struct {
	// Buffers is the number of pinned buffers a transfer uses in turn (default 2, at least 2).
	Buffers int
	// BufferSize is the size of each buffer, the chunk of one copy (default 32 MiB). Ignored with
	// Pool.
	BufferSize uint64
	// Pool, when set, is where each transfer takes its buffers (waiting for them; stagers sharing a
	// pool take their buffers one stager at a time, so they never deadlock) and gives them back at
	// its end; its region must be visible to the device and, for transfers
	// from the device, writable by it. Without Pool the stager makes its own region (with Region's
	// options) and pool.
	Pool *Pool
	// Region are the options of the stager's own region (default: Auto kind, granted to the device).
	Region Options
	// SpinWait makes the stager wait for its copies by spinning on a CPU core, which notices a
	// finished copy a few microseconds sooner. By default the waiting thread sleeps until the copy
	// is done (blocking events), which leaves the core to the rest of the process: a service that
	// stages for many clients at once would otherwise keep a core busy per transfer. Small buffers
	// should spin: with 2 MiB buffers sleeping waits cost 10-30 % of the bandwidth on the measured
	// host, with the default 32 MiB nothing (docs/pinned.md).
	SpinWait bool
}

const defaultStageBuffer = 32 << 20

// NewStager makes a stager for dev: a non-blocking stream, one event per buffer and, unless
// opts.Pool is given, a pool of its own.
func NewStager(dev *vmm.Device, opts StagerOptions) (s *Stager, err error) {
	if dev == nil {
		return nil, fmt.Errorf("pinned: new stager: nil device: %w", ErrInvalidValue)
	}
	nbuf := opts.Buffers
	if nbuf == 0 {
		nbuf = 2
	}
	if nbuf < 2 {
		return nil, fmt.Errorf("pinned: new stager: %d buffers (double buffering needs at least 2): %w", nbuf, ErrInvalidValue)
	}
	s = &Stager{dev: dev, nbuf: nbuf, pool: opts.Pool}
	defer func() {
		if err != nil {
			if ferr := s.free(); ferr != nil {
				// What could not be freed stays with the System, which retries it.
				err = errors.Join(err, ferr, dev.System().Keep("stager on "+dev.String(), s.free))
			}
			s = nil
		}
	}()
	if s.pool != nil {
		if s.pool.Len() < nbuf {
			return s, fmt.Errorf("pinned: new stager: %s has fewer than %d buffers: %w", s.pool, nbuf, ErrInvalidValue)
		}
		if !s.pool.region.VisibleTo(dev) {
			return s, fmt.Errorf("pinned: new stager: %s of %s is not visible to %s (grant it): %w", s.pool, s.pool.region, dev, ErrInvalidValue)
		}
	} else {
		size := opts.BufferSize
		if size == 0 {
			size = defaultStageBuffer
		}
		ro := opts.Region
		if ro.Grant == nil && !ro.CPUOnly {
			ro.Grant = []*vmm.Device{dev}
		}
		if ro.CPUOnly {
			return s, fmt.Errorf("pinned: new stager: a CPU-only region cannot stage: %w", ErrInvalidValue)
		}
		if s.pool, err = CreatePool(dev, size, nbuf, ro); err != nil {
			return s, fmt.Errorf("pinned: new stager: %w", err)
		}
		s.ownsPool = true
		if !s.pool.region.VisibleTo(dev) {
			return s, fmt.Errorf("pinned: new stager: its region is not visible to %s (Region.Grant must include it): %w", dev, ErrInvalidValue)
		}
	}
	if s.stream, err = dev.CreateStream(vmm.StreamOptions{NonBlocking: true}); err != nil {
		return s, fmt.Errorf("pinned: new stager: %w", err)
	}
	for i := 0; i < nbuf; i++ {
		e, err := newWaitEvent(dev, opts.SpinWait)
		if err != nil {
			return s, fmt.Errorf("pinned: new stager: %w", err)
		}
		s.events = append(s.events, e)
	}
	s.own.Init(nil, "stager")
	lifetime.Track(s, &s.own)
	return s, nil
}

// newWaitEvent makes an event a stager waits on: one that spins, or one that sleeps (see
// StagerOptions.SpinWait).
func newWaitEvent(dev *vmm.Device, spin bool) (*vmm.Event, error) {
	if spin {
		return dev.NewEvent(false)
	}
	return dev.NewBlockingEvent()
}

// Pool is the pool the stager takes its buffers from.
func (s *Stager) Pool() *Pool { return s.pool }

// ChunkSize is the size of one copy: the pool's buffer size.
func (s *Stager) ChunkSize() uint64 { return s.pool.BufferSize() }

// Stream is the stager's copy stream (closed once the stager is).
func (s *Stager) Stream() *vmm.Stream { return s.stream }

// begin locks the stager for a transfer and takes its buffers (first those a failed drain held, once
// the stream drains).
func (s *Stager) begin(ctx context.Context, op string) ([]*Buffer, error) {
	s.own.Lock()
	if s.closing || s.own.Closed() {
		s.own.Unlock()
		return nil, fmt.Errorf("pinned: %s: stager: %w", op, ErrClosed)
	}
	// A synchronization that failed before one succeeded belongs to the transfer that held the
	// buffers, which reported its own; only a stream still not drained stops this one.
	if err := s.reclaim(); errors.Is(err, ErrStreamNotDrained) {
		s.own.Unlock()
		return nil, fmt.Errorf("pinned: %s: %w", op, err)
	}
	bufs, err := s.pool.getN(ctx, s.nbuf)
	if err != nil {
		s.own.Unlock()
		return nil, fmt.Errorf("pinned: %s: %w", op, err)
	}
	return bufs, nil
}

// end drains the stream (nothing may still be copying into or out of a buffer), gives the buffers
// back and unlocks the stager. A stream that cannot be drained keeps the buffers held (reclaim).
func (s *Stager) end(bufs []*Buffer, err error) error {
	s.held = append(s.held, bufs...)
	if rerr := s.reclaim(); rerr != nil {
		err = errors.Join(err, rerr)
	}
	s.own.Unlock()
	return err
}

// drain synchronizes the stream, up to vmm.DrainAttempts times, until every copy queued on it is
// complete. A failed synchronization is still reported: it may be the error of a queued copy.
func (s *Stager) drain() error {
	err := s.stream.Drain(vmm.DrainAttempts)
	if errors.Is(err, vmm.ErrNotDrained) {
		return fmt.Errorf("pinned: drain the copy stream: %w: %w", err, ErrStreamNotDrained)
	}
	if err != nil {
		return fmt.Errorf("pinned: drain the copy stream: %w", err)
	}
	return nil
}

// reclaim gives the held buffers back to the pool once the stream drains; the caller holds the
// stager's lock. Its error wraps ErrStreamNotDrained while they stay held.
func (s *Stager) reclaim() error {
	if len(s.held) == 0 {
		return nil
	}
	err := s.drain()
	if errors.Is(err, ErrStreamNotDrained) {
		return fmt.Errorf("%w (%d buffers of %s held until it drains)", err, len(s.held), s.pool)
	}
	for _, b := range s.held {
		if perr := s.pool.Put(b); perr != nil {
			err = errors.Join(err, perr)
		}
	}
	s.held = nil
	return err
}

// checkTransfer refuses n bytes at device address p that the int64 byte count cannot report or
// that wrap the address space: the chunk count would overflow into a transfer of nothing.
func checkTransfer(op string, p driver.DevicePtr, n uint64) error {
	if n > math.MaxInt64 || uint64(p)+n < uint64(p) {
		return fmt.Errorf("pinned: %s: %d bytes at %#x: too large: %w", op, n, uint64(p), ErrInvalidValue)
	}
	return nil
}

// DeviceToWriter copies n bytes of device memory at src (reachable by the stager's device) into w,
// chunk by chunk: the copy of chunk i+1 runs while chunk i is written. It returns the bytes written.
// When w fails (or writes short, io.ErrShortWrite) or ctx is done, no further copy is queued, the
// stream drains, the buffers go back to the pool, and the error is returned with the bytes written.
// A stream that cannot be drained keeps the buffers out of the pool (ErrStreamNotDrained).
func (s *Stager) DeviceToWriter(ctx context.Context, w io.Writer, src driver.DevicePtr, n uint64) (written int64, err error) {
	const op = "stage device to writer"
	if w == nil {
		return 0, fmt.Errorf("pinned: %s: nil writer: %w", op, ErrInvalidValue)
	}
	if n == 0 {
		return 0, nil
	}
	if err := checkTransfer(op, src, n); err != nil {
		return 0, err
	}
	if s.pool.region.ReadOnly() {
		return 0, fmt.Errorf("pinned: %s: the devices may only read %s: %w", op, s.pool.region, ErrInvalidValue)
	}
	bufs, err := s.begin(ctx, op)
	if err != nil {
		return 0, err
	}
	defer func() { err = s.end(bufs, err) }()

	chunk := s.pool.BufferSize()
	k := uint64(len(bufs))
	chunks := (n + chunk - 1) / chunk
	size := func(i uint64) uint64 { return min(chunk, n-i*chunk) }
	queue := func(i uint64) error {
		b := bufs[i%k]
		if err := s.dev.CopyDtoHAsync(b.pointer(), src+driver.DevicePtr(i*chunk), size(i), s.stream); err != nil {
			return fmt.Errorf("pinned: %s: chunk %d of %d: %w", op, i, chunks, err)
		}
		return s.events[i%k].Record(s.stream)
	}
	next := uint64(0)
	for ; next < min(k, chunks); next++ {
		if err := queue(next); err != nil {
			return 0, err
		}
	}
	for i := uint64(0); i < chunks; i++ {
		if err := s.events[i%k].Synchronize(); err != nil {
			return written, fmt.Errorf("pinned: %s: chunk %d of %d: %w", op, i, chunks, err)
		}
		m := size(i)
		nw, werr := writeChunk(w, bufs[i%k].Bytes()[:m])
		written += int64(nw)
		if werr != nil {
			return written, fmt.Errorf("pinned: %s: writing chunk %d of %d (%s written of %s): %w", op, i, chunks, units.FormatSize(uint64(written)), units.FormatSize(n), werr)
		}
		if err := ctx.Err(); err != nil {
			return written, fmt.Errorf("pinned: %s: after %s of %s: %w", op, units.FormatSize(uint64(written)), units.FormatSize(n), err)
		}
		if next < chunks {
			if err := queue(next); err != nil {
				return written, err
			}
			next++
		}
	}
	return written, nil
}

// writeChunk writes p to w: a short write is io.ErrShortWrite, and a count no io.Writer may return
// (negative, or more than p) is an error that counts nothing, as in io.Copy.
func writeChunk(w io.Writer, p []byte) (int, error) {
	n, err := w.Write(p)
	if n < 0 || n > len(p) {
		return 0, errors.Join(err, fmt.Errorf("the writer returned %d bytes written of %d: %w", n, len(p), ErrInvalidValue))
	}
	if err == nil && n < len(p) {
		err = io.ErrShortWrite
	}
	return n, err
}

// ReaderToDevice reads n bytes from r into device memory at dst (reachable by the stager's device),
// chunk by chunk: chunk i+1 is read while chunk i is copied. It returns the bytes read. A reader that
// ends early gives an error wrapping io.ErrUnexpectedEOF, after the bytes it gave are copied; a reader
// error or ctx ends the transfer the same way. The stream drains before ReaderToDevice returns (or
// the buffers stay held: ErrStreamNotDrained).
func (s *Stager) ReaderToDevice(ctx context.Context, dst driver.DevicePtr, r io.Reader, n uint64) (read int64, err error) {
	const op = "stage reader to device"
	if r == nil {
		return 0, fmt.Errorf("pinned: %s: nil reader: %w", op, ErrInvalidValue)
	}
	if n == 0 {
		return 0, nil
	}
	if err := checkTransfer(op, dst, n); err != nil {
		return 0, err
	}
	bufs, err := s.begin(ctx, op)
	if err != nil {
		return 0, err
	}
	defer func() { err = s.end(bufs, err) }()

	chunk := s.pool.BufferSize()
	k := uint64(len(bufs))
	chunks := (n + chunk - 1) / chunk
	for i := uint64(0); i < chunks; i++ {
		if err := ctx.Err(); err != nil {
			return read, fmt.Errorf("pinned: %s: after %s of %s: %w", op, units.FormatSize(uint64(read)), units.FormatSize(n), err)
		}
		b := bufs[i%k]
		if i >= k {
			// The copy out of this buffer (chunk i-k) must be done before it is refilled.
			if err := s.events[i%k].Synchronize(); err != nil {
				return read, fmt.Errorf("pinned: %s: chunk %d of %d: %w", op, i-k, chunks, err)
			}
		}
		m := min(chunk, n-i*chunk)
		nr, rerr := io.ReadFull(checkedReader{r}, b.Bytes()[:m])
		read += int64(nr)
		if nr > 0 {
			if err := s.dev.CopyHtoDAsync(dst+driver.DevicePtr(i*chunk), b.pointer(), uint64(nr), s.stream); err != nil {
				return read, fmt.Errorf("pinned: %s: chunk %d of %d: %w", op, i, chunks, err)
			}
			if err := s.events[i%k].Record(s.stream); err != nil {
				return read, fmt.Errorf("pinned: %s: chunk %d of %d: %w", op, i, chunks, err)
			}
		}
		if rerr != nil {
			if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
				return read, fmt.Errorf("pinned: %s: the reader ended after %d of %d bytes: %w", op, read, n, io.ErrUnexpectedEOF)
			}
			return read, fmt.Errorf("pinned: %s: reading chunk %d of %d: %w", op, i, chunks, rerr)
		}
	}
	return read, nil
}

// checkedReader refuses a count that no io.Reader may return (negative, or more than the buffer
// holds): io.ReadFull would pass it on, and the copy of the chunk would run past the buffer.
type checkedReader struct{ r io.Reader }

func (c checkedReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	if n < 0 || n > len(p) {
		return 0, fmt.Errorf("the reader returned %d bytes for a buffer of %d: %w", n, len(p), ErrInvalidValue)
	}
	return n, err
}

func (s *Stager) free() error {
	var errs []error
	left := s.events[:0]
	for _, e := range s.events {
		if err := e.Close(); err != nil {
			errs = append(errs, err)
			left = append(left, e)
		}
	}
	s.events = left
	if err := s.stream.Close(); err != nil { // kept, closed, for Stream: read without the lock
		errs = append(errs, err)
	}
	if s.ownsPool {
		errs = append(errs, s.pool.Close())
	}
	return errors.Join(errs...)
}

// Close waits for a running transfer, gives back the buffers a failed drain held once the stream
// drains (while it cannot, Close fails with an error wrapping ErrStreamNotDrained and frees nothing),
// then destroys the stream and events and closes the stager's own pool (a pool given in the options
// stays open). Idempotent, nil-safe; when a step fails the stager keeps what it could not free and a
// later Close retries.
func (s *Stager) Close() error {
	if s == nil {
		return nil
	}
	s.own.Lock()
	defer s.own.Unlock()
	if s.own.Closed() {
		return nil
	}
	s.closing = true
	if err := s.reclaim(); errors.Is(err, ErrStreamNotDrained) {
		return fmt.Errorf("pinned: close stager: %w", err)
	}
	if err := s.free(); err != nil {
		return err
	}
	s.own.MarkClosed()
	return nil
}
