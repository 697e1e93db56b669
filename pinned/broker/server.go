package broker

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/internal/unixsock"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// Grant is the part of the region one worker may copy to and from: [Offset, Offset+Length) in region
// offsets. ShareRegion lets the worker also map the whole region for its CPU (Client.Region): that
// hands it every byte of the region, not only its window, so a partial window should share only
// when the workers trust each other.
type Grant struct {
	Offset, Length uint64
	ShareRegion    bool
}

// Options tunes Listen. The zero value serves workers of this process's uid, each granted the
// whole region (shareable), on the region's devices with four streams each.
type Options struct {
	// Devices are the devices the broker copies on: a buffer must live on one of them. Each must be
	// able to reach the region. Default: the devices a host-NUMA region is granted to, or for other
	// kinds the region's own device (a registration is visible to every device, but serving a device
	// retains its context, about 524 MiB: name the devices to serve more).
	Devices []*vmm.Device
	// StreamsPerDevice is the number of non-blocking copy streams per device (default 4): copies of
	// all workers on one device share them, so up to that many run or wait on the GPU at once.
	StreamsPerDevice int
	// AllowUIDs are the uids whose processes may connect (SO_PEERCRED). Empty: this process's uid.
	AllowUIDs []int
	// Authorize, when set, runs after the uid check with the peer's credentials; an error refuses the
	// peer (the text is sent to it).
	Authorize func(peer unix.Ucred) error
	// Grant, when set, gives each worker its window of the region; an error refuses the worker.
	// Default: the whole region, shareable.
	Grant func(peer unix.Ucred) (Grant, error)
	// MaxBuffers is the most buffers one worker may have registered at once (default 1024; it
	// cannot be turned off: a negative value is refused).
	MaxBuffers int
	// MaxRegisteredBytes is the most address space the broker reserves for one worker's registered
	// buffers, each counted at its descriptor's size, holes between chunks included (default
	// DefaultMaxRegisteredBytes; negative: no cap). It keeps workers from exhausting the broker's
	// address space (a GPU's is 128 TiB) by registering large or sparse buffers, or one buffer many
	// times: MaxConnsPerUID × MaxRegisteredBytes is what one uid can take. Raise it for workers
	// whose buffers span more.
	MaxRegisteredBytes int64
	// MaxInFlight is the most copies of one worker the broker runs or queues at once (default 64;
	// it cannot be turned off: a negative value is refused); beyond it the broker stops reading that
	// worker's requests until one completes.
	MaxInFlight int
	// InlineMax: a copy of at most this many bytes (default 64 KiB) runs on the connection's own
	// goroutine when a stream is free, which saves a goroutine hand-off on small requests. Negative:
	// never.
	InlineMax int64
	// SpinMax: the broker waits for a copy of at most this many bytes by spinning
	// (cuStreamSynchronize), which answers soonest; for a larger copy it waits on a blocking event,
	// so that its thread sleeps instead of keeping a core busy for the whole copy (default
	// DefaultSpinMax; negative: every copy sleeps; math.MaxInt64: every copy spins).
	SpinMax int64
	// HelloTimeout bounds the wait for a new connection's first request (default 10 s; negative:
	// no bound, IdleTimeout does not apply before the hello either).
	HelloTimeout time.Duration
	// MaxConns caps the connections served at once (default 256); one more is refused with
	// StatusConnLimit (ErrConnLimit on the worker) and closed.
	MaxConns int
	// MaxConnsPerUID caps the connections of one uid served at once (default 64).
	MaxConnsPerUID int
	// IdleTimeout drops a worker that sends no request for this long while none of its copies is
	// in flight (default 1 min; negative: never); its buffers are released. The hello tells the
	// Client, which pings ahead of it, so only peers that stopped talking are dropped. The hello
	// carries tenths of a second, rounded down: a timeout below 100 ms is refused.
	IdleTimeout time.Duration
	// ReadTimeout drops a worker that starts a message and does not finish it within this long
	// (default 10 s; negative: the idle timeout bounds it, copies in flight or not), with
	// StatusTimeout.
	ReadTimeout time.Duration
	// WriteTimeout bounds each response and region sent (default 10 s): a worker that stops reading
	// loses its connection instead of holding the broker (once its copies queued on a stream have
	// landed, as at every end of a connection).
	WriteTimeout time.Duration
	// Logf, when set, receives the broker's events: refused peers, protocol faults, disconnects with
	// the work drained, failures of cleanup.
	Logf func(format string, args ...any)
}

// DefaultMaxRegisteredBytes is Options.MaxRegisteredBytes's default: 1 TiB, more than the memory
// of eight H200s, so that the default 64 connections of one uid take at most half of a GPU's
// 128 TiB of address space.
const DefaultMaxRegisteredBytes = 1 << 40

// DefaultSpinMax is Options.SpinMax's default: a copy of 4 MiB takes about 80 µs on a 50 GB/s
// link, long enough that the wake-up of a sleeping thread hardly shows, and a 1 MiB copy, for which it
// would, still spins.
const DefaultSpinMax = 4 << 20

// Stats are a server's counters.
type Stats struct {
	Workers     int    // connected now (past the hello)
	Buffers     int    // registered now, over all workers
	InFlight    int64  // copies accepted and not yet answered
	Connections uint64 // connections accepted since the start
	Refused     uint64 // connections refused (uid, Authorize, caps, Grant, protocol before the hello)
	Dropped     uint64 // workers dropped for going silent (IdleTimeout), a half-sent message or not reading (WriteTimeout)
	Copies      uint64 // copies completed
	Bytes       uint64 // bytes copied
	Failed      uint64 // requests answered with an error
	Drained     uint64 // disconnects cleaned up (in-flight work drained, buffers released)
}

