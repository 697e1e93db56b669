package broker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/internal/unixsock"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// DialOptions tunes DialContext.
type DialOptions struct {
	// AllowUIDs are the uids the broker may run as (SO_PEERCRED). Empty: this process's uid or root.
	AllowUIDs []int
	// Retry keeps dialing while the socket does not exist or nobody listens on it (a broker that is
	// starting or restarting), until the context ends.
	Retry bool
	// CloseTimeout bounds how long Client.Close waits for the broker to end the connection (0:
	// DefaultCloseTimeout).
	CloseTimeout time.Duration
}

// DefaultCloseTimeout is how long Client.Close waits for the broker to end the connection when
// DialOptions.CloseTimeout is 0: long enough for the copies of the largest buffers to drain.
const DefaultCloseTimeout = 30 * time.Second

// Info is what the broker told the client at connect time.
type Info struct {
	// Server is the broker's pid, uid and gid as the kernel reported them.
	Server unix.Ucred
	// RegionLen is the size of the broker's region in bytes; RegionKind how it is pinned.
	RegionLen  uint64
	RegionKind pinned.Kind
	// Grant is this worker's window of the region (host offsets of copies must lie in it) and
	// whether the worker may map the region (Client.Region).
	Grant Grant
	// Devices are the ordinals of the devices the broker copies on (below 64).
	Devices []int
	// IdleTimeout is how long the broker keeps a silent worker (0: forever); the Client pings it
	// ahead of that on its own.
	IdleTimeout time.Duration
}

// Client is a worker's connection to a broker. Its methods are safe for concurrent use: requests
// are pipelined on the one connection and complete in any order.
//
// A broker that stops reading (a worker at Options.MaxInFlight, a stopped broker) holds up the
// writes of requests. A call with a context (Copy, Ping, Register, Unregister, Region) returns an
// error wrapping the context's error once it ends: a request still waiting for another's write is
// not sent and the connection stays as it was; a request cut off in the middle of its own write
// leaves the connection's framing broken, so the Client closes the connection, and every later
// call fails with ErrBrokerGone (dial again). CopyAsync, which has no context, waits for its write
// until it is done or Close.
type Client struct {
	conn *unixsock.Conn
	info Info

	wlock    chan struct{}     // the write lock (one slot), taken before conn's, by a context's end
	wbuf     [RequestSize]byte // request payloads; guarded by wlock
	lastSend atomic.Int64      // unix nanoseconds of the last request written
	stopPing chan struct{}     // closed by Close: ends the keep-alive

	// own's lock guards pending and broken; it is never held across a write or a wait. The owner is
	// closed as soon as Close begins, so that requests made after fail with ErrClosed.
	own     lifetime.Owner
	pending map[uint64]*Completion
	broken  error // set once: the connection is unusable
	cause   error // what broke it first (set with broken)
	endErr  error // what ended the reader; written before done is closed

	closeTimeout time.Duration

	nextID atomic.Uint64
	done   chan struct{} // closed when the reader ends
	// closed is closed when the first Close has ended, with its result in closeErr: a Close made
	// meanwhile waits for it and returns the same.
	closed   chan struct{}
	closeErr error
}

// Completion is a request in flight; Wait for it. A Completion is done once, with the broker's
// answer or with the error that ended the connection.
type Completion struct {
	op   uint16
	done chan struct{}
	err  error
	resp response
	// OpRegion: how to open the region, and the result.
	regionDev  *vmm.Device
	regionOpts pinned.OpenOptions
	region     *pinned.Region
}

// Done is closed when the request is complete.
func (c *Completion) Done() <-chan struct{} { return c.done }

// Wait waits until the request is complete (the copy is in the memory, for a copy) or ctx ends, and
// returns the request's error. A context that ends first stops the wait, not the request: the broker
// may still perform the copy, so the host range and the buffer must stay as they are until the
// Completion is done.
func (c *Completion) Wait(ctx context.Context) error {
	select {
	case <-c.done:
		return c.err
	default:
	}
	select {
	case <-c.done:
		return c.err
	case <-ctx.Done():
		return fmt.Errorf("broker: waiting for %s: %w", opName(c.op), ctx.Err())
	}
}

// BrokerTime is, for a completed copy, the broker's time from queuing the copy on its stream to the
// stream's completion: the copy itself, without the round trip.
func (c *Completion) BrokerTime() time.Duration {
	select {
	case <-c.done:
		if c.err == nil && c.op == OpCopy {
			return time.Duration(c.resp.values[0])
		}
	default:
	}
	return 0
}

