package ncclsim

import (
	"encoding/binary"
	"fmt"
	"runtime"
	"unsafe"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/nccl"
)

type opKind int

const (
	kSend opKind = iota
	kRecv
	kAllReduce
	kAllGather
	kReduceScatter
	kBroadcast
)

// simOp is one queued call.
type simOp struct {
	c          *comm
	kind       opKind
	send, recv driver.DevicePtr
	count      uint64
	dt         nccl.DataType
	redOp      nccl.RedOp
	peer       int // peer, or root
	stream     driver.Stream
}

// Channels of the messages between two ranks: those of collectives, and those of sends and receives.
const (
	chanCollective = iota
	chanP2P
	numChannels
)

// frameHeader is a message's header on the wire: its length (8 bytes) and its channel.
const frameHeader = 9

func channel(k opKind) int {
	if k == kSend || k == kRecv {
		return chanP2P
	}
	return chanCollective
}

// group is the calls made on one OS thread between ncclGroupStart and the matching ncclGroupEnd.
type group struct {
	depth int
	ops   []simOp
	err   error // the first call refused inside the group: ncclGroupEnd returns it and runs nothing
}

func (l *Lib) GroupStart() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	g := l.groups[tid()]
	if g == nil {
		g = &group{}
		l.groups[tid()] = g
	}
	g.depth++
	return nil
}

func (l *Lib) GroupEnd() error {
	l.mu.Lock()
	g := l.groups[tid()]
	if g == nil || g.depth == 0 {
		l.mu.Unlock()
		return fail("ncclGroupEnd", nccl.InvalidUsage, "ncclGroupEnd without ncclGroupStart")
	}
	g.depth--
	if g.depth > 0 {
		l.mu.Unlock()
		return nil
	}
	delete(l.groups, tid())
	l.mu.Unlock()
	if g.err != nil {
		return g.err
	}
	return l.launch(g.ops)
}

// enqueue checks a call and adds it to the thread's group, or launches it alone.
// A call refused inside a group is kept by the group, as NCCL does: its ncclGroupEnd fails with it.
func (l *Lib) enqueue(call string, h nccl.CommHandle, o simOp) error {
	err := l.checkCall(call, h, &o)
	l.mu.Lock()
	if g := l.groups[tid()]; g != nil && g.depth > 0 {
		if err == nil {
			g.ops = append(g.ops, o)
		} else if g.err == nil {
			g.err = err
		}
		l.mu.Unlock()
		return err
	}
	l.mu.Unlock()
	if err != nil {
		return err
	}
	return l.launch([]simOp{o})
}

// checkCall refuses what NCCL's argument check refuses and sets o's communicator.
func (l *Lib) checkCall(call string, h nccl.CommHandle, o *simOp) error {
	c := l.comm(h)
	if c == nil {
		return fail(call, nccl.InvalidArgument, "unknown communicator")
	}
	l.bound(call, c)
	if o.dt.Size() == 0 || l.version < o.dt.Since() || o.redOp < nccl.Sum || o.redOp > nccl.Avg {
		return fail(call, nccl.InvalidArgument, "data type %d, reduction %d", o.dt, o.redOp)
	}
	if o.peer < 0 || o.peer >= c.nranks {
		return fail(call, nccl.InvalidArgument, "rank %d is not in the communicator of %d", o.peer, c.nranks)
	}
	o.c = c
	return nil
}

// launch starts one background run per communicator of ops and answers ncclInProgress.
func (l *Lib) launch(ops []simOp) error {
	if len(ops) == 0 {
		return nil
	}
	var order []*comm
	byComm := map[*comm][]simOp{}
	for _, o := range ops {
		if _, ok := byComm[o.c]; !ok {
			order = append(order, o.c)
		}
		byComm[o.c] = append(byComm[o.c], o)
	}
	for _, c := range order {
		c.mu.Lock()
		if c.state != stateReady {
			err := c.err
			if err == nil {
				err = fail("ncclGroupEnd", nccl.InvalidUsage, "the communicator is not ready (still initializing or running a group)")
			}
			c.mu.Unlock()
			return err
		}
		c.state = stateBusy
		c.wait.Add(1)
		c.mu.Unlock()
		go c.run(byComm[c])
	}
	return nccl.InProgress
}