// Server is a copy broker: it owns the use of a pinned region and copies between it and the device
// buffers its workers register. Make one with Listen, run Serve (usually in its own goroutine), and
// Close it before closing the region.
type Server struct {
	region  *pinned.Region
	path    string
	ln      *unixsock.Listener
	opts    Options
	lanes   map[int]*lane // by device ordinal
	devMask uint64

	// own's lock guards workers and the lanes' streams. It is closed as soon as Close begins, so that
	// no connection starts serving after; a later Close waits for the first, then only retries the
	// streams.
	own     lifetime.Owner
	workers map[*worker]struct{}
	quit    chan struct{} // closed when Close begins: retired streams stop retrying (see retire)
	closeMu sync.Mutex    // held through Close, so that a second Close waits for the first
	// gate counts each copy from before it is queued on a stream until it is complete, or its
	// stream drained or given up by retire, as a call in progress (Begin, End; see beginCopy). Close
	// closes it before it closes the connections: a copy is queued and drained before then (or its
	// retired stream has had its last try), or not queued at all.
	gate lifetime.Owner

	inFlight                                              atomic.Int64
	refused, copies, bytes, failed, drained, nbufs, drops atomic.Uint64
}

// lane is one device's copy streams; free holds the streams not in use.
type lane struct {
	dev     *vmm.Device
	streams []*copyStream
	free    chan *copyStream
}

// copyStream is a copy stream with the blocking event that a copy larger than Options.SpinMax is
// waited for on.
type copyStream struct {
	st   *vmm.Stream
	done *vmm.Event
}

// wait waits for the copy of n bytes just queued on the stream: spinning up to spinMax bytes, else
// sleeping on the event. When it fails the copy may still be queued: see Server.settle.
func (c *copyStream) wait(n uint64, spinMax int64) error {
	if spinMax >= 0 && n <= uint64(spinMax) {
		return c.st.Synchronize()
	}
	if err := c.done.Record(c.st); err != nil {
		return err
	}
	return c.done.Synchronize()
}

// newCopyStream makes a non-blocking stream and its blocking event on d; on error nothing is left.
func newCopyStream(d *vmm.Device) (*copyStream, error) {
	st, err := d.CreateStream(vmm.StreamOptions{NonBlocking: true})
	if err != nil {
		return nil, err
	}
	done, err := d.NewBlockingEvent()
	if err != nil {
		return nil, errors.Join(err, st.Close())
	}
	return &copyStream{st: st, done: done}, nil
}

// close destroys the event and the stream (vmm owners: nil-safe, nothing on a second Close, and
// retried by a later call when a destroy fails).
func (c *copyStream) close() error { return errors.Join(c.done.Close(), c.st.Close()) }

// Deprecated: NewServer is Listen.
func NewServer(region *pinned.Region, path string, opts Options) (*Server, error) {
	return Listen(region, path, opts)
}

// Listen creates the socket at path (mode 0600, in a private directory: see ipc.Listen) and the
// copy streams, and returns a server that is not serving yet. The region stays the caller's: it must
// stay open until the server is closed.
func Listen(region *pinned.Region, path string, opts Options) (*Server, error) {
	if region == nil {
		return nil, fmt.Errorf("broker: listen: nil region: %w", ErrInvalidValue)
	}
	if region.Len() == 0 || region.Device() == nil {
		return nil, fmt.Errorf("broker: listen on %s: the region has no device (open it through one): %w", region, ErrInvalidValue)
	}
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	devs, err := servedDevices(region, opts.Devices)
	if err != nil {
		return nil, err
	}
	s := &Server{region: region, path: path, opts: opts, lanes: map[int]*lane{}, workers: map[*worker]struct{}{},
		quit: make(chan struct{})}
	if err := s.openLanes(devs); err != nil {
		return nil, errors.Join(err, s.undoLanes())
	}
	ln, err := unixsock.Listen(path, unixsock.Options{AllowUIDs: opts.AllowUIDs, Authorize: opts.Authorize,
		MaxConns: opts.MaxConns, MaxConnsPerUID: opts.MaxConnsPerUID, IdleTimeout: opts.IdleTimeout,
		ReadTimeout: opts.ReadTimeout, WriteTimeout: opts.WriteTimeout, MaxPayload: RequestSize, Refuse: s.refusePeer,
		Logf: func(f string, a ...any) { s.logf("broker: "+f, a...) }})
	if err != nil {
		return nil, errors.Join(fmt.Errorf("broker: %w", err), s.undoLanes())
	}
	s.ln = ln
	s.own.Init(nil, "copy broker")
	lifetime.Track(s, &s.own)
	return s, nil
}

