package broker

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// benchSetup is a broker on the simulator with one client and one registered 2 MiB buffer.
func benchSetup(b *testing.B, opts Options) (*Client, *Buffer) {
	s := sim.New(sim.Devices(1))
	sys, err := vmm.Open(s)
	require.NoError(b, err)
	dev, err := sys.Device(0)
	require.NoError(b, err)
	b.Cleanup(func() {
		require.NoError(b, sys.Close())
		require.NoError(b, s.Close())
	})
	region := newRegion(b, dev, 32*mib, pinned.Options{})
	_, path := startServer(b, region, opts)
	c := dial(b, path)
	rb, err := c.Register(context.Background(), newDevBuffer(b, dev, 8, 2*mib))
	require.NoError(b, err)
	b.Cleanup(func() { require.NoError(b, rb.Close()) })
	return c, rb
}

// The protocol's round trip alone (the simulator's copies take no GPU time, so these measure the
// broker's own overhead: sockets, goroutines, encoding).
func BenchmarkPing(b *testing.B) {
	c, _ := benchSetup(b, Options{Logf: func(string, ...any) {}})
	ctx := context.Background()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := c.Ping(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

func benchCopy(b *testing.B, opts Options, n uint64, depth int) {
	opts.Logf = func(string, ...any) {}
	c, rb := benchSetup(b, opts)
	ctx := context.Background()
	b.SetBytes(int64(n))
	b.ResetTimer()
	var inflight []*Completion
	for i := 0; i < b.N; i++ {
		if len(inflight) == depth {
			if err := inflight[0].Wait(ctx); err != nil {
				b.Fatal(err)
			}
			inflight = inflight[1:]
		}
		off := uint64(i) * n % (16 * mib)
		cp, err := c.CopyAsync(Request{Buffer: rb.ID(), Dir: ToDevice, HostOffset: off, BufferOffset: off, Length: n})
		if err != nil {
			b.Fatal(err)
		}
		inflight = append(inflight, cp)
	}
	for _, cp := range inflight {
		if err := cp.Wait(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkCopy4KiB(b *testing.B)         { benchCopy(b, Options{}, 4<<10, 1) }
func BenchmarkCopy4KiBNoInline(b *testing.B) { benchCopy(b, Options{InlineMax: -1}, 4<<10, 1) }
func BenchmarkCopy1MiBDepth8(b *testing.B)   { benchCopy(b, Options{}, 1<<20, 8) }
