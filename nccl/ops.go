package nccl

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/bits"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/vmm"
)

type opKind int

const (
	opSend opKind = iota
	opRecv
	opAllReduce
	opAllGather
	opReduceScatter
	opBroadcast
)

var opNames = [...]string{"ncclSend", "ncclRecv", "ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast"}

// op is one NCCL call, checked and waiting for Group.Run.
type op struct {
	kind       opKind
	send, recv driver.DevicePtr
	count      uint64 // the count NCCL takes (per rank for AllGather's send and ReduceScatter's recv)
	dt         DataType
	redOp      RedOp
	peer       int // peer of Send/Recv, root of Broadcast
	stream     *vmm.Stream
}

func (o op) String() string {
	return fmt.Sprintf("%s(%d × %s)", opNames[o.kind], o.count, o.dt)
}

// Group is a set of operations issued together between ncclGroupStart and ncclGroupEnd: sends and
// receives that must progress at once (an exchange between two ranks, a ring), or several collectives
// fused. Add operations with its methods, then Run. A Group is not safe for concurrent use; argument
// errors are kept and returned by Run, which then issues nothing.
type Group struct {
	c   *Comm
	ops []op
	err error
}

// Group starts an empty group of operations on c.
func (c *Comm) Group() *Group { return &Group{c: c} }

func (g *Group) add(o op) {
	if g.err != nil {
		return
	}
	if err := g.c.check(o); err != nil {
		g.err = err
		return
	}
	g.ops = append(g.ops, o)
}

// Send queues ncclSend of count elements of type t at buf to rank peer, on stream s.
func (g *Group) Send(buf driver.DevicePtr, count uint64, t DataType, peer int, s *vmm.Stream) *Group {
	g.add(op{kind: opSend, send: buf, count: count, dt: t, peer: peer, stream: s})
	return g
}

// Recv queues ncclRecv of count elements of type t into buf from rank peer, on stream s.
func (g *Group) Recv(buf driver.DevicePtr, count uint64, t DataType, peer int, s *vmm.Stream) *Group {
	g.add(op{kind: opRecv, recv: buf, count: count, dt: t, peer: peer, stream: s})
	return g
}

// AllReduce queues ncclAllReduce: recv on every rank gets op over all ranks' send (count elements).
// send == recv works in place.
func (g *Group) AllReduce(send, recv driver.DevicePtr, count uint64, t DataType, redOp RedOp, s *vmm.Stream) *Group {
	g.add(op{kind: opAllReduce, send: send, recv: recv, count: count, dt: t, redOp: redOp, stream: s})
	return g
}

// AllGather queues ncclAllGather: recv (NRanks × sendCount elements) gets every rank's send, in
// rank order.
func (g *Group) AllGather(send, recv driver.DevicePtr, sendCount uint64, t DataType, s *vmm.Stream) *Group {
	g.add(op{kind: opAllGather, send: send, recv: recv, count: sendCount, dt: t, stream: s})
	return g
}

// ReduceScatter queues ncclReduceScatter: send holds NRanks × recvCount elements; rank i's recv gets
// block i of the reduction.
func (g *Group) ReduceScatter(send, recv driver.DevicePtr, recvCount uint64, t DataType, redOp RedOp, s *vmm.Stream) *Group {
	g.add(op{kind: opReduceScatter, send: send, recv: recv, count: recvCount, dt: t, redOp: redOp, stream: s})
	return g
}

// Broadcast queues ncclBroadcast: count elements of root's send land in every rank's recv.
func (g *Group) Broadcast(send, recv driver.DevicePtr, count uint64, t DataType, root int, s *vmm.Stream) *Group {
	g.add(op{kind: opBroadcast, send: send, recv: recv, count: count, dt: t, peer: root, stream: s})
	return g
}