// defaults fills in the zero options and refuses negative counts.
func (o *Options) defaults() error {
	if o.StreamsPerDevice == 0 {
		o.StreamsPerDevice = 4
	}
	if o.MaxBuffers == 0 {
		o.MaxBuffers = 1024
	}
	if o.MaxInFlight == 0 {
		o.MaxInFlight = 64
	}
	if o.MaxRegisteredBytes == 0 {
		o.MaxRegisteredBytes = DefaultMaxRegisteredBytes
	}
	if o.InlineMax == 0 {
		o.InlineMax = 64 << 10
	}
	if o.SpinMax == 0 {
		o.SpinMax = DefaultSpinMax
	}
	if o.HelloTimeout == 0 {
		o.HelloTimeout = 10 * time.Second
	}
	if o.IdleTimeout == 0 {
		o.IdleTimeout = time.Minute
	}
	if o.StreamsPerDevice < 0 || o.MaxBuffers < 0 || o.MaxInFlight < 0 {
		return fmt.Errorf("broker: listen: negative StreamsPerDevice, MaxBuffers or MaxInFlight: %w", ErrInvalidValue)
	}
	if o.IdleTimeout > 0 && o.IdleTimeout < idleUnit {
		return fmt.Errorf("broker: listen: IdleTimeout %v is below %v, which the hello cannot announce: %w", o.IdleTimeout, idleUnit, ErrInvalidValue)
	}
	return nil
}

// servedDevices is Options.Devices or its default: the devices a host-NUMA region is granted to, or
// the region's own device.
func servedDevices(region *pinned.Region, devs []*vmm.Device) ([]*vmm.Device, error) {
	if len(devs) == 0 {
		if region.Kind() == pinned.HostNUMA {
			for _, o := range region.Devices() {
				d, err := region.Device().System().Device(o)
				if err != nil {
					return nil, fmt.Errorf("broker: listen: %w", err)
				}
				devs = append(devs, d)
			}
		} else {
			devs = []*vmm.Device{region.Device()}
		}
	}
	if len(devs) == 0 {
		return nil, fmt.Errorf("broker: listen on %s: the region is visible to no device (grant it one): %w", region, ErrInvalidValue)
	}
	for _, d := range devs {
		if d == nil || d.System() != region.Device().System() {
			return nil, fmt.Errorf("broker: listen: a nil device or one of another System: %w", ErrInvalidValue)
		}
		if !region.VisibleTo(d) {
			return nil, fmt.Errorf("broker: listen: %s cannot reach %s (grant it access): %w", d, region, ErrDeviceNotServed)
		}
	}
	return devs, nil
}

// openLanes makes each served device's copy streams.
func (s *Server) openLanes(devs []*vmm.Device) error {
	for _, d := range devs {
		if s.lanes[d.Ordinal()] != nil {
			continue
		}
		l := &lane{dev: d, free: make(chan *copyStream, s.opts.StreamsPerDevice)}
		s.lanes[d.Ordinal()] = l
		for i := 0; i < s.opts.StreamsPerDevice; i++ {
			c, err := newCopyStream(d)
			if err != nil {
				return fmt.Errorf("broker: listen: %w", err)
			}
			l.streams = append(l.streams, c)
			l.free <- c
		}
		if d.Ordinal() < 64 {
			s.devMask |= 1 << d.Ordinal()
		}
	}
	return nil
}

// undoLanes destroys the streams of a Listen that failed.
func (s *Server) undoLanes() error { return s.closeLanes() }

// closeLanes destroys the copy streams and their events; those that fail stay for the next call.
func (s *Server) closeLanes() error {
	s.own.Lock()
	defer s.own.Unlock()
	var errs []error
	for _, l := range s.lanes {
		var kept []*copyStream
		for _, c := range l.streams {
			if err := c.close(); err != nil {
				errs = append(errs, err)
				kept = append(kept, c)
			}
		}
		l.streams = kept
	}
	return errors.Join(errs...)
}

// Path is the socket's path.
func (s *Server) Path() string { return s.path }

// Region is the region the server copies to and from.
func (s *Server) Region() *pinned.Region { return s.region }

// Devices are the ordinals of the devices the server copies on.
func (s *Server) Devices() []int {
	out := make([]int, 0, len(s.lanes))
	for o := range s.lanes {
		out = append(out, o)
	}
	sort.Ints(out)
	return out
}

// SpinMax is the largest copy the server waits for by spinning, its Options.SpinMax with the
// default filled in; -1 when every copy sleeps.
func (s *Server) SpinMax() int64 { return max(s.opts.SpinMax, -1) }

// Stats reads the server's counters.
func (s *Server) Stats() Stats {
	ls := s.ln.Stats()
	st := Stats{InFlight: s.inFlight.Load(), Connections: ls.Accepted, Refused: s.refused.Load() + ls.Refused,
		Copies: s.copies.Load(), Bytes: s.bytes.Load(), Failed: s.failed.Load(), Drained: s.drained.Load(),
		Buffers: int(s.nbufs.Load()), Dropped: s.drops.Load()}
	s.own.Lock()
	for w := range s.workers {
		if w.helloDone.Load() {
			st.Workers++
		}
	}
	s.own.Unlock()
	return st
}

func (s *Server) logf(format string, args ...any) {
	if s.opts.Logf != nil {
		s.opts.Logf(format, args...)
	}
}

// refusePeer tells a peer the transport refused (uid, Authorize, a cap) why.
func (s *Server) refusePeer(c *unixsock.Conn, err error) {
	var b [ResponseSize + MaxText]byte
	_ = c.Write(KindResponse, (&response{status: statusOf(err), text: err.Error()}).encode(b[:0]), nil)
}

