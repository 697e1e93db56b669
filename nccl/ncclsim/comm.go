package ncclsim

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/nccl"
)

type commState int

const (
	stateConnecting commState = iota
	stateReady
	stateBusy // a group is running
	stateFailed
	stateClosed // destroyed or aborted
)

// comm is one rank's simulated communicator.
type comm struct {
	lib          *Lib
	h            nccl.CommHandle
	id           nccl.UniqueID
	rank, nranks int
	dev          driver.Device
	ctx          driver.Context // the device's primary context, retained

	mu    sync.Mutex
	cond  *sync.Cond // signalled when a peer queue gets a message or fails, or the state changes
	state commState
	err   error  // the sticky error once failed
	last  string // the text of the last error
	ln    net.Listener
	peers []*peer // by rank; nil for this rank
	regs  map[nccl.RegHandle]span
	wins  map[nccl.Window]span
	nextH uintptr
	wait  sync.WaitGroup // the background goroutines
}

type span struct {
	ptr  driver.DevicePtr
	size uint64
}

// peer is the connection to one other rank, with the messages received from it and not yet taken,
// by channel: a group runs its sends before its other operations, so point-to-point messages and
// those of collectives are queued apart, each in the order it was sent.
type peer struct {
	conn    net.Conn
	queue   [numChannels][][]byte
	readErr error // set when the reader stopped (the peer exited, or shutdown)
}

func newComm(l *Lib, h nccl.CommHandle, id nccl.UniqueID, rank, nranks int, dev driver.Device, ctx driver.Context) *comm {
	c := &comm{lib: l, h: h, id: id, rank: rank, nranks: nranks, dev: dev, ctx: ctx,
		peers: make([]*peer, nranks), regs: map[nccl.RegHandle]span{}, wins: map[nccl.Window]span{}}
	c.cond = sync.NewCond(&c.mu)
	c.peers[rank] = &peer{} // sends to itself land in its own queue
	return c
}

func (c *comm) openConns() int {
	n := 0
	for _, p := range c.peers {
		if p != nil && p.conn != nil {
			n++
		}
	}
	if c.ln != nil {
		n++
	}
	return n
}

// asyncError is ncclCommGetAsyncError's answer.
func (c *comm) asyncError() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch c.state {
	case stateConnecting, stateBusy:
		return nccl.InProgress
	case stateFailed, stateClosed:
		if c.err != nil {
			return c.err
		}
		return nccl.InvalidUsage
	}
	return nil
}

// setFailed records the communicator's sticky error. c.mu is held.
func (c *comm) setFailed(err error) {
	if c.state == stateFailed || c.state == stateClosed {
		return
	}
	c.state, c.err = stateFailed, err
	var ce *nccl.CallError
	if errors.As(err, &ce) {
		c.last = ce.Last
	}
	c.cond.Broadcast()
}

// address is rank r's abstract Unix socket name, derived from the unique ID.
func (c *comm) address(r int) string {
	return fmt.Sprintf("@cuvmm-ncclsim-%x-%d", c.id[8:24], r)
}

// connect builds the mesh: listen on this rank's name, dial every lower rank, accept every higher
// one, and check that all agree on the size. It ends in stateReady or stateFailed.
func (c *comm) connect() {
	defer c.wait.Done()
	err := c.mesh()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ln != nil {
		c.ln.Close()
		c.ln = nil
	}
	if err != nil {
		c.setFailed(err)
		return
	}
	if c.state == stateConnecting {
		c.state = stateReady
		for _, p := range c.peers {
			if p != nil && p.conn != nil {
				c.wait.Add(1)
				go c.receive(p, p.conn)
			}
		}
	}
}

const call = "ncclCommInitRankConfig"

func (c *comm) mesh() error {
	ln, err := net.Listen("unix", c.address(c.rank))
	if err != nil {
		if errors.Is(err, syscall.EADDRINUSE) {
			return fail(call, nccl.InvalidUsage, "rank %d of this communicator is already taken by another process or communicator", c.rank)
		}
		return fail(call, nccl.SystemError, "listen: %v", err)
	}
	c.mu.Lock()
	if c.state != stateConnecting {
		c.mu.Unlock()
		ln.Close()
		return fail(call, nccl.RemoteError, "aborted during initialization")
	}
	c.ln = ln
	c.mu.Unlock()
	for r := 0; r < c.rank; r++ {
		if err := c.dial(r); err != nil {
			return err
		}
	}
	for n := c.rank + 1; n < c.nranks; n++ {
		if err := c.accept(ln); err != nil {
			return err
		}
	}
	return nil
}