// Run issues the group's operations: ncclGroupStart, each call, ncclGroupEnd on one locked OS thread
// with the communicator's device bound (NCCL's group state is per thread), then polls until NCCL has
// queued them on their streams. It returns once they are queued, not done: wait with Comm.Wait. When
// ctx ends first (a peer that never posts its side keeps the group in progress), the communicator is
// aborted and the error wraps ErrAborted and ctx's error. A ctx already ended when Run is called
// queues nothing and aborts nothing (the error wraps ctx's), and one that ends while Run waits for
// another call on the communicator aborts nothing either (the error wraps ErrInUse and ctx's). When NCCL refuses a call or reports an
// error for the group, the communicator is aborted too, and the error wraps ErrAborted and NCCL's.
func (g *Group) Run(ctx context.Context) error {
	if g.err != nil {
		return g.err
	}
	if len(g.ops) == 0 {
		return nil
	}
	c := g.c
	if err := c.lockCtx(ctx, g.describe()); err != nil {
		return err
	}
	defer c.mu.Unlock()
	if err := c.use(g.ops[0].String()); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil { // before anything is queued: the communicator stays healthy
		return fmt.Errorf("nccl: %s on %v: nothing queued, the context had ended: %w", g.describe(), c, err)
	}
	release, err := c.holdStreams(g.ops)
	if err != nil {
		return err
	}
	// Held until NCCL has queued the operations (waitLocked) or the communicator is aborted: a
	// non-blocking communicator queues them in the background after ncclGroupEnd returned
	// ncclInProgress, a receive only once its peer has posted, and uses the streams until then.
	defer release()
	var callErr error
	err = c.dev.Raw(func(driver.API) error {
		callErr = c.issue(g.ops)
		return nil
	})
	if err != nil {
		return fmt.Errorf("nccl: %v: %w", c, err)
	}
	if callErr != nil && !errors.Is(callErr, ErrInProgress) {
		// A refused call inside a group leaves the communicator in an unknown state, as NCCL says.
		c.abortLocked(callErr)
		return fmt.Errorf("nccl: %s on %v, communicator aborted: %w", g.describe(), c, errors.Join(ErrAborted, callErr))
	}
	return c.waitLocked(ctx, g.describe())
}

func (g *Group) describe() string {
	if len(g.ops) == 1 {
		return g.ops[0].String()
	}
	return fmt.Sprintf("group of %d operations (first %s)", len(g.ops), g.ops[0])
}