func (c *Completion) finish(err error) {
	c.err = err
	close(c.done)
}

// Dial connects to the broker at path, checks that it runs as this process's uid or root, and says
// hello.
func Dial(path string) (*Client, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return DialContext(ctx, path, DialOptions{})
}

// DialContext is Dial with a context (bounding the connect and the hello) and options. A broker that
// refuses this process (its uid, the Authorize hook, no grant) gives an error wrapping ErrPermission;
// one at its connection cap, ErrConnLimit; a socket the filesystem does not let this process reach
// (EACCES), ErrPermission as well.
func DialContext(ctx context.Context, path string, opts DialOptions) (*Client, error) {
	conn, err := unixsock.Dial(ctx, path, unixsock.DialOptions{AllowUIDs: opts.AllowUIDs, Retry: opts.Retry})
	if err != nil {
		return nil, fmt.Errorf("broker: %w", err)
	}
	conn.SetMaxPayload(ResponseSize + MaxText)
	cl, err := hello(ctx, conn, path)
	if err != nil {
		conn.Close()
		return nil, err
	}
	cl.closeTimeout = opts.CloseTimeout
	return cl, nil
}

func hello(ctx context.Context, conn *unixsock.Conn, path string) (*Client, error) {
	uc := conn.Unix()
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(30 * time.Second)
	}
	_ = uc.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = uc.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	var b [RequestSize]byte
	conn.Lock()
	werr := writeRequest(conn, &b, &request{op: OpHello, id: 1})
	conn.Unlock()
	// Read even when the write failed: a broker that refused us has sent why and hung up.
	resp, err := readResponse(conn)
	if err == nil && resp.status != StatusOK {
		err = &BrokerError{Op: resp.op, Status: resp.status, Message: resp.text}
	} else if err == nil && (resp.op != OpHello || resp.id != 1) {
		err = fmt.Errorf("broker: the answer to hello is %s for request %d: %w", opName(resp.op), resp.id, ErrProtocol)
	}
	if err != nil {
		var re *BrokerError
		if werr != nil && !errors.As(err, &re) {
			err = werr
		}
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (%v)", ctx.Err(), err)
		}
		return nil, fmt.Errorf("broker: hello to %s: %w", path, err)
	}
	if !stop() {
		return nil, fmt.Errorf("broker: hello to %s: %w", path, ctx.Err())
	}
	_ = uc.SetDeadline(time.Time{})
	info := Info{Server: conn.Peer(), RegionLen: resp.values[0], RegionKind: pinned.Kind(resp.buffer >> 8 & 0xff),
		Grant:       Grant{Offset: resp.values[1], Length: resp.values[2], ShareRegion: resp.buffer&1 != 0},
		IdleTimeout: time.Duration(resp.buffer>>16) * idleUnit}
	for o := 0; o < 64; o++ {
		if resp.values[3]&(1<<o) != 0 {
			info.Devices = append(info.Devices, o)
		}
	}
	c := &Client{conn: conn, info: info, pending: map[uint64]*Completion{}, done: make(chan struct{}), closed: make(chan struct{}), stopPing: make(chan struct{}),
		wlock: make(chan struct{}, 1)}
	c.nextID.Store(1) // 1 was the hello
	c.lastSend.Store(time.Now().UnixNano())
	c.own.Init(nil, "copy-broker client")
	lifetime.Track(c, &c.own)
	go c.read()
	if info.IdleTimeout > 0 {
		go c.keepAlive(info.IdleTimeout / 3)
	}
	return c, nil
}

// keepAlive pings the broker when no request went out for every, so that the broker's idle timeout
// only ever drops peers that stopped talking, not a worker that is merely quiet.
func (c *Client) keepAlive(every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-c.stopPing:
			return
		case <-c.done:
			return
		case now := <-t.C:
			if now.UnixNano()-c.lastSend.Load() >= int64(every) {
				_ = c.send(context.Background(), &Completion{}, request{op: OpPing}, nil)
			}
		}
	}
}

// Info is what the broker said at connect time.
func (c *Client) Info() Info { return c.info }

