package vmm

import (
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/units"
)

// Stream is a CUDA stream of one device (cuStreamCreate). Work queued on it runs in order.
type Stream struct {
	owner
	s driver.Stream
}

// StreamOptions describe a stream made by CreateStream. The zero value is a blocking stream.
type StreamOptions struct {
	// NonBlocking makes a stream that does not synchronise with the legacy default stream
	// (CU_STREAM_NON_BLOCKING), which is what copy streams want.
	NonBlocking bool
}

// CreateStream creates a stream (cuStreamCreate).
func (d *Device) CreateStream(opts StreamOptions) (*Stream, error) {
	if d == nil {
		return nil, fmt.Errorf("vmm: create a stream on a nil device: %w", ErrInvalidValue)
	}
	flags := driver.StreamDefault
	if opts.NonBlocking {
		flags = driver.StreamNonBlocking
	}
	s := &Stream{owner: owner{dev: d}}
	if err := d.create(&s.own, "stream", func(api driver.API) error {
		var err error
		s.s, err = api.StreamCreate(flags)
		return err
	}); err != nil {
		return nil, fmt.Errorf("vmm: device %d: cuStreamCreate: %w", d.ordinal, err)
	}
	lifetime.Track(s, &s.own)
	return s, nil
}

// NewStream creates a stream, non-blocking when nonBlocking is true.
//
// Deprecated: use CreateStream(StreamOptions{NonBlocking: ...}), which names what the flag means.
func (d *Device) NewStream(nonBlocking bool) (*Stream, error) {
	return d.CreateStream(StreamOptions{NonBlocking: nonBlocking})
}

// Handle is the raw CUstream; nil (*Stream)(nil) means the legacy default stream 0. It is valid
// until Close, which the stream's own methods wait for but a call made with the raw value does not:
// after Close the driver may give the value to a new stream. Like os.File.Fd, it is the caller's to
// keep from racing Close.
func (s *Stream) Handle() driver.Stream {
	if s == nil {
		return 0
	}
	return s.s
}

// begin counts a call that passes the stream's handle to the driver until end (see owner.begin).
func (s *Stream) begin(op string) (end func(), err error) {
	if s == nil {
		return func() {}, nil // the legacy default stream
	}
	return s.owner.begin(op + " on a closed stream")
}

// Hold keeps the stream's handle valid until release is called: Close waits for every hold to be
// released (new holds are refused with ErrClosed meanwhile). It is for a caller that passes Handle
// to the driver or to another library itself, as nccl does when it queues operations, so that a
// Close on another goroutine cannot destroy the stream, and the driver give its value to a new one,
// in between. Release promptly: hold only while making the calls, not while their work runs. The
// legacy default stream (nil) needs no hold. A closed stream is refused with an error wrapping
// ErrClosed. Calling release again does nothing. Unlike Allocation.Hold, which makes Close fail with
// ErrInUse while the memory is held, a stream's hold is brief and Close waits for it.
func (s *Stream) Hold() (release func(), err error) {
	end, err := s.begin("hold")
	if err != nil {
		return nil, err
	}
	return sync.OnceFunc(end), nil
}

// Closed reports whether the stream was closed; the legacy default stream (nil) never is.
func (s *Stream) Closed() bool { return s != nil && s.own.IsClosed() }

// Synchronize waits until all work queued on the stream is done (cuStreamSynchronize). The legacy
// default stream (nil) belongs to no one device: use Device.Synchronize.
func (s *Stream) Synchronize() error {
	if s == nil {
		return fmt.Errorf("vmm: synchronize: the legacy default stream has no device (use Device.Synchronize): %w", ErrInvalidValue)
	}
	end, err := s.begin("synchronize")
	if err != nil {
		return err
	}
	defer end()
	if err := s.dev.do(func(api driver.API) error { return api.StreamSynchronize(s.s) }); err != nil {
		return fmt.Errorf("vmm: device %d: cuStreamSynchronize: %w", s.dev.ordinal, err)
	}
	return nil
}

// ErrNotDrained: Drain could not synchronize a stream, so work may still be queued on it. Memory
// that such work reads or writes must be neither freed nor reused until a later synchronization
// succeeds.
var ErrNotDrained = errors.New("vmm: the stream could not be drained")

// DrainAttempts is how many synchronizations the library's own drains try (offload, the stager, the
// copy broker) before they hold the memory a failed copy used.
const DrainAttempts = 3