// issue makes the calls on the current (locked, bound) thread.
func (c *Comm) issue(ops []op) error {
	grouped := len(ops) > 1
	if grouped {
		if err := c.lib.GroupStart(); err != nil {
			return err
		}
	}
	var first error
	for _, o := range ops {
		if err := c.call(o); err != nil && first == nil {
			first = fmt.Errorf("%s: %w", o, err)
		}
	}
	if grouped {
		if err := c.lib.GroupEnd(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

func (c *Comm) call(o op) error {
	s := o.stream.Handle()
	switch o.kind {
	case opSend:
		return c.lib.Send(o.send, o.count, o.dt, o.peer, c.h, s)
	case opRecv:
		return c.lib.Recv(o.recv, o.count, o.dt, o.peer, c.h, s)
	case opAllReduce:
		return c.lib.AllReduce(o.send, o.recv, o.count, o.dt, o.redOp, c.h, s)
	case opAllGather:
		return c.lib.AllGather(o.send, o.recv, o.count, o.dt, c.h, s)
	case opReduceScatter:
		return c.lib.ReduceScatter(o.send, o.recv, o.count, o.dt, o.redOp, c.h, s)
	default:
		return c.lib.Broadcast(o.send, o.recv, o.count, o.dt, o.peer, c.h, s)
	}
}

// invalid is the argument error of operation o: what is wrong, wrapping ErrInvalidValue.
func (c *Comm) invalid(o op, format string, args ...any) error {
	return fmt.Errorf("nccl: %s on %v: %s: %w", o, c, fmt.Sprintf(format, args...), ErrInvalidValue)
}

// check refuses, when an operation is queued, what NCCL would take silently or hang on: unknown
// types and reductions, types newer than the library (a *VersionError), peers out of range, streams of another device, null buffers and byte counts
// that overflow. Each argument is checked here only; whether the stream is still open is checked
// once, by Run (holdStreams), since it may be closed after the operation was queued.
func (c *Comm) check(o op) error {
	if o.dt.Size() == 0 {
		return c.invalid(o, "unknown data type %d", int32(o.dt))
	}
	if v := c.lib.Version(); v < o.dt.Since() {
		err := &VersionError{Feature: "ncclDataType_t " + o.dt.String(), Need: o.dt.Since(), Have: v}
		return fmt.Errorf("nccl: %s on %v: %w", o, c, err)
	}
	if o.redOp < Sum || o.redOp > Avg {
		return c.invalid(o, "unknown reduction %d", int32(o.redOp))
	}
	if (o.kind == opSend || o.kind == opRecv || o.kind == opBroadcast) && (o.peer < 0 || o.peer >= c.nranks) {
		return c.invalid(o, "rank %d is not in 0..%d", o.peer, c.nranks-1)
	}
	if o.stream != nil && o.stream.Device() != c.dev {
		return fmt.Errorf("nccl: %s on %v: the stream is on %s, the communicator on %s: %w", o, c, o.stream.Device(), c.dev, errWrongDevice())
	}
	return c.checkBuffers(o)
}

// checkBuffers refuses a null buffer that NCCL would use, and one whose byte count overflows or
// wraps around the address space.
func (c *Comm) checkBuffers(o op) error {
	sendCount, recvCount := o.count, o.count
	switch o.kind {
	case opAllGather:
		recvCount = mulOrMax(o.count, uint64(c.nranks))
	case opReduceScatter:
		sendCount = mulOrMax(o.count, uint64(c.nranks))
	}
	for _, b := range []struct {
		name  string
		ptr   driver.DevicePtr
		count uint64
		used  bool
	}{
		// NCCL reads a broadcast's send buffer on the root rank only.
		{"send buffer", o.send, sendCount, o.kind != opRecv && (o.kind != opBroadcast || o.peer == c.rank)},
		{"receive buffer", o.recv, recvCount, o.kind != opSend},
	} {
		if !b.used || b.count == 0 {
			continue
		}
		bytes, err := byteCount(b.count, o.dt.Size())
		if err != nil {
			return c.invalid(o, "%s: %v", b.name, err)
		}
		if b.ptr == 0 {
			return c.invalid(o, "%s is a null pointer", b.name)
		}
		if uint64(b.ptr)+bytes < uint64(b.ptr) {
			return c.invalid(o, "%s at %#x plus %d bytes wraps around the address space", b.name, uint64(b.ptr), bytes)
		}
	}
	return nil
}

// holdStreams refuses a group with an operation whose stream is closed (before the operation was
// queued or since), and else holds each of its streams (vmm.Stream.Hold) once until release, so that
// none is destroyed, and its handle given to a new stream, until NCCL has queued the operations (Run
// holds them until the group is no longer in progress). A stream named again is not held again: a
// Close that came after the first hold waits for the group, and would refuse a second hold. On a
// refusal the holds already taken are released. c.mu is held.
func (c *Comm) holdStreams(ops []op) (release func(), err error) {
	held := map[*vmm.Stream]func(){}
	release = func() {
		for _, r := range held {
			r()
		}
	}
	for _, o := range ops {
		if _, ok := held[o.stream]; ok || o.stream == nil {
			continue // held already, or the legacy default stream, which needs no hold
		}
		r, err := holdStream(o.stream)
		if err != nil {
			release()
			return nil, fmt.Errorf("%w: %w", c.invalid(o, "the stream is closed"), err)
		}
		held[o.stream] = r
	}
	return release, nil
}

// holdStream is vmm.Stream.Hold, a variable so that tests can close a stream while Run holds them.
var holdStream = (*vmm.Stream).Hold

// maxBytes caps one operation: NCCL's counts are size_t, but byte offsets are computed in signed
// 64-bit arithmetic inside the library.
const maxBytes = math.MaxInt64

func byteCount(count, size uint64) (uint64, error) {
	hi, lo := bits.Mul64(count, size)
	if hi != 0 || lo > maxBytes {
		return 0, fmt.Errorf("%d elements of %d bytes overflow a 63-bit byte count", count, size)
	}
	return lo, nil
}

func mulOrMax(a, b uint64) uint64 {
	hi, lo := bits.Mul64(a, b)
	if hi != 0 {
		return math.MaxUint64
	}
	return lo
}

// Send is a group of one ncclSend, run (see Group.Run).
func (c *Comm) Send(ctx context.Context, buf driver.DevicePtr, count uint64, t DataType, peer int, s *vmm.Stream) error {
	return c.Group().Send(buf, count, t, peer, s).Run(ctx)
}

// Recv is a group of one ncclRecv, run.
func (c *Comm) Recv(ctx context.Context, buf driver.DevicePtr, count uint64, t DataType, peer int, s *vmm.Stream) error {
	return c.Group().Recv(buf, count, t, peer, s).Run(ctx)
}

// AllReduce is a group of one ncclAllReduce, run.
func (c *Comm) AllReduce(ctx context.Context, send, recv driver.DevicePtr, count uint64, t DataType, op RedOp, s *vmm.Stream) error {
	return c.Group().AllReduce(send, recv, count, t, op, s).Run(ctx)
}

// AllGather is a group of one ncclAllGather, run.
func (c *Comm) AllGather(ctx context.Context, send, recv driver.DevicePtr, sendCount uint64, t DataType, s *vmm.Stream) error {
	return c.Group().AllGather(send, recv, sendCount, t, s).Run(ctx)
}

// ReduceScatter is a group of one ncclReduceScatter, run.
func (c *Comm) ReduceScatter(ctx context.Context, send, recv driver.DevicePtr, recvCount uint64, t DataType, op RedOp, s *vmm.Stream) error {
	return c.Group().ReduceScatter(send, recv, recvCount, t, op, s).Run(ctx)
}

// Broadcast is a group of one ncclBroadcast, run.
func (c *Comm) Broadcast(ctx context.Context, send, recv driver.DevicePtr, count uint64, t DataType, root int, s *vmm.Stream) error {
	return c.Group().Broadcast(send, recv, count, t, root, s).Run(ctx)
}