// Serve accepts connections until Close, serving each in its own goroutine. It returns nil after
// Close, or the listener's error.
func (s *Server) Serve() error {
	err := s.ln.Serve(func(c *unixsock.Conn) {
		w := &worker{s: s, conn: c, cred: c.Peer(), bufs: map[uint32]*regBuffer{}, sem: make(chan struct{}, s.opts.MaxInFlight)}
		s.own.Lock()
		closed := s.own.Closed()
		if !closed {
			s.workers[w] = struct{}{}
		}
		s.own.Unlock()
		if !closed {
			w.serve()
		}
	})
	if err != nil {
		return fmt.Errorf("broker: %w", err)
	}
	return nil
}

// Close stops serving: it waits for the copies queued on its streams (a copy still waiting for a
// stream is not started), closes the listener (removing the socket file) and every connection,
// unmaps and releases every registered buffer, and destroys the copy streams. Workers see ErrBrokerGone. The region is left open. Close is idempotent and safe on nil;
// a Close made while another runs waits for it.
func (s *Server) Close() error {
	if s == nil {
		return nil
	}
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	if !s.own.Shut() {
		// An earlier Close drained the copies in flight and destroyed the streams; one that failed to
		// destroy a stream kept it: try again, and succeed only once none is left.
		if err := s.closeLanes(); err != nil {
			return fmt.Errorf("broker: close streams: %w", err)
		}
		return nil
	}
	close(s.quit)
	// Drain the copies already queued while their workers are still connected: one told the broker
	// is gone may use its memory and the region at once. Their answers may still go out. (No free
	// and no children: the gate's Close cannot fail.)
	_ = s.gate.Close("broker: copies", nil)
	var errs []error
	if err := s.ln.Close(); err != nil {
		errs = append(errs, fmt.Errorf("broker: %w", err))
	}
	if err := s.closeLanes(); err != nil {
		errs = append(errs, fmt.Errorf("broker: close streams: %w", err))
	}
	return errors.Join(errs...)
}

// worker is one connection.
type worker struct {
	s         *Server
	conn      *unixsock.Conn
	cred      unix.Ucred
	grant     Grant
	helloDone atomic.Bool
	// lost: a write failed, so the framing is lost: nothing more is sent or started, and the reader
	// ends the connection (writeFailed). Set under the connection's write lock.
	lost atomic.Bool

	pbuf [ResponseSize + MaxText]byte // response payloads; guarded by conn's write lock

	mu       sync.Mutex
	bufs     map[uint32]*regBuffer
	nextID   uint32
	reserved uint64 // address space of the buffers in bufs (Options.MaxRegisteredBytes)

	sem  chan struct{} // one slot per copy in flight
	jobs sync.WaitGroup
	// gate is the server's gate for this connection's copies: it is closed when the connection ends
	// (cleanup), since the worker no longer expects its copies: those not queued yet are dropped
	// (see runCopy), and those queued are drained before the connection closes.
	gate lifetime.Owner
}

// regBuffer is a worker's buffer, imported and mapped for one device.
type regBuffer struct {
	id      uint32
	buf     *ipc.Buffer
	lane    *lane
	ptr     driver.DevicePtr
	length  uint64
	size    uint64   // the address space reserved for it: its descriptor's size
	extents []extent // runs of adjacent chunks, in offset order
	users   sync.WaitGroup
	// stuck: a copy into the buffer may still be queued on a stream that could not be drained by
	// the time the server closed (see retire); release keeps it mapped.
	stuck atomic.Bool
}

// giveBack returns the stream of a copy into or out of b, drained, to its lane and lets go of b.
func (b *regBuffer) giveBack(cs *copyStream) {
	b.lane.free <- cs
	b.users.Done()
}

type extent struct{ off, end uint64 }

// covers reports whether [off, off+n) lies inside the buffer's chunks (no hole).
func (b *regBuffer) covers(off, n uint64) bool {
	end := off + n
	if end < off || end > b.length {
		return false
	}
	for _, e := range b.extents {
		if off >= e.off && end <= e.end {
			return true
		}
	}
	return false
}

func (w *worker) logf(format string, args ...any) {
	w.s.logf("broker: %s: worker pid %d: %s", w.s.path, w.cred.Pid, fmt.Sprintf(format, args...))
}

// reply writes one response, unless an earlier write failed. A write that fails (the worker is
// gone, or stopped reading for WriteTimeout) ends the connection (writeFailed): the reader stops
// and cleanup ends it.
func (w *worker) reply(r *response) {
	if r.status != StatusOK {
		w.s.failed.Add(1)
	}
	w.conn.Lock()
	err := w.send(func() error { return w.writeResponse(r) })
	w.conn.Unlock()
	if err != nil {
		w.writeFailed("writing a response", err)
	}
}

// send runs write, which writes on the connection, unless an earlier write failed (then it writes
// nothing and returns nil); a failure marks the connection lost. The caller holds the write lock.
func (w *worker) send(write func() error) error {
	if w.lost.Load() {
		return nil
	}
	err := write()
	if err != nil {
		w.lost.Store(true)
	}
	return err
}

// writeFailed ends a connection whose write failed (what says which, for the log); the framing is lost. It leaves the end to the
// reader, as every other end does: it shuts the connection's reading side, so that the reader stops
// (next) and cleanup drops the copies still waiting for a stream, drains those queued on one and
// releases the buffers before it closes the connection: the worker takes the end to mean that the
// broker holds nothing of it any more. A worker that stopped reading for WriteTimeout counts as
// dropped.
func (w *worker) writeFailed(what string, err error) {
	if !hangUp(err) {
		if errors.Is(err, os.ErrDeadlineExceeded) { // it stopped reading for WriteTimeout
			w.s.drops.Add(1)
		}
		w.logf("%s: %v (closing the connection once its copies are drained and its buffers released)", what, err)
	}
	_ = w.conn.Unix().CloseRead()
}