// Drain synchronizes the stream up to attempts times (at least once), until every operation queued
// on it is complete; it is what to call after a queued copy failed, before the memory the copy used
// is freed or reused. A failed synchronization may report a queued operation's error, so one that
// fails before a later one succeeds is still returned; when every attempt fails the error wraps
// ErrNotDrained as well as each attempt's error. A closed stream cannot be drained (the work queued
// before its Close still runs, and only Device.Synchronize can wait for it): its error wraps
// ErrNotDrained and ErrClosed.
func (s *Stream) Drain(attempts int) error {
	if s == nil {
		return s.Synchronize() // refused: nothing was queued through it to drain
	}
	var errs []error
	for range max(attempts, 1) {
		err := s.Synchronize()
		if err == nil {
			break
		}
		errs = append(errs, err)
	}
	switch {
	case len(errs) == 0:
		return nil
	case len(errs) == max(attempts, 1):
		return fmt.Errorf("%w after %d attempts: %w", ErrNotDrained, len(errs), errors.Join(errs...))
	}
	return fmt.Errorf("vmm: stream drained on attempt %d: %w", len(errs)+1, errors.Join(errs...))
}

// Close destroys the stream (cuStreamDestroy); queued work still completes. Calls on the stream in
// progress on other goroutines end first (Close waits for a Synchronize until its work is done), and
// calls made from then on fail with ErrClosed. Idempotent, nil-safe.
func (s *Stream) Close() error {
	if s == nil {
		return nil
	}
	return s.close("stream (cuStreamDestroy)", func(api driver.API) error { return api.StreamDestroy(s.s) })
}

// Event is a CUDA event (cuEventCreate), used to order work between streams and to time it.
type Event struct {
	owner
	e driver.Event
}

// NewEvent creates an event; timing events can be used with Elapsed. Synchronize on it waits the
// context's default way (the primary context's automatic mode: it spins on a CPU while the process
// has no more contexts than the machine has cores), which returns soonest after a short wait.
func (d *Device) NewEvent(timing bool) (*Event, error) {
	flags := driver.EventDefault
	if !timing {
		flags = driver.EventDisableTiming
	}
	return d.newEvent(flags)
}

// NewBlockingEvent creates an event without timing whose Synchronize puts the calling thread to
// sleep until the event completes (CU_EVENT_BLOCKING_SYNC) instead of spinning on a CPU: for
// goroutines that wait often while others need the cores, such as goroutines that read a file
// while their copies run.
func (d *Device) NewBlockingEvent() (*Event, error) {
	return d.newEvent(driver.EventDisableTiming | driver.EventBlockingSync)
}

func (d *Device) newEvent(flags uint32) (*Event, error) {
	if d == nil {
		return nil, fmt.Errorf("vmm: create an event on a nil device: %w", ErrInvalidValue)
	}
	e := &Event{owner: owner{dev: d}}
	if err := d.create(&e.own, "event", func(api driver.API) error {
		var err error
		e.e, err = api.EventCreate(flags)
		return err
	}); err != nil {
		return nil, fmt.Errorf("vmm: device %d: cuEventCreate: %w", d.ordinal, err)
	}
	lifetime.Track(e, &e.own)
	return e, nil
}

// begin counts a call that passes the event's handle to the driver until end (see owner.begin).
func (e *Event) begin(op string) (end func(), err error) {
	if e == nil {
		return nil, fmt.Errorf("vmm: %s: nil event: %w", op, ErrInvalidValue)
	}
	return e.owner.begin(op + " on a closed event")
}

// Record records the event on s (nil: the default stream) (cuEventRecord).
func (e *Event) Record(s *Stream) error {
	end, err := e.begin("record")
	if err != nil {
		return err
	}
	defer end()
	endS, err := s.begin("record event")
	if err != nil {
		return err
	}
	defer endS()
	if err := e.dev.do(func(api driver.API) error { return api.EventRecord(e.e, s.Handle()) }); err != nil {
		return fmt.Errorf("vmm: device %d: cuEventRecord: %w", e.dev.ordinal, err)
	}
	return nil
}

// Synchronize waits for the event (cuEventSynchronize).
func (e *Event) Synchronize() error {
	end, err := e.begin("synchronize")
	if err != nil {
		return err
	}
	defer end()
	if err := e.dev.do(func(api driver.API) error { return api.EventSynchronize(e.e) }); err != nil {
		return fmt.Errorf("vmm: device %d: cuEventSynchronize: %w", e.dev.ordinal, err)
	}
	return nil
}

// Elapsed is the GPU time from start to e, both recorded and complete (cuEventElapsedTime).
func (e *Event) Elapsed(start *Event) (time.Duration, error) {
	end, err := e.begin("elapsed time")
	if err != nil {
		return 0, err
	}
	defer end()
	endStart, err := start.begin("elapsed time")
	if err != nil {
		return 0, err
	}
	defer endStart()
	var ms float32
	if err := e.dev.do(func(api driver.API) error {
		var err error
		ms, err = api.EventElapsedTime(start.e, e.e)
		return err
	}); err != nil {
		return 0, fmt.Errorf("vmm: device %d: cuEventElapsedTime: %w", e.dev.ordinal, err)
	}
	return time.Duration(float64(ms) * float64(time.Millisecond)), nil
}