// run executes a group's operations in order, on a thread bound to the communicator's device.
func (c *comm) run(ops []simOp) {
	defer c.wait.Done()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	err := c.lib.api.CtxSetCurrent(c.ctx)
	if err != nil {
		err = fail("ncclGroupEnd", nccl.UnhandledCudaError, "cuCtxSetCurrent: %v", err)
	} else {
		err = c.selfPaired(ops)
	}
	for _, o := range sendsFirst(ops) {
		if err != nil {
			break
		}
		err = c.exec(o)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state == stateBusy {
		if err != nil {
			c.setFailed(err)
		} else {
			c.state = stateReady
		}
	}
	c.cond.Broadcast()
}

// selfPaired refuses a group whose sends to this rank and receives from it do not pair up: NCCL
// matches them inside the group and reports ncclInvalidUsage for one left alone.
func (c *comm) selfPaired(ops []simOp) error {
	sends, recvs := 0, 0
	for _, o := range ops {
		switch {
		case o.peer != c.rank:
		case o.kind == kSend:
			sends++
		case o.kind == kRecv:
			recvs++
		}
	}
	switch {
	case sends > recvs:
		return fail("ncclGroupEnd", nccl.InvalidUsage, "trying to send to self without a matching recv")
	case recvs > sends:
		return fail("ncclGroupEnd", nccl.InvalidUsage, "trying to recv from self without a matching send")
	}
	return nil
}

// sendsFirst orders a group's sends before its other operations, each kind keeping its order: NCCL
// progresses a group's operations together, so a group may receive from a peer before it sends to
// that peer (an exchange), which run, going one operation at a time, would otherwise deadlock on.
func sendsFirst(ops []simOp) []simOp {
	out := make([]simOp, 0, len(ops))
	for _, o := range ops {
		if o.kind == kSend {
			out = append(out, o)
		}
	}
	for _, o := range ops {
		if o.kind != kSend {
			out = append(out, o)
		}
	}
	return out
}

func (c *comm) exec(o simOp) error {
	if err := c.lib.api.StreamSynchronize(o.stream); err != nil {
		return fail(opName(o.kind), nccl.UnhandledCudaError, "cuStreamSynchronize: %v", err)
	}
	size := o.dt.Size()
	b := o.count * size
	switch o.kind {
	case kSend:
		return c.sendFrom(o, o.peer, o.send, b)
	case kRecv:
		d, err := c.recvFrom(o, o.peer, b)
		if err != nil {
			return err
		}
		return c.write(o, o.recv, d)
	case kAllReduce:
		return c.allReduce(o, b)
	case kAllGather:
		return c.allGather(o, b)
	case kReduceScatter:
		return c.reduceScatter(o, b)
	default:
		return c.broadcast(o, b)
	}
}

func opName(k opKind) string {
	return [...]string{"ncclSend", "ncclRecv", "ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast"}[k]
}

// read copies n bytes of device memory at ptr (the driver checks this device may read them).
func (c *comm) read(o simOp, ptr driver.DevicePtr, n uint64) ([]byte, error) {
	buf := make([]byte, n)
	if n == 0 {
		return buf, nil
	}
	if err := c.lib.api.MemcpyDtoH(unsafe.Pointer(&buf[0]), ptr, n); err != nil {
		return nil, fail(opName(o.kind), nccl.UnhandledCudaError, "reading %d bytes at %#x on device %d: %v", n, uint64(ptr), c.dev, err)
	}
	return buf, nil
}

func (c *comm) write(o simOp, ptr driver.DevicePtr, b []byte) error {
	if len(b) == 0 {
		return nil
	}
	if err := c.lib.api.MemcpyHtoD(ptr, unsafe.Pointer(&b[0]), uint64(len(b))); err != nil {
		return fail(opName(o.kind), nccl.UnhandledCudaError, "writing %d bytes at %#x on device %d: %v", len(b), uint64(ptr), c.dev, err)
	}
	return nil
}

func (c *comm) sendFrom(o simOp, r int, ptr driver.DevicePtr, n uint64) error {
	d, err := c.read(o, ptr, n)
	if err != nil {
		return err
	}
	return c.sendTo(o, r, d)
}

// sendTo frames b to rank r (to this rank's own queue for a send to itself).
func (c *comm) sendTo(o simOp, r int, b []byte) error {
	ch := channel(o.kind)
	c.mu.Lock()
	p := c.peers[r]
	if r == c.rank {
		p.queue[ch] = append(p.queue[ch], b)
		c.cond.Broadcast()
		c.mu.Unlock()
		return nil
	}
	conn := p.conn
	c.mu.Unlock()
	if conn == nil {
		return fail(opName(o.kind), nccl.RemoteError, "the connection to rank %d is closed", r)
	}
	frame := make([]byte, frameHeader, frameHeader+len(b))
	binary.LittleEndian.PutUint64(frame, uint64(len(b)))
	frame[8] = byte(ch)
	if _, err := conn.Write(append(frame, b...)); err != nil {
		return fail(opName(o.kind), nccl.RemoteError, "sending %d bytes to rank %d: %v", len(b), r, err)
	}
	return nil
}

// recvFrom takes rank r's next message, which must be n bytes long. It waits for as long as it
// takes, like NCCL's kernels: only a peer's exit or an abort ends the wait early.
func (c *comm) recvFrom(o simOp, r int, n uint64) ([]byte, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	p, ch := c.peers[r], channel(o.kind)
	for {
		if c.state == stateClosed {
			return nil, fail(opName(o.kind), nccl.RemoteError, "aborted while waiting for rank %d", r)
		}
		if len(p.queue[ch]) > 0 {
			m := p.queue[ch][0]
			p.queue[ch] = p.queue[ch][1:]
			if uint64(len(m)) != n {
				return nil, fail(opName(o.kind), nccl.InvalidUsage,
					"rank %d sent %d bytes where rank %d expected %d: the ranks disagree on the count or the order of operations", r, len(m), c.rank, n)
			}
			return m, nil
		}
		if p.readErr != nil {
			return nil, fail(opName(o.kind), nccl.RemoteError, "rank %d exited or closed its connection: %v", r, p.readErr)
		}
		c.cond.Wait()
	}
}

// gather sends mine (or block r of it, with blocks) to every other rank and collects theirs, by rank.
func (c *comm) gather(o simOp, mine []byte, b uint64, blocks bool) ([][]byte, error) {
	parts := make([][]byte, c.nranks)
	for r := 0; r < c.nranks; r++ {
		out := mine
		if blocks {
			out = mine[uint64(r)*b : uint64(r+1)*b]
		}
		if r == c.rank {
			parts[r] = out
			continue
		}
		if err := c.sendTo(o, r, out); err != nil {
			return nil, err
		}
	}
	for r := 0; r < c.nranks; r++ {
		if r == c.rank {
			continue
		}
		d, err := c.recvFrom(o, r, b)
		if err != nil {
			return nil, err
		}
		parts[r] = d
	}
	return parts, nil
}

func (c *comm) allReduce(o simOp, b uint64) error {
	mine, err := c.read(o, o.send, b)
	if err != nil {
		return err
	}
	parts, err := c.gather(o, mine, b, false)
	if err != nil {
		return err
	}
	return c.write(o, o.recv, reduce(parts, o.dt, o.redOp))
}

func (c *comm) allGather(o simOp, b uint64) error {
	mine, err := c.read(o, o.send, b)
	if err != nil {
		return err
	}
	parts, err := c.gather(o, mine, b, false)
	if err != nil {
		return err
	}
	out := make([]byte, 0, b*uint64(c.nranks))
	for _, p := range parts {
		out = append(out, p...)
	}
	return c.write(o, o.recv, out)
}

func (c *comm) reduceScatter(o simOp, b uint64) error {
	all, err := c.read(o, o.send, b*uint64(c.nranks))
	if err != nil {
		return err
	}
	parts, err := c.gather(o, all, b, true)
	if err != nil {
		return err
	}
	return c.write(o, o.recv, reduce(parts, o.dt, o.redOp))
}

func (c *comm) broadcast(o simOp, b uint64) error {
	if c.rank == o.peer {
		d, err := c.read(o, o.send, b)
		if err != nil {
			return err
		}
		for r := 0; r < c.nranks; r++ {
			if r != c.rank {
				if err := c.sendTo(o, r, d); err != nil {
					return err
				}
			}
		}
		if o.send == o.recv {
			return nil
		}
		return c.write(o, o.recv, d)
	}
	d, err := c.recvFrom(o, o.peer, b)
	if err != nil {
		return err
	}
	return c.write(o, o.recv, d)
}

// ---- the calls ----

func (l *Lib) Send(buf driver.DevicePtr, count uint64, t nccl.DataType, peer int, h nccl.CommHandle, s driver.Stream) error {
	return l.enqueue("ncclSend", h, simOp{kind: kSend, send: buf, count: count, dt: t, peer: peer, stream: s})
}

func (l *Lib) Recv(buf driver.DevicePtr, count uint64, t nccl.DataType, peer int, h nccl.CommHandle, s driver.Stream) error {
	return l.enqueue("ncclRecv", h, simOp{kind: kRecv, recv: buf, count: count, dt: t, peer: peer, stream: s})
}

func (l *Lib) AllReduce(send, recv driver.DevicePtr, count uint64, t nccl.DataType, op nccl.RedOp, h nccl.CommHandle, s driver.Stream) error {
	return l.enqueue("ncclAllReduce", h, simOp{kind: kAllReduce, send: send, recv: recv, count: count, dt: t, redOp: op, stream: s})
}

func (l *Lib) AllGather(send, recv driver.DevicePtr, sendCount uint64, t nccl.DataType, h nccl.CommHandle, s driver.Stream) error {
	return l.enqueue("ncclAllGather", h, simOp{kind: kAllGather, send: send, recv: recv, count: sendCount, dt: t, stream: s})
}

func (l *Lib) ReduceScatter(send, recv driver.DevicePtr, recvCount uint64, t nccl.DataType, op nccl.RedOp, h nccl.CommHandle, s driver.Stream) error {
	return l.enqueue("ncclReduceScatter", h, simOp{kind: kReduceScatter, send: send, recv: recv, count: recvCount, dt: t, redOp: op, stream: s})
}

func (l *Lib) Broadcast(send, recv driver.DevicePtr, count uint64, t nccl.DataType, root int, h nccl.CommHandle, s driver.Stream) error {
	return l.enqueue("ncclBroadcast", h, simOp{kind: kBroadcast, send: send, recv: recv, count: count, dt: t, peer: root, stream: s})
}

var _ nccl.API = (*Lib)(nil)

func (o simOp) String() string { return fmt.Sprintf("%s(%d × %s)", opName(o.kind), o.count, o.dt) }