// stopCopies makes the copies of the connection not queued on a stream yet never start, and waits
// for those queued on one to complete or settle (on a retired stream: until it drains or the server
// closes). It does not wait for those still waiting for a stream (jobs does), which drop once they
// get one. (No free and no children: the gate's Close cannot fail.)
func (w *worker) stopCopies() { _ = w.gate.Close("broker: a connection's copies", nil) }

// beginCopy admits a copy to the streams unless Server.Close or the connection's end has begun, or
// a write failed (its answer cannot be sent, and the connection is ending): the copy counts in both
// gates until endCopy. It reports false, counting nothing, when either gate refuses.
func (w *worker) beginCopy() bool {
	if w.lost.Load() || !w.s.gate.Begin() {
		return false
	}
	if !w.gate.Begin() {
		w.s.gate.End()
		return false
	}
	return true
}

// endCopy ends a copy admitted by beginCopy, once it is complete or its stream drained or given up
// (settle, retire).
func (w *worker) endCopy() {
	w.gate.End()
	w.s.gate.End()
}

// hangUp reports whether err is the normal end of a connection: the peer or cleanup closed it.
func hangUp(err error) bool { return peerClosed(err) || errors.Is(err, net.ErrClosed) }

// peerClosed reports whether err says the other end closed the connection (or its process exited).
func peerClosed(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// writeResponse sends one response frame; the caller holds the connection's write lock.
func (w *worker) writeResponse(r *response) error {
	return w.conn.WriteLocked(KindResponse, r.encode(w.pbuf[:0]), nil)
}

func (w *worker) replyErr(op uint16, id uint64, err error) {
	w.reply(&response{op: op, id: id, status: statusOf(err), text: err.Error()})
}

// refuse answers the whole connection with a refusal (counted in Failed by reply).
func (w *worker) refuse(status uint16, msg string) {
	w.reply(&response{status: status, text: msg})
}

func (w *worker) serve() {
	defer w.cleanup()
	if !w.grantWindow() {
		return
	}
	req, err := w.hello()
	if err != nil {
		w.s.refused.Add(1)
		w.readFailed(err)
		return
	}
	w.helloDone.Store(true)
	flags := uint32(w.s.region.Kind())<<8 | idleUnits(w.s.opts.IdleTimeout)<<16
	if w.grant.ShareRegion {
		flags |= 1
	}
	w.reply(&response{op: OpHello, id: req.id, buffer: flags,
		values: [4]uint64{w.s.region.Len(), w.grant.Offset, w.grant.Length, w.s.devMask}})
	for w.next() {
	}
}

// idleUnits is the idle timeout as the hello carries it: tenths of a second, rounded down so that
// the client, which pings ahead of the announced value, is never late; at most 0xffff (a longer
// timeout is announced as that, and the client pings more often than needed). Listen refuses a
// positive timeout below one tenth.
func idleUnits(d time.Duration) uint32 {
	if d <= 0 {
		return 0
	}
	return uint32(min(d/idleUnit, 0xffff))
}

const idleUnit = 100 * time.Millisecond

// grantWindow gives the worker its window of the region (Options.Grant), or refuses it.
func (w *worker) grantWindow() bool {
	s := w.s
	w.grant = Grant{Length: s.region.Len(), ShareRegion: true}
	if s.opts.Grant == nil {
		return true
	}
	g, err := s.opts.Grant(w.cred)
	if err == nil && (g.Length == 0 || g.Offset > s.region.Len() || g.Length > s.region.Len()-g.Offset) {
		err = fmt.Errorf("window %s at offset %#x does not fit the %s region", units.FormatSize(g.Length), g.Offset, units.FormatSize(s.region.Len()))
	}
	if err != nil {
		s.refused.Add(1)
		msg := fmt.Sprintf("peer pid %d uid %d: no grant: %v", w.cred.Pid, w.cred.Uid, err)
		w.logf("refused: %s", msg)
		w.refuse(StatusPermission, msg)
		return false
	}
	w.grant = g
	return true
}

// hello reads the first request, which must be a hello, within HelloTimeout (if any: the idle
// timeout is for workers past the hello).
func (w *worker) hello() (request, error) {
	idle := w.conn.IdleTimeout()
	w.conn.SetIdleTimeout(max(w.s.opts.HelloTimeout, 0))
	req, err := readRequest(w.conn)
	w.conn.SetIdleTimeout(idle)
	if err == nil && req.op != OpHello {
		err = fmt.Errorf("broker: first request is %s, want hello: %w", opName(req.op), ErrProtocol)
	}
	return req, err
}

// next reads and runs one request; it reports whether the connection goes on.
func (w *worker) next() bool {
	req, err := readRequest(w.conn)
	if w.lost.Load() {
		return false // a write failed: the reading side is shut, the connection ends (writeFailed)
	}
	if errors.Is(err, ErrIdle) && len(w.sem) > 0 {
		return true // silent while its copies run: not idle
	}
	if err != nil {
		w.readFailed(err)
		return false
	}
	switch req.op {
	case OpHello:
		w.readFailed(fmt.Errorf("broker: a second hello: %w", ErrProtocol))
		return false
	case OpPing:
		w.reply(&response{op: OpPing, id: req.id})
	case OpCopy:
		w.startCopy(req)
	case OpRegister:
		if err := w.register(req); err != nil {
			w.readFailed(err)
			return false
		}
	case OpUnregister:
		w.unregister(req)
	case OpRegion:
		if err := w.shareRegion(req); err != nil {
			w.writeFailed("passing the region's file descriptor", err)
			return false
		}
	}
	return true
}

// readFailed ends a connection whose reads failed: a protocol fault is answered before hanging up;
// a hang-up is the normal end.
func (w *worker) readFailed(err error) {
	switch {
	case hangUp(err):
	case errors.Is(err, ErrIdle), errors.Is(err, ErrTimeout):
		w.s.drops.Add(1)
		w.logf("dropped: %v", err)
		w.refuse(statusOf(err), err.Error())
	case errors.Is(err, errRefused):
		w.logf("closing the connection: %v", err)
	case errors.Is(err, ErrProtocol):
		w.logf("protocol fault: %v (closing the connection)", err)
		w.refuse(StatusProtocol, err.Error())
	default:
		w.logf("reading requests: %v (closing the connection)", err)
	}
}

// cleanup runs when the connection ends, however: it drops the worker's copies still waiting for a
// stream, drains those queued on one, unmaps and releases every buffer the worker registered, and
// only then closes the connection, so that a worker that shut its side (Client.Close) and waits for
// the end knows that none of its copies runs any more.
func (w *worker) cleanup() {
	w.stopCopies()
	w.jobs.Wait()
	w.mu.Lock()
	bufs := w.bufs
	w.bufs = nil
	w.mu.Unlock()
	for _, b := range bufs {
		if err := w.release(b); err != nil {
			w.logf("releasing buffer %d: %v", b.id, err)
		}
	}
	_ = w.conn.Close()
	s := w.s
	s.own.Lock()
	delete(s.workers, w)
	s.own.Unlock()
	if w.helloDone.Load() {
		s.drained.Add(1)
		if len(bufs) > 0 {
			w.logf("disconnected: in-flight copies drained, %d buffers unmapped and released", len(bufs))
		}
	}
}

// lookup finds the request's buffer and checks both ranges; on success the buffer is held (users)
// until the copy ends.
func (w *worker) lookup(req request) (*regBuffer, error) {
	if req.length == 0 || req.hostOff < w.grant.Offset || req.hostOff-w.grant.Offset > w.grant.Length ||
		req.length > w.grant.Length-(req.hostOff-w.grant.Offset) {
		return nil, fmt.Errorf("broker: host range %s at region offset %#x is outside this worker's grant (%s at offset %#x): %w",
			units.FormatSize(req.length), req.hostOff, units.FormatSize(w.grant.Length), w.grant.Offset, ErrOutOfRange)
	}
	if req.dir == ToHost && w.s.region.ReadOnly() {
		return nil, fmt.Errorf("broker: copy to the host: devices may only read %s: %w", w.s.region, ErrPermission)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	b := w.bufs[req.buffer]
	if b == nil {
		return nil, fmt.Errorf("broker: buffer %d: %w", req.buffer, ErrUnknownBuffer)
	}
	if !b.covers(req.bufOff, req.length) {
		return nil, fmt.Errorf("broker: buffer %d (%s): range %s at offset %#x is outside the buffer's chunks: %w",
			req.buffer, units.FormatSize(b.length), units.FormatSize(req.length), req.bufOff, ErrOutOfRange)
	}
	b.users.Add(1)
	return b, nil
}

// startCopy checks a copy and runs it: inline when small and a stream is free, else on its own
// goroutine once a stream is free. The response goes out when the copy's stream has completed it.
func (w *worker) startCopy(req request) {
	b, err := w.lookup(req)
	if err != nil {
		w.replyErr(OpCopy, req.id, err)
		return
	}
	w.beginJob()
	if int64(req.length) <= w.s.opts.InlineMax {
		select {
		case st := <-b.lane.free:
			w.runCopy(req, b, st)
			return
		default:
		}
	}
	go func() { w.runCopy(req, b, <-b.lane.free) }()
}

// runCopy queues the copy on the stream and waits for it (queueCopy), then answers. Once Close has
// begun, or the connection has ended, it queues nothing (beginCopy): the worker is told the broker
// is gone as its connection closes (or closed it itself), and a copy started after that would write
// its memory or the region when the worker no longer expects it.
func (w *worker) runCopy(req request, b *regBuffer, cs *copyStream) {
	if !w.beginCopy() {
		w.dropCopy(b, cs)
		return
	}
	took, err := w.queueCopy(req, b, cs)
	w.endJob(func() { w.answerCopy(req, took, err) })
}

// queueCopy queues the copy on the stream, waits for it (see Options.SpinMax), gives the stream and
// the buffer back (after a failure, once the stream is drained: settle) and ends the copy's place in
// the gates. It returns how long the copy took to queue and complete.
func (w *worker) queueCopy(req request, b *regBuffer, cs *copyStream) (time.Duration, error) {
	t0 := time.Now()
	dst := b.ptr + driver.DevicePtr(req.bufOff)
	var err error
	if req.dir == ToDevice {
		err = w.s.region.CopyToDevice(cs.st, dst, req.hostOff, req.length)
	} else {
		err = w.s.region.CopyFromDevice(cs.st, dst, req.hostOff, req.length)
	}
	if err == nil {
		err = cs.wait(req.length, w.s.opts.SpinMax)
	}
	took := time.Since(t0)
	if err == nil {
		b.giveBack(cs)
		w.endCopy()
	} else if serr := w.s.settle(b, cs, w.endCopy); serr != nil {
		err = fmt.Errorf("%w; %w", err, serr)
	}
	return took, err
}

// answerCopy answers a copy that ran: its time and length, or its error.
func (w *worker) answerCopy(req request, took time.Duration, err error) {
	if err != nil {
		w.replyErr(OpCopy, req.id, fmt.Errorf("broker: copy %s %s (buffer %d offset %#x, region offset %#x): %v: %w",
			units.FormatSize(req.length), req.dir, req.buffer, req.bufOff, req.hostOff, err, ErrInternal))
		return
	}
	w.s.copies.Add(1)
	w.s.bytes.Add(req.length)
	w.reply(&response{op: OpCopy, id: req.id, values: [4]uint64{uint64(took.Nanoseconds()), req.length}})
}

// dropCopy gives back the stream and the buffer of a copy not queued because the server is closing
// or the connection ended, and counts it failed. It sends no answer: the connection is closed or
// closing, and the worker fails the request with ErrBrokerGone (or ErrClosed, if it closed it).
func (w *worker) dropCopy(b *regBuffer, cs *copyStream) {
	b.giveBack(cs)
	w.s.failed.Add(1)
	w.endJob(nil)
}

// beginJob counts a copy accepted: it takes a slot of Options.MaxInFlight (waiting for one), is
// waited for by cleanup (jobs) and counts in Stats.InFlight, until endJob.
func (w *worker) beginJob() {
	w.sem <- struct{}{}
	w.jobs.Add(1)
	w.s.inFlight.Add(1)
}

// endJob ends a copy counted by beginJob, answering it first (answer; nil: no answer). It is out of
// flight before it is answered: a client that saw the answer must not find it in Stats.
func (w *worker) endJob(answer func()) {
	w.s.inFlight.Add(-1)
	if answer != nil {
		answer()
	}
	<-w.sem
	w.jobs.Done()
}

// register reads the buffer that follows a register request, imports and maps it for its device.
// A returned error means the stream's framing is lost.
func (w *worker) register(req request) error {
	rcv, err := w.receiveBuffer()
	if err != nil {
		return err
	}
	defer rcv.Close()
	l, err := w.laneFor(&rcv.Desc)
	if err != nil {
		w.replyErr(OpRegister, req.id, err)
		return nil
	}
	buf, err := ipc.Open(l.dev, rcv, vmm.ReadWrite(l.dev))
	if err != nil && errors.Is(err, ErrProtocol) {
		// A file its sender could still resize (or one that lies about its size): the worker
		// loses its connection, the broker maps nothing of it.
		w.replyErr(OpRegister, req.id, fmt.Errorf("broker: register %s: %w", &rcv.Desc, err))
		return fmt.Errorf("register %s refused: %w: %w", &rcv.Desc, errRefused, err)
	}
	if err != nil {
		w.replyErr(OpRegister, req.id, fmt.Errorf("broker: register %s: %v: %w", &rcv.Desc, err, ErrInternal))
		return nil
	}
	b := &regBuffer{buf: buf, lane: l, ptr: buf.Ptr(), length: buf.Cap(), size: rcv.Desc.Size}
	for _, c := range rcv.Desc.Chunks {
		if k := len(b.extents); k > 0 && b.extents[k-1].end == c.Offset {
			b.extents[k-1].end += c.Size
		} else {
			b.extents = append(b.extents, extent{c.Offset, c.Offset + c.Size})
		}
	}
	w.add(b)
	w.reply(&response{op: OpRegister, id: req.id, buffer: b.id, values: [4]uint64{b.length, uint64(l.dev.Ordinal())}})
	return nil
}

// receiveBuffer reads the buffer that follows a register request within the read timeout (with
// none, the idle timeout): a worker that leaves it half-sent is dropped like one that leaves a
// request half-sent (ErrTimeout).
func (w *worker) receiveBuffer() (*ipc.Received, error) {
	uc := w.conn.Unix()
	d := w.conn.MessageTimeout()
	if d > 0 {
		_ = uc.SetReadDeadline(time.Now().Add(d))
	}
	rcv, err := ipc.Receive(uc)
	_ = uc.SetReadDeadline(time.Time{})
	var se *ipc.ServerError
	switch {
	case err != nil && errors.Is(err, os.ErrDeadlineExceeded):
		err = fmt.Errorf("broker: the buffer of a register request not received within %v: %w: %w", d, ErrTimeout, err)
	case errors.As(err, &se):
		// Not the worker's to send: its code would pass for the broker's own verdict.
		err = fmt.Errorf("broker: an ipc error message (code %d) where the buffer of a register request was due: %w", se.Code, ErrProtocol)
	}
	return rcv, err
}

// laneFor checks the worker's limits and the buffer's location and finds the device's lane.
func (w *worker) laneFor(d *ipc.Descriptor) (*lane, error) {
	if err := w.admit(d); err != nil {
		return nil, err
	}
	loc := d.Chunks[0].Location
	for _, c := range d.Chunks {
		if c.Location != loc {
			return nil, fmt.Errorf("broker: register %s: chunks at %s and %s: a buffer must live on one device: %w", d, loc, c.Location, ErrNotSupported)
		}
	}
	if loc.Type != driver.LocationDevice {
		return nil, fmt.Errorf("broker: register %s: memory at %s is not device memory (copy host memory on the CPU): %w", d, loc, ErrNotSupported)
	}
	l := w.s.lanes[int(loc.ID)]
	if l == nil {
		return nil, fmt.Errorf("broker: register %s: device %d (this broker serves %v): %w", d, loc.ID, w.s.Devices(), ErrDeviceNotServed)
	}
	return l, nil
}

// admit checks a buffer against the worker's limits: its count of buffers and the address space
// they take. A descriptor may not claim address space past its last chunk: mapped by nothing, it is
// of no use to a copy, and Open would reserve all of it. (Chunks are multiples of the granularity,
// so the last chunk's end is already rounded to it.)
func (w *worker) admit(d *ipc.Descriptor) error {
	last := d.Chunks[len(d.Chunks)-1]
	if end := last.Offset + last.Size; d.Size > end {
		return fmt.Errorf("broker: register %s: its chunks end at %s, the broker reserves no address space past a buffer's last chunk: %w",
			d, units.FormatSize(end), ErrOutOfRange)
	}
	w.mu.Lock()
	n, reserved := len(w.bufs), w.reserved
	w.mu.Unlock()
	if n >= w.s.opts.MaxBuffers {
		return fmt.Errorf("broker: %d buffers registered (Options.MaxBuffers): %w", n, ErrLimit)
	}
	if limit := w.s.opts.MaxRegisteredBytes; limit >= 0 && (d.Size > uint64(limit) || reserved > uint64(limit)-d.Size) {
		return fmt.Errorf("broker: register %s: this worker's buffers already take %s of address space, the most is %s (Options.MaxRegisteredBytes): %w",
			d, units.FormatSize(reserved), units.FormatSize(uint64(limit)), ErrLimit)
	}
	return nil
}

// add gives b the worker's next free id and records it.
func (w *worker) add(b *regBuffer) {
	w.mu.Lock()
	w.reserved += b.size
	for {
		w.nextID++
		if w.nextID != 0 && w.bufs[w.nextID] == nil {
			break
		}
	}
	b.id = w.nextID
	w.bufs[b.id] = b
	w.mu.Unlock()
	w.s.nbufs.Add(1)
}

// unregister forgets a buffer, waits for its copies in flight, then unmaps and releases it.
func (w *worker) unregister(req request) {
	w.mu.Lock()
	b := w.bufs[req.buffer]
	delete(w.bufs, req.buffer)
	w.mu.Unlock()
	if b == nil {
		w.replyErr(OpUnregister, req.id, fmt.Errorf("broker: unregister buffer %d: %w", req.buffer, ErrUnknownBuffer))
		return
	}
	if err := w.release(b); err != nil {
		w.replyErr(OpUnregister, req.id, fmt.Errorf("broker: unregister buffer %d: %v: %w", req.buffer, err, ErrInternal))
		return
	}
	w.reply(&response{op: OpUnregister, id: req.id})
}

// release waits for the copies on a buffer the worker no longer holds, then unmaps and releases it.
// What fails to close goes to the System, which retries it (System.RetryOrphans, System.Close), so
// that nothing is lost; the buffer no longer counts in Stats.Buffers either way.
func (w *worker) release(b *regBuffer) error {
	b.users.Wait()
	w.s.nbufs.Add(^uint64(0))
	w.mu.Lock()
	w.reserved -= b.size
	w.mu.Unlock()
	if b.stuck.Load() {
		return w.keepStuck(b)
	}
	err := b.buf.Close()
	if err != nil {
		kept := b.buf.Device().System().Keep(fmt.Sprintf("broker buffer %d of worker pid %d (%s)", b.id, w.cred.Pid, b.buf), b.buf.Close)
		err = fmt.Errorf("%w (%v)", err, kept)
	}
	return err
}

// shareRegion sends the region (an OK response, then pinned.Region.Share); nothing once an earlier
// write failed. A returned error means the connection is unusable.
func (w *worker) shareRegion(req request) error {
	if !w.grant.ShareRegion {
		w.replyErr(OpRegion, req.id, fmt.Errorf("broker: this worker's grant (%s at offset %#x) does not include mapping the region: %w",
			units.FormatSize(w.grant.Length), w.grant.Offset, ErrPermission))
		return nil
	}
	if k := w.s.region.Kind(); k != pinned.HostNUMA && k != pinned.SharedMemory {
		w.replyErr(OpRegion, req.id, fmt.Errorf("broker: a %s region has no file descriptor to pass: %w", k, ErrNotSupported))
		return nil
	}
	// Prepared before the answer: a region that cannot be shared (an export failing, out of file
	// descriptors) is answered as such, and the connection goes on.
	prep, err := w.s.region.PrepareShare()
	if err != nil {
		w.replyErr(OpRegion, req.id, fmt.Errorf("broker: share the region: %v: %w", err, ErrInternal))
		return nil
	}
	defer prep.Close()
	w.conn.Lock()
	defer w.conn.Unlock()
	return w.send(func() error {
		if err := w.writeResponse(&response{op: OpRegion, id: req.id}); err != nil {
			return err
		}
		return prep.Send(w.conn.Unix())
	})
}