// read dispatches responses to their Completions until the connection ends.
func (c *Client) read() {
	defer close(c.done)
	for {
		resp, err := readResponse(c.conn)
		if err != nil {
			c.endErr = err
			c.fail(err)
			return
		}
		if resp.id == 0 {
			// The broker refused the connection (or the half request Close cut off): it drains
			// the worker's copies before it ends the connection, so read on until the end, for
			// Close to see it.
			c.failOpen(&BrokerError{Op: resp.op, Status: resp.status, Message: resp.text})
			continue
		}
		c.own.Lock()
		call := c.pending[resp.id]
		delete(c.pending, resp.id)
		refused := c.broken != nil
		c.own.Unlock()
		if call == nil && refused {
			continue // the answer of a copy drained after the refusal, whose request has failed
		}
		if call == nil || call.op != resp.op {
			c.fail(fmt.Errorf("broker: a %s response to request %d, which is not a pending %s: %w", opName(resp.op), resp.id, opName(resp.op), ErrProtocol))
			if call != nil {
				call.finish(c.brokenErr())
			}
			return
		}
		call.resp = resp
		if resp.status != StatusOK {
			call.finish(&BrokerError{Op: resp.op, Status: resp.status, Message: resp.text})
			continue
		}
		if resp.op == OpRegion {
			r, err := pinned.Receive(c.conn.Unix(), call.regionDev, call.regionOpts)
			if err != nil && outOfStep(err) {
				// The messages of the region did not arrive whole: the stream is out of step.
				c.fail(err)
				call.finish(c.brokenErr())
				return
			}
			call.region = r
			call.finish(err)
			continue
		}
		call.finish(nil)
	}
}

// outOfStep reports whether a failed pinned.Receive left the connection out of step: the region's
// messages did not arrive whole or well formed (a protocol error, an end, a timeout, a failed read,
// descriptors the kernel dropped). Other failures came once the region had arrived (mapping or
// registering it here, an option this device does not support): the call fails, the connection
// goes on.
func outOfStep(err error) bool {
	var op *net.OpError
	return errors.Is(err, ipc.ErrProtocol) || peerClosed(err) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, ipc.ErrIdle) || errors.Is(err, ipc.ErrTimeout) || errors.Is(err, os.ErrDeadlineExceeded) ||
		errors.Is(err, unix.EMFILE) || errors.As(err, &op)
}

// fail marks the connection broken with cause, closes it and completes every pending request with
// an error wrapping ErrBrokerGone.
func (c *Client) fail(cause error) {
	c.failOpen(cause)
	c.conn.Close()
}

// failOpen is fail leaving the connection open, for the reader to read on until the broker ends it.
func (c *Client) failOpen(cause error) {
	c.own.Lock()
	if c.broken == nil {
		c.cause = cause
		if c.own.Closed() {
			c.broken = fmt.Errorf("broker: %w", ErrClosed)
		} else {
			c.broken = fmt.Errorf("%w: %w", ErrBrokerGone, cause)
		}
	}
	pending := c.pending
	c.pending = map[uint64]*Completion{}
	err := c.broken
	c.own.Unlock()
	for _, call := range pending {
		call.finish(err)
	}
}

func (c *Client) brokenErr() error {
	c.own.Lock()
	defer c.own.Unlock()
	return c.broken
}

// send registers call as pending and writes the request (and, for a register, the buffer) under the
// write lock, by ctx's end. A request whose context ends while it waits for the lock is not sent
// and leaves the connection as it was; one whose context ends in the middle of its write leaves a
// frame half-written, so the connection is closed (every later call fails with ErrBrokerGone).
func (c *Client) send(ctx context.Context, call *Completion, req request, exp *ipc.Exported) error {
	call.op = req.op
	call.done = make(chan struct{})
	req.id = c.nextID.Add(1)
	c.own.Lock()
	if c.broken != nil {
		err := c.broken
		c.own.Unlock()
		return err
	}
	c.pending[req.id] = call
	c.own.Unlock()
	if err := c.lockWrite(ctx); err != nil {
		c.forget(req.id)
		return fmt.Errorf("broker: waiting to send %s: %w", opName(req.op), err)
	}
	err := c.write(ctx, &req, exp)
	<-c.wlock
	c.lastSend.Store(time.Now().UnixNano())
	if err != nil {
		c.forget(req.id)
		if c.own.IsClosed() {
			// Close shut the sending side; it waits for the broker's end itself.
			return fmt.Errorf("broker: %w", ErrClosed)
		}
		if peerClosed(err) {
			// The broker closed its end: the reader sees that end itself, which Close waits for.
			c.failOpen(err)
		} else {
			c.fail(err)
		}
		return c.brokenErr()
	}
	return nil
}