// Close destroys the event (cuEventDestroy). Calls on the event in progress on other goroutines end
// first (Close waits for a Synchronize until the recorded work is done), and calls made from then on
// fail with ErrClosed. Idempotent, nil-safe.
func (e *Event) Close() error {
	if e == nil {
		return nil
	}
	return e.close("event (cuEventDestroy)", func(api driver.API) error { return api.EventDestroy(e.e) })
}

// CopyHtoD copies src into device memory at dst and waits (cuMemcpyHtoD).
func (d *Device) CopyHtoD(dst driver.DevicePtr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	if err := d.do(func(api driver.API) error {
		return api.MemcpyHtoD(dst, unsafe.Pointer(&src[0]), uint64(len(src)))
	}); err != nil {
		return fmt.Errorf("vmm: device %d: copy %s host to device %#x: %w", d.ordinal, units.FormatSize(uint64(len(src))), uint64(dst), err)
	}
	return nil
}

// CopyDtoH copies device memory at src into dst and waits (cuMemcpyDtoH).
func (d *Device) CopyDtoH(dst []byte, src driver.DevicePtr) error {
	if len(dst) == 0 {
		return nil
	}
	if err := d.do(func(api driver.API) error {
		return api.MemcpyDtoH(unsafe.Pointer(&dst[0]), src, uint64(len(dst)))
	}); err != nil {
		return fmt.Errorf("vmm: device %d: copy %s device %#x to host: %w", d.ordinal, units.FormatSize(uint64(len(dst))), uint64(src), err)
	}
	return nil
}

// Copy copies n bytes between any two unified addresses and waits (cuMemcpy).
func (d *Device) Copy(dst, src driver.DevicePtr, n uint64) error {
	if err := d.do(func(api driver.API) error { return api.Memcpy(dst, src, n) }); err != nil {
		return fmt.Errorf("vmm: device %d: copy %s from %#x to %#x: %w", d.ordinal, units.FormatSize(n), uint64(src), uint64(dst), err)
	}
	return nil
}

// CopyAsync queues a copy of n bytes between unified addresses on s (cuMemcpyAsync). Host memory
// involved must be pinned and stay valid until the stream passes the copy.
func (d *Device) CopyAsync(dst, src driver.DevicePtr, n uint64, s *Stream) error {
	end, err := s.begin("copy")
	if err != nil {
		return err
	}
	defer end()
	if err := d.do(func(api driver.API) error { return api.MemcpyAsync(dst, src, n, s.Handle()) }); err != nil {
		return fmt.Errorf("vmm: device %d: async copy %s from %#x to %#x: %w", d.ordinal, units.FormatSize(n), uint64(src), uint64(dst), err)
	}
	return nil
}

// CopyHtoDAsync queues a host-to-device copy on s (cuMemcpyHtoDAsync); src must be pinned memory
// (never the Go heap) that stays valid until the copy completes.
func (d *Device) CopyHtoDAsync(dst driver.DevicePtr, src unsafe.Pointer, n uint64, s *Stream) error {
	end, err := s.begin("copy")
	if err != nil {
		return err
	}
	defer end()
	if err := d.do(func(api driver.API) error { return api.MemcpyHtoDAsync(dst, src, n, s.Handle()) }); err != nil {
		return fmt.Errorf("vmm: device %d: async copy %s host to device %#x: %w", d.ordinal, units.FormatSize(n), uint64(dst), err)
	}
	return nil
}

// CopyDtoHAsync queues a device-to-host copy on s (cuMemcpyDtoHAsync); dst must be pinned memory
// that stays valid until the copy completes.
func (d *Device) CopyDtoHAsync(dst unsafe.Pointer, src driver.DevicePtr, n uint64, s *Stream) error {
	end, err := s.begin("copy")
	if err != nil {
		return err
	}
	defer end()
	if err := d.do(func(api driver.API) error { return api.MemcpyDtoHAsync(dst, src, n, s.Handle()) }); err != nil {
		return fmt.Errorf("vmm: device %d: async copy %s device %#x to host: %w", d.ordinal, units.FormatSize(n), uint64(src), err)
	}
	return nil
}

// Memset sets n bytes at ptr to v and waits (cuMemsetD8).
func (d *Device) Memset(ptr driver.DevicePtr, v uint8, n uint64) error {
	if err := d.do(func(api driver.API) error { return api.MemsetD8(ptr, v, n) }); err != nil {
		return fmt.Errorf("vmm: device %d: memset %s at %#x: %w", d.ordinal, units.FormatSize(n), uint64(ptr), err)
	}
	return nil
}
