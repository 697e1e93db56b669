package nccl_test

import (
	"encoding/binary"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/nccl"
	"github.com/cuvmm/cuvmm/vmm"
)

func floats(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, f := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(f))
	}
	return b
}

// TestCollectives runs AllReduce, AllGather, ReduceScatter and Broadcast over two ranks on whole
// buffers and checks every element.
func TestCollectives(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		comms := ranks(t, b, lib, 2)
		const n = 1024 // float32 elements per rank
		type side struct {
			dev       *vmm.Device
			s         *vmm.Stream
			in, out   vmm.Chunked
			inB, outB uint64
		}
		sides := make([]side, 2)
		for r := range sides {
			d := b.Device(t, r)
			in, out := buffer(t, d, 2*n*4, 2*mib), buffer(t, d, 2*n*4, 2*mib)
			sides[r] = side{dev: d, s: stream(t, d), in: in, out: out}
			vals := make([]float32, 2*n)
			for i := range vals {
				vals[i] = float32(r*10000 + i)
			}
			require.NoError(t, d.CopyHtoD(in.Ptr(), floats(vals)))
		}
		get := func(r int, count int) []float32 {
			raw := make([]byte, 4*count)
			require.NoError(t, sides[r].dev.CopyDtoH(raw, sides[r].out.Ptr()))
			out := make([]float32, count)
			for i := range out {
				out[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
			}
			return out
		}
		run := func(fn func(r int, c *nccl.Comm, g *nccl.Group)) {
			noErrors(t, parallel(2, func(r int) error {
				ctx := deadline(t, 30*time.Second)
				g := comms[r].Group()
				fn(r, comms[r], g)
				if err := g.Run(ctx); err != nil {
					return err
				}
				return comms[r].Wait(ctx, sides[r].s)
			}))
		}

		run(func(r int, c *nccl.Comm, g *nccl.Group) {
			g.AllReduce(sides[r].in.Ptr(), sides[r].out.Ptr(), n, nccl.Float32, nccl.Sum, sides[r].s)
		})
		for r := range 2 {
			for i, v := range get(r, n) {
				require.Equal(t, float32(10000+2*i), v, "all-reduce rank %d element %d", r, i)
			}
		}

		run(func(r int, c *nccl.Comm, g *nccl.Group) {
			g.AllGather(sides[r].in.Ptr(), sides[r].out.Ptr(), n/2, nccl.Float32, sides[r].s)
		})
		for r := range 2 {
			got := get(r, n)
			for i, v := range got {
				want := float32((i/(n/2))*10000 + i%(n/2))
				require.Equal(t, want, v, "all-gather rank %d element %d", r, i)
			}
		}

		run(func(r int, c *nccl.Comm, g *nccl.Group) {
			g.ReduceScatter(sides[r].in.Ptr(), sides[r].out.Ptr(), n/2, nccl.Float32, nccl.Max, sides[r].s)
		})
		for r := range 2 {
			for i, v := range get(r, n/2) {
				require.Equal(t, float32(10000+r*(n/2)+i), v, "reduce-scatter rank %d element %d", r, i)
			}
		}

		run(func(r int, c *nccl.Comm, g *nccl.Group) {
			g.BroadcastBuffer(sides[r].in, sides[r].out, nccl.Float32, 1, sides[r].s)
		})
		for r := range 2 {
			for i, v := range get(r, 2*n) {
				require.Equal(t, float32(10000+i), v, "broadcast rank %d element %d", r, i)
			}
		}

		run(func(r int, c *nccl.Comm, g *nccl.Group) {
			g.AllReduceBuffer(sides[r].in, sides[r].out, nccl.Float32, nccl.Avg, sides[r].s)
		})
		for r := range 2 {
			for i, v := range get(r, 2*n) {
				require.Equal(t, float32(5000+i), v, "all-reduce avg rank %d element %d", r, i)
			}
		}
	}, testutil.Devices(2))
}

// TestExchangeInOneGroup has both ranks send and receive at once, which only works in a group.
func TestExchangeInOneGroup(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		comms := ranks(t, b, lib, 2)
		const size = 4 * mib
		type side struct {
			dev          *vmm.Device
			s            *vmm.Stream
			mine, theirs vmm.Chunked
		}
		sides := make([]side, 2)
		for r := range sides {
			d := b.Device(t, r)
			sides[r] = side{d, stream(t, d), buffer(t, d, size, 2*mib), buffer(t, d, size, 2*mib)}
			require.NoError(t, d.Fill(sides[r].mine.Ptr(), size, 0, uint64(r+7)))
		}
		noErrors(t, parallel(2, func(r int) error {
			ctx := deadline(t, 30*time.Second)
			sd := sides[r]
			if err := comms[r].Group().SendBuffer(sd.mine, 1-r, sd.s).RecvBuffer(sd.theirs, 1-r, sd.s).Run(ctx); err != nil {
				return err
			}
			return comms[r].Wait(ctx, sd.s)
		}))
		for r := range 2 {
			bad, err := sides[r].dev.Verify(sides[r].theirs.Ptr(), size, 0, uint64(1-r+7))
			require.NoError(t, err)
			require.Zero(t, bad, "rank %d", r)
		}
	}, testutil.Devices(2))
}

// TestGroupReceivesBeforeItSends: two ranks exchange buffers with groups that queue the receive
// before the send, next to an all-reduce; NCCL progresses a group's operations together, so the
// order inside the group does not deadlock and every byte arrives.
func TestGroupReceivesBeforeItSends(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		comms := ranks(t, b, library(t, b), 2)
		devs := []*vmm.Device{b.Device(t, 0), b.Device(t, 1)}
		bufs := []vmm.Chunked{buffer(t, devs[0], 6*mib, 2*mib), buffer(t, devs[1], 6*mib, 2*mib)}
		for r, d := range devs {
			require.NoError(t, d.Fill(bufs[r].Ptr()+2*mib, mib, 0, uint64(r+1)))
		}
		ctx := deadline(t, 10*time.Second)
		errs := parallel(2, func(r int) error {
			p := bufs[r].Ptr()
			g := comms[r].Group().AllReduce(p+4*mib, p+4*mib, 16, nccl.Float32, nccl.Sum, nil).
				Recv(p, mib, nccl.Uint8, 1-r, nil).Send(p+2*mib, mib, nccl.Uint8, 1-r, nil)
			if err := g.Run(ctx); err != nil {
				return err
			}
			return comms[r].Wait(ctx, nil)
		})
		noErrors(t, errs)
		for r, d := range devs {
			bad, err := d.Verify(bufs[r].Ptr(), mib, 0, uint64(2-r))
			require.NoError(t, err)
			require.Zero(t, bad, "rank %d", r)
		}
	}, testutil.Devices(2))
}