// lockWrite takes wlock unless ctx ends first; a context already done sends nothing.
func (c *Client) lockWrite(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	select {
	case c.wlock <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	if err := ctx.Err(); err != nil {
		<-c.wlock
		return err
	}
	return nil
}

// write writes the request and the buffer; the caller holds wlock. A context that ends cuts the
// write off (a deadline in the past).
func (c *Client) write(ctx context.Context, req *request, exp *ipc.Exported) error {
	c.conn.Lock()
	defer c.conn.Unlock()
	uc := c.conn.Unix()
	if ctx.Done() != nil {
		defer unixsock.DeadlineWhenDone(ctx, func(t time.Time) { _ = uc.SetWriteDeadline(t) })()
	}
	err := writeRequest(c.conn, &c.wbuf, req)
	if err == nil && exp != nil {
		err = ipc.Send(uc, exp)
	}
	if err != nil && ctx.Err() != nil {
		err = fmt.Errorf("broker: %s cut off mid-write when its context ended, so the connection is closed: %w (%v)", opName(req.op), ctx.Err(), err)
	}
	return err
}

// forget drops a request that was not sent from the pending ones.
func (c *Client) forget(id uint64) {
	c.own.Lock()
	delete(c.pending, id)
	c.own.Unlock()
}

func (c *Client) do(ctx context.Context, call *Completion, req request, exp *ipc.Exported) error {
	if err := c.send(ctx, call, req, exp); err != nil {
		return err
	}
	return call.Wait(ctx)
}

// Request is one copy between the broker's region and a registered buffer.
type Request struct {
	// Buffer is the registered buffer (Buffer.ID).
	Buffer BufferID
	// Dir is ToDevice (region → buffer) or ToHost (buffer → region).
	Dir Direction
	// HostOffset is the offset in the broker's region (not in the grant); the range must lie in this
	// worker's grant.
	HostOffset uint64
	// BufferOffset is the offset in the buffer; the range must lie in its chunks.
	BufferOffset uint64
	// Length is the number of bytes, above zero.
	Length uint64
}

func (r Request) String() string {
	return fmt.Sprintf("copy %s %s (buffer %d offset %#x, region offset %#x)", units.FormatSize(r.Length), r.Dir, r.Buffer, r.BufferOffset, r.HostOffset)
}

// CopyAsync sends a copy request and returns at once; the Completion is done when the copy is
// complete in memory (or failed). The broker bounds-checks it: a host range outside the grant or a
// buffer range outside the buffer fails with ErrOutOfRange, an unknown buffer with ErrUnknownBuffer.
// Requests run concurrently on the broker's streams and complete in any order. They are not ordered
// with this process's own GPU work either: synchronize the kernels and memsets that touch the range
// (cuMemsetD8 is asynchronous for device memory) before the request, and touch the range again only
// once the Completion is done.
func (c *Client) CopyAsync(req Request) (*Completion, error) {
	return c.copyAsync(context.Background(), req)
}

// copyAsync is CopyAsync with a context for the write (see send).
func (c *Client) copyAsync(ctx context.Context, req Request) (*Completion, error) {
	if c.own.IsClosed() {
		return nil, fmt.Errorf("broker: %s: %w", req, ErrClosed)
	}
	if req.Length == 0 || (req.Dir != ToDevice && req.Dir != ToHost) || req.Buffer == 0 {
		return nil, fmt.Errorf("broker: %s: a length above 0, a direction (ToDevice, ToHost) and a buffer are needed: %w", req, ErrInvalidValue)
	}
	if req.HostOffset+req.Length < req.HostOffset || req.BufferOffset+req.Length < req.BufferOffset {
		return nil, fmt.Errorf("broker: %s: offset + length overflows: %w", req, ErrOutOfRange)
	}
	call := &Completion{}
	err := c.send(ctx, call, request{op: OpCopy, buffer: uint32(req.Buffer), dir: req.Dir, hostOff: req.HostOffset,
		bufOff: req.BufferOffset, length: req.Length}, nil)
	if err != nil {
		return nil, fmt.Errorf("broker: %s: %w", req, err)
	}
	return call, nil
}

// Copy sends a copy request and waits until the copy is complete in memory (see CopyAsync). A
// context that ends before the request is sent stops it (see Client); one that ends later stops
// the wait, not the copy.
func (c *Client) Copy(ctx context.Context, req Request) error {
	call, err := c.copyAsync(ctx, req)
	if err != nil {
		return err
	}
	if err := call.Wait(ctx); err != nil {
		return fmt.Errorf("broker: %s: %w", req, err)
	}
	return nil
}

// Ping makes a round trip with no copy: the protocol's own cost.
func (c *Client) Ping(ctx context.Context) error {
	if c.own.IsClosed() {
		return fmt.Errorf("broker: ping: %w", ErrClosed)
	}
	if err := c.do(ctx, &Completion{}, request{op: OpPing}, nil); err != nil {
		return fmt.Errorf("broker: ping: %w", err)
	}
	return nil
}

// BufferID names a registered buffer in requests.
type BufferID uint32

// Buffer is a device buffer registered with the broker.
type Buffer struct {
	c      *Client
	id     BufferID
	length uint64
	device int
	once   sync.Once
	err    error
}

// ID is the buffer's id, for Request.Buffer.
func (b *Buffer) ID() BufferID { return b.id }

// Len is the buffer's length.
func (b *Buffer) Len() uint64 { return b.length }

// Device is the ordinal of the device the buffer's memory is on.
func (b *Buffer) Device() int { return b.device }

// Close unregisters the buffer (Client.Unregister); idempotent and safe on nil.
func (b *Buffer) Close() error {
	if b == nil {
		return nil
	}
	b.once.Do(func() { b.err = b.c.Unregister(context.Background(), b) })
	return b.err
}

// Register shares buf with the broker: every chunk is exported as a file descriptor (ipc.Export, so
// every allocation must have been created with driver.HandleTypePosixFD) and sent; the broker imports
// and maps it for the chunks' device, which must be one of the devices it serves. The buffer must not
// change (grow, shrink, close) while registered. A worker has at most Options.MaxBuffers buffers,
// taking at most Options.MaxRegisteredBytes of address space (ErrLimit); a buffer whose Len runs
// past its last chunk is refused (ErrOutOfRange). When ctx ends before the answer, the buffer is unregistered once the answer comes.
func (c *Client) Register(ctx context.Context, buf vmm.Chunked) (*Buffer, error) {
	if c.own.IsClosed() {
		return nil, fmt.Errorf("broker: register: %w", ErrClosed)
	}
	exp, err := ipc.Export(buf)
	if err != nil {
		return nil, fmt.Errorf("broker: register: %w", err)
	}
	defer exp.Close()
	call := &Completion{}
	if err := c.send(ctx, call, request{op: OpRegister}, exp); err != nil {
		return nil, fmt.Errorf("broker: register %s: %w", &exp.Desc, err)
	}
	// A context already done gives up at once (Wait might yet find a quick answer).
	err = ctx.Err()
	if err == nil {
		err = call.Wait(ctx)
	}
	if err != nil {
		go c.dropLateRegister(call)
		return nil, fmt.Errorf("broker: register %s: %w", &exp.Desc, err)
	}
	return &Buffer{c: c, id: BufferID(call.resp.buffer), length: call.resp.values[0], device: int(call.resp.values[1])}, nil
}

// dropLateRegister waits for a register the caller gave up on and unregisters the buffer if the
// broker registered it, so that it does not count against Options.MaxBuffers with an id nobody knows.
func (c *Client) dropLateRegister(call *Completion) {
	<-call.done
	if call.err == nil {
		_ = c.send(context.Background(), &Completion{}, request{op: OpUnregister, buffer: call.resp.buffer}, nil)
	}
}

// Unregister asks the broker to drop the buffer: it waits for the copies in flight on it, then
// unmaps and releases its import. Copies requested afterwards fail with ErrUnknownBuffer.
func (c *Client) Unregister(ctx context.Context, b *Buffer) error {
	if b == nil {
		return fmt.Errorf("broker: unregister: nil buffer: %w", ErrInvalidValue)
	}
	if c.own.IsClosed() {
		return fmt.Errorf("broker: unregister buffer %d: %w", b.id, ErrClosed)
	}
	if b.c != c { // ids are per connection: another client's buffer 1 would name this one's
		return fmt.Errorf("broker: unregister buffer %d: it belongs to another client: %w", b.id, ErrInvalidValue)
	}
	if err := c.do(ctx, &Completion{}, request{op: OpUnregister, buffer: uint32(b.id)}, nil); err != nil {
		return fmt.Errorf("broker: unregister buffer %d: %w", b.id, err)
	}
	return nil
}

// Region maps the broker's region in this process so the worker can read and write its bytes
// (pinned.Receive). The default, empty opts, maps it for the CPU alone, which costs no GPU memory;
// dev is the device whose context imports a host-NUMA region (it may be nil for a shared-memory
// region opened for the CPU). The broker refuses (ErrPermission) when this worker's grant does not
// include sharing the region. The region stays valid after the broker exits; close it when done.
func (c *Client) Region(ctx context.Context, dev *vmm.Device, opts pinned.OpenOptions) (*pinned.Region, error) {
	if c.own.IsClosed() {
		return nil, fmt.Errorf("broker: region: %w", ErrClosed)
	}
	if dev == nil && len(opts.Grant) == 0 && c.info.RegionKind == pinned.HostNUMA {
		return nil, fmt.Errorf("broker: region: a host-NUMA region is imported through a device's context: pass the device: %w", ErrInvalidValue)
	}
	// Checked before asking: once the broker sends the region, a refusal leaves the stream out of step.
	if err := opts.Check(dev); err != nil {
		return nil, fmt.Errorf("broker: region: %w", err)
	}
	call := &Completion{regionDev: dev, regionOpts: opts}
	if err := c.send(ctx, call, request{op: OpRegion}, nil); err != nil {
		return nil, fmt.Errorf("broker: region: %w", err)
	}
	if err := call.Wait(ctx); err != nil {
		// A region that arrives after the wait gave up is closed by nobody: wait for it to be
		// done and close it, without blocking the caller.
		go func() {
			<-call.done
			if call.region != nil {
				_ = call.region.Close()
			}
		}()
		return nil, fmt.Errorf("broker: region: %w", err)
	}
	return call.region, nil
}

// Close ends the connection and waits for the broker to end it too, so that no copy of this
// worker runs once it returns nil: it shuts the sending side of the connection; the broker, seeing
// the end, starts none of the worker's copies still waiting for a copy stream, waits for those
// queued on one, unmaps and releases the buffers, then closes its side, which Close waits for
// (DialOptions.CloseTimeout). A broker that exited or closed its server has ended the connection
// already, and Close returns at once. Requests still pending get the broker's answer if it came
// before the end, else fail with ErrClosed; every Completion is done when Close returns.
//
// When Close cannot confirm the end, it closes the connection anyway and returns an error: one
// wrapping ErrTimeout when the broker did not end the connection in time, one wrapping
// ErrBrokerGone when the connection had broken otherwise (a protocol fault, a request cut off by
// its context). A copy of this worker may then still run: keep the memory it touches, and the
// range of the region, as they are until the broker is known to be gone. Close is idempotent and
// safe on nil: a Close made while the first still waits returns when the first has, with its
// result, and one made after the first returned returns nil.
func (c *Client) Close() error {
	if c == nil {
		return nil
	}
	if !c.own.Shut() {
		select {
		case <-c.closed:
			return nil
		default:
		}
		<-c.closed
		return c.closeErr
	}
	c.closeErr = c.shutAndWait()
	close(c.closed)
	return c.closeErr
}

// shutAndWait is the first Close: it shuts the sending side and waits for the broker's end.
func (c *Client) shutAndWait() error {
	close(c.stopPing)
	d := c.closeTimeout
	if d <= 0 {
		d = DefaultCloseTimeout
	}
	uc := c.conn.Unix()
	_ = uc.SetReadDeadline(time.Now().Add(d))
	_ = uc.CloseWrite()
	<-c.done
	_ = c.conn.Close()
	c.own.Lock()
	cause := c.cause
	c.own.Unlock()
	switch {
	case brokerEnded(c.endErr) || brokerEnded(cause):
		return nil
	case errors.Is(c.endErr, os.ErrDeadlineExceeded):
		return fmt.Errorf("broker: close: the broker did not end the connection within %v, so a copy of this worker may still run: %w", d, ErrTimeout)
	default:
		return fmt.Errorf("broker: close: the connection broke before the broker ended it, so a copy of this worker may still run: %w: %w", ErrBrokerGone, cause)
	}
}

// brokerEnded reports whether the connection ended because the broker's side was closed: the broker
// closes it once the worker's copies are drained (or exited, which ends them).
func brokerEnded(cause error) bool {
	return peerClosed(cause) || errors.Is(cause, io.ErrUnexpectedEOF)
}
