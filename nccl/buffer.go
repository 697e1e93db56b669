package nccl

import (
	"context"
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// span checks that every chunk of buf is memory of the communicator's device and returns the
// buffer's address and the number of elements of t in its Len bytes. An unknown t counts no
// elements: the operation's check refuses it, naming the operation.
func (c *Comm) span(what string, buf vmm.Chunked, t DataType) (driver.DevicePtr, uint64, error) {
	if _, err := c.chunksOf(what, buf); err != nil {
		return 0, 0, err
	}
	size, n := t.Size(), buf.Len()
	if size == 0 {
		return buf.Ptr(), 0, nil
	}
	if n%size != 0 {
		return 0, 0, fmt.Errorf("nccl: %s: the buffer's %d bytes are not a whole number of %s elements: %w", what, n, t, ErrInvalidValue)
	}
	return buf.Ptr(), n / size, nil
}

// chunksOf returns buf's chunks once it has checked that there are some and that all are memory
// of the communicator's device (NCCL would fault or move the bytes over the wrong link).
func (c *Comm) chunksOf(what string, buf vmm.Chunked) ([]vmm.Chunk, error) {
	if buf == nil {
		return nil, fmt.Errorf("nccl: %s: nil buffer: %w", what, ErrInvalidValue)
	}
	chunks := buf.Chunks()
	if len(chunks) == 0 {
		return nil, fmt.Errorf("nccl: %s: the buffer has no memory (closed or empty): %w", what, ErrInvalidValue)
	}
	want := c.dev.Location()
	for i, ch := range chunks {
		if ch.Allocation == nil {
			return nil, fmt.Errorf("nccl: %s: chunk %d has no allocation: %w", what, i, ErrInvalidValue)
		}
		if loc := ch.Allocation.Location(); loc != want {
			return nil, fmt.Errorf("nccl: %s: chunk %d (offset %s) is memory of %s, the communicator is on %s: %w",
				what, i, units.FormatSize(ch.Offset), loc, c.dev, errWrongDevice())
		}
	}
	return chunks, nil
}

// errWrongDevice wraps ErrWrongDevice and ErrInvalidValue.
func errWrongDevice() error { return wrongDeviceError{} }

type wrongDeviceError struct{}

func (wrongDeviceError) Error() string { return ErrWrongDevice.Error() }
func (wrongDeviceError) Is(target error) bool {
	return target == ErrWrongDevice || target == ErrInvalidValue
}

// SendBuffer queues one ncclSend of buf's Len bytes (as Uint8) to peer. The receiver may use any
// layout: RecvBuffer of a buffer as long, or Recv with the byte count.
func (g *Group) SendBuffer(buf vmm.Chunked, peer int, s *vmm.Stream) *Group {
	ptr, n, err := g.c.span("send buffer", buf, Uint8)
	if err != nil {
		return g.fail(err)
	}
	return g.Send(ptr, n, Uint8, peer, s)
}

// RecvBuffer queues one ncclRecv of buf's Len bytes from peer.
func (g *Group) RecvBuffer(buf vmm.Chunked, peer int, s *vmm.Stream) *Group {
	ptr, n, err := g.c.span("receive buffer", buf, Uint8)
	if err != nil {
		return g.fail(err)
	}
	return g.Recv(ptr, n, Uint8, peer, s)
}

// SendChunks queues one ncclSend per chunk of buf, covering its Len bytes. NCCL uses a registration
// only for an operation that lies inside it, so this is how a registered multi-chunk buffer moves
// zero-copy. The peer must queue matching receives: RecvChunks of a buffer with the same chunk
// offsets and Len (Layout tells; growable buffers with the same options grown to the same Len have
// it).
func (g *Group) SendChunks(buf vmm.Chunked, peer int, s *vmm.Stream) *Group {
	return g.chunked(opSend, buf, peer, s)
}

// RecvChunks queues one ncclRecv per chunk of buf (see SendChunks).
func (g *Group) RecvChunks(buf vmm.Chunked, peer int, s *vmm.Stream) *Group {
	return g.chunked(opRecv, buf, peer, s)
}

func (g *Group) chunked(kind opKind, buf vmm.Chunked, peer int, s *vmm.Stream) *Group {
	ptr, n, err := g.c.span(opNames[kind]+" by chunks", buf, Uint8)
	if err != nil {
		return g.fail(err)
	}
	for _, p := range Layout(buf) {
		if p.Offset >= n {
			break
		}
		size := min(p.Size, n-p.Offset)
		o := op{kind: kind, count: size, dt: Uint8, peer: peer, stream: s}
		if kind == opSend {
			o.send = ptr + driver.DevicePtr(p.Offset)
		} else {
			o.recv = ptr + driver.DevicePtr(p.Offset)
		}
		g.add(o)
	}
	return g
}

// Piece is one chunk of a buffer: its offset and size.
type Piece struct {
	Offset, Size uint64
}

// Layout lists buf's chunks as offsets and sizes, what two ranks compare before SendChunks and
// RecvChunks. A nil buffer has none, and a chunk without an allocation is left out.
func Layout(buf vmm.Chunked) []Piece {
	if buf == nil {
		return nil
	}
	chunks := buf.Chunks()
	out := make([]Piece, 0, len(chunks))
	for _, ch := range chunks {
		if ch.Allocation != nil { // the operations refuse such a buffer; Layout only describes it
			out = append(out, Piece{Offset: ch.Offset, Size: ch.Allocation.Size()})
		}
	}
	return out
}

// AllReduceBuffer queues ncclAllReduce over send's Len bytes as elements of t into recv (as long or
// longer; the same buffer for in place).
func (g *Group) AllReduceBuffer(send, recv vmm.Chunked, t DataType, redOp RedOp, s *vmm.Stream) *Group {
	sp, n, err := g.c.span("all-reduce send buffer", send, t)
	if err != nil {
		return g.fail(err)
	}
	rp, m, err := g.c.span("all-reduce receive buffer", recv, t)
	if err != nil {
		return g.fail(err)
	}
	if m < n {
		return g.fail(fmt.Errorf("nccl: all-reduce: the receive buffer holds %d %s elements, the send buffer %d: %w", m, t, n, ErrInvalidValue))
	}
	return g.AllReduce(sp, rp, n, t, redOp, s)
}

// AllGatherBuffer queues ncclAllGather of send's Len bytes into recv, which must hold NRanks times
// as many.
func (g *Group) AllGatherBuffer(send, recv vmm.Chunked, t DataType, s *vmm.Stream) *Group {
	sp, n, err := g.c.span("all-gather send buffer", send, t)
	if err != nil {
		return g.fail(err)
	}
	rp, m, err := g.c.span("all-gather receive buffer", recv, t)
	if err != nil {
		return g.fail(err)
	}
	if need := mulOrMax(n, uint64(g.c.nranks)); m < need {
		return g.fail(fmt.Errorf("nccl: all-gather: the receive buffer holds %d %s elements, %d ranks × %d need %d: %w", m, t, g.c.nranks, n, need, ErrInvalidValue))
	}
	return g.AllGather(sp, rp, n, t, s)
}

// ReduceScatterBuffer queues ncclReduceScatter: recv's Len bytes are the count per rank, send must
// hold NRanks times as many.
func (g *Group) ReduceScatterBuffer(send, recv vmm.Chunked, t DataType, redOp RedOp, s *vmm.Stream) *Group {
	sp, n, err := g.c.span("reduce-scatter send buffer", send, t)
	if err != nil {
		return g.fail(err)
	}
	rp, m, err := g.c.span("reduce-scatter receive buffer", recv, t)
	if err != nil {
		return g.fail(err)
	}
	if need := mulOrMax(m, uint64(g.c.nranks)); n < need {
		return g.fail(fmt.Errorf("nccl: reduce-scatter: the send buffer holds %d %s elements, %d ranks × %d need %d: %w", n, t, g.c.nranks, m, need, ErrInvalidValue))
	}
	return g.ReduceScatter(sp, rp, m, t, redOp, s)
}

// BroadcastBuffer queues ncclBroadcast of recv's Len bytes from root's send (used on root only; nil
// elsewhere, or recv itself for in place).
func (g *Group) BroadcastBuffer(send, recv vmm.Chunked, t DataType, root int, s *vmm.Stream) *Group {
	rp, n, err := g.c.span("broadcast buffer", recv, t)
	if err != nil {
		return g.fail(err)
	}
	sp := rp
	if send != nil {
		var m uint64
		if sp, m, err = g.c.span("broadcast send buffer", send, t); err != nil {
			return g.fail(err)
		}
		if m < n {
			return g.fail(fmt.Errorf("nccl: broadcast: the send buffer holds %d %s elements, the receive buffer %d: %w", m, t, n, ErrInvalidValue))
		}
	}
	return g.Broadcast(sp, rp, n, t, root, s)
}

func (g *Group) fail(err error) *Group {
	if g.err == nil {
		g.err = err
	}
	return g
}

// SendBuffer is a group of one SendBuffer, run (see Group.Run).
func (c *Comm) SendBuffer(ctx context.Context, buf vmm.Chunked, peer int, s *vmm.Stream) error {
	return c.Group().SendBuffer(buf, peer, s).Run(ctx)
}

// RecvBuffer is a group of one RecvBuffer, run.
func (c *Comm) RecvBuffer(ctx context.Context, buf vmm.Chunked, peer int, s *vmm.Stream) error {
	return c.Group().RecvBuffer(buf, peer, s).Run(ctx)
}