// hello is what two ranks exchange when they connect.
func (c *comm) hello() []byte {
	b := make([]byte, 16)
	binary.LittleEndian.PutUint64(b[0:], uint64(c.nranks))
	binary.LittleEndian.PutUint64(b[8:], uint64(c.rank))
	return b
}

func (c *comm) dial(r int) error {
	for {
		conn, err := net.Dial("unix", c.address(r))
		if err == nil {
			return c.handshake(conn, r)
		}
		c.mu.Lock()
		stopped := c.state != stateConnecting
		c.mu.Unlock()
		if stopped {
			return fail(call, nccl.RemoteError, "aborted while waiting for rank %d", r)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (c *comm) accept(ln net.Listener) error {
	conn, err := ln.Accept()
	if err != nil {
		return fail(call, nccl.RemoteError, "aborted while waiting for ranks above %d: %v", c.rank, err)
	}
	return c.handshake(conn, -1)
}

// handshake exchanges hellos on conn (with rank want, or any higher rank when want is -1) and
// stores the peer.
func (c *comm) handshake(conn net.Conn, want int) error {
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	var theirs [16]byte
	if _, err := conn.Write(c.hello()); err != nil {
		conn.Close()
		return fail(call, nccl.RemoteError, "handshake: %v", err)
	}
	if _, err := io.ReadFull(conn, theirs[:]); err != nil {
		conn.Close()
		return fail(call, nccl.RemoteError, "handshake: %v", err)
	}
	_ = conn.SetDeadline(time.Time{})
	n, r := int(binary.LittleEndian.Uint64(theirs[0:])), int(binary.LittleEndian.Uint64(theirs[8:]))
	bad := ""
	switch {
	case n != c.nranks:
		bad = fmt.Sprintf("rank %d says the communicator has %d ranks, rank %d says %d", r, n, c.rank, c.nranks)
	case want >= 0 && r != want, want < 0 && (r <= c.rank || r >= c.nranks):
		bad = fmt.Sprintf("rank %d got a connection from rank %d, which is not a rank it expects", c.rank, r)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state != stateConnecting {
		conn.Close()
		return fail(call, nccl.RemoteError, "aborted during initialization")
	}
	if bad == "" && c.peers[r] != nil && c.peers[r].conn != nil {
		bad = fmt.Sprintf("two processes claim rank %d", r)
	}
	if bad != "" {
		conn.Close()
		return fail(call, nccl.InvalidUsage, "%s", bad)
	}
	c.peers[r] = &peer{conn: conn}
	return nil
}

// receive moves the messages that arrive on conn, p's connection, into p's queue until the
// connection ends. It reads conn, not p.conn, which shutdown clears under the lock once it has
// closed the connection.
func (c *comm) receive(p *peer, conn net.Conn) {
	defer c.wait.Done()
	for {
		var hdr [frameHeader]byte
		_, err := io.ReadFull(conn, hdr[:])
		var msg []byte
		ch := int(hdr[8]) % numChannels
		if err == nil {
			msg = make([]byte, binary.LittleEndian.Uint64(hdr[:8]))
			_, err = io.ReadFull(conn, msg)
		}
		c.mu.Lock()
		if err != nil {
			p.readErr = err
			c.cond.Broadcast()
			c.mu.Unlock()
			return
		}
		p.queue[ch] = append(p.queue[ch], msg)
		c.cond.Broadcast()
		c.mu.Unlock()
	}
}

// shutdown stops everything: the state becomes closed, sockets close, waiters wake.
func (c *comm) shutdown(r nccl.Result, why string) {
	c.mu.Lock()
	if c.state != stateClosed {
		if c.err == nil {
			c.err = fail("ncclCommAbort", r, "%s", why)
		}
		c.state = stateClosed
	}
	if c.ln != nil {
		c.ln.Close()
		c.ln = nil
	}
	for _, p := range c.peers {
		if p != nil && p.conn != nil {
			p.conn.Close()
			p.conn = nil
		}
	}
	clear(c.regs)
	clear(c.wins)
	c.cond.Broadcast()
	c.mu.Unlock()
}

// finalize is ncclCommFinalize: the simulated operations are complete when their group succeeds,
// so there is nothing to flush; it refuses a communicator that is still busy.
func (c *comm) finalize() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch c.state {
	case stateReady:
		return nil
	case stateBusy, stateConnecting:
		return fail("ncclCommFinalize", nccl.InvalidUsage, "the communicator is still in progress")
	}
	return c.err
}

// ---- registration ----

func (l *Lib) CommRegister(h nccl.CommHandle, ptr driver.DevicePtr, size uint64) (nccl.RegHandle, error) {
	return addSpan(l, "ncclCommRegister", nccl.VersionRegister, h, ptr, size, func(c *comm) map[nccl.RegHandle]span { return c.regs })
}

func (l *Lib) CommDeregister(h nccl.CommHandle, rh nccl.RegHandle) error {
	return dropSpan(l, "ncclCommDeregister", nccl.VersionRegister, h, rh, "registration handle", func(c *comm) map[nccl.RegHandle]span { return c.regs })
}

func (l *Lib) CommWindowRegister(h nccl.CommHandle, ptr driver.DevicePtr, size uint64, flags int) (func() nccl.Window, error) {
	w, err := addSpan(l, "ncclCommWindowRegister", nccl.VersionWindow, h, ptr, size, func(c *comm) map[nccl.Window]span { return c.wins })
	if err != nil {
		return nil, err
	}
	// NCCL runs a window's registration as a group of its own and, on a non-blocking communicator,
	// returns ncclSuccess while it still runs: the communicator stays in progress for a moment.
	if c := l.comm(h); c != nil {
		c.busyFor(time.Millisecond)
	}
	return func() nccl.Window { return w }, nil
}

// busyFor keeps a ready communicator in progress for d.
func (c *comm) busyFor(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state != stateReady {
		return
	}
	c.state = stateBusy
	time.AfterFunc(d, func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.state == stateBusy {
			c.state = stateReady
			c.cond.Broadcast()
		}
	})
}

func (l *Lib) CommWindowDeregister(h nccl.CommHandle, w nccl.Window) error {
	return dropSpan(l, "ncclCommWindowDeregister", nccl.VersionWindow, h, w, "window", func(c *comm) map[nccl.Window]span { return c.wins })
}

// addSpan is registration and window registration: on a ready communicator of a version that has
// the call, [ptr, ptr+size) is entered in the communicator's table under a new handle.
func addSpan[K ~uintptr](l *Lib, call string, version int, h nccl.CommHandle, ptr driver.DevicePtr, size uint64, table func(*comm) map[K]span) (K, error) {
	if err := l.needs(call, version); err != nil {
		return 0, err
	}
	c := l.comm(h)
	if c == nil {
		return 0, fail(call, nccl.InvalidArgument, "unknown communicator")
	}
	l.bound(call, c)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state != stateReady {
		return 0, fail(call, nccl.InvalidUsage, "the communicator is not ready")
	}
	if ptr == 0 || size == 0 {
		return 0, fail(call, nccl.InvalidArgument, "null buffer or zero size")
	}
	c.nextH++
	k := K(c.nextH)
	table(c)[k] = span{ptr, size}
	return k, nil
}

// dropSpan undoes addSpan; what names the handle's kind in the error for an unknown one.
func dropSpan[K ~uintptr](l *Lib, call string, version int, h nccl.CommHandle, k K, what string, table func(*comm) map[K]span) error {
	if err := l.needs(call, version); err != nil {
		return err
	}
	c := l.comm(h)
	if c == nil {
		return fail(call, nccl.InvalidArgument, "unknown communicator")
	}
	l.bound(call, c)
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := table(c)[k]; !ok {
		return fail(call, nccl.InvalidArgument, "unknown %s", what)
	}
	delete(table(c), k)
	return nil
}
