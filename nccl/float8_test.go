package nccl_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/nccl"
	"github.com/cuvmm/cuvmm/nccl/ncclsim"
	"github.com/cuvmm/cuvmm/vmm"
)

// float8Bytes are the encodings of 1, 2 and 3 in each float8 type: rank 0 holds 1, rank 1 holds 2,
// so that their sum (3) and maximum (2) are exact.
var float8Bytes = map[nccl.DataType][3]byte{
	nccl.Float8e4m3: {0x38, 0x40, 0x44}, // e4m3: bias 7, 3 mantissa bits
	nccl.Float8e5m2: {0x3c, 0x40, 0x42}, // e5m2: the high byte of a float16
}

// TestFloat8 runs all-reduces (sum, max) and an all-gather of each float8 type over two ranks and
// checks every element.
func TestFloat8(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		comms := ranks(t, b, lib, 2)
		const n = 256
		devs := []*vmm.Device{b.Device(t, 0), b.Device(t, 1)}
		ins, outs := make([]vmm.Chunked, 2), make([]vmm.Chunked, 2)
		for r, d := range devs {
			ins[r], outs[r] = buffer(t, d, 2*mib, 2*mib), buffer(t, d, 2*mib, 2*mib)
		}
		for dt, enc := range float8Bytes {
			for r, d := range devs {
				require.NoError(t, d.CopyHtoD(ins[r].Ptr(), repeat(enc[r], n)))
			}
			check := func(what string, count int, want func(i int) byte) {
				for r, d := range devs {
					got := make([]byte, count)
					require.NoError(t, d.CopyDtoH(got, outs[r].Ptr()))
					for i, v := range got {
						require.Equal(t, want(i), v, "%s of %s, rank %d element %d", what, dt, r, i)
					}
				}
			}
			run(t, comms, func(r int, g *nccl.Group) { g.AllReduce(ins[r].Ptr(), outs[r].Ptr(), n, dt, nccl.Sum, nil) })
			check("sum", n, func(int) byte { return enc[2] })
			run(t, comms, func(r int, g *nccl.Group) { g.AllReduce(ins[r].Ptr(), outs[r].Ptr(), n, dt, nccl.Max, nil) })
			check("max", n, func(int) byte { return enc[1] })
			run(t, comms, func(r int, g *nccl.Group) { g.AllGather(ins[r].Ptr(), outs[r].Ptr(), n, dt, nil) })
			check("all-gather", 2*n, func(i int) byte { return enc[i/n] })
		}
	}, testutil.Devices(2))
}

// run queues fn's operations on every rank at once, runs them and waits for them.
func run(t *testing.T, comms []*nccl.Comm, fn func(r int, g *nccl.Group)) {
	t.Helper()
	noErrors(t, parallel(len(comms), func(r int) error {
		ctx := deadline(t, 30*time.Second)
		g := comms[r].Group()
		fn(r, g)
		if err := g.Run(ctx); err != nil {
			return err
		}
		return comms[r].Wait(ctx, nil)
	}))
}

func repeat(v byte, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = v
	}
	return b
}

// TestUnknownDataTypeRefused: a type past NCCL's last (ncclNumTypes) is an argument error, from
// the package's check and from the simulated library itself.
func TestUnknownDataTypeRefused(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		c := soloComm(t, b, lib)
		defer func() { require.NoError(t, c.Close()) }()
		buf := buffer(t, b.Device(t, 0), 2*mib, 2*mib)
		ctx := deadline(t, 10*time.Second)
		err := c.AllReduce(ctx, buf.Ptr(), buf.Ptr(), 16, nccl.DataType(12), nccl.Sum, nil)
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		require.ErrorContains(t, err, "unknown data type 12")
		require.NoError(t, b.Device(t, 0).Raw(func(driver.API) error {
			err = lib.AllReduce(buf.Ptr(), buf.Ptr(), 16, nccl.DataType(12), nccl.Sum, c.Handle(), 0)
			return nil
		}))
		require.ErrorIs(t, err, nccl.ErrInvalidValue, "the simulated ncclAllReduce")
		require.NoError(t, c.AllReduce(ctx, buf.Ptr(), buf.Ptr(), 16, nccl.Float8e4m3, nccl.Sum, nil))
		require.NoError(t, c.Wait(ctx, nil))
	}, testutil.SimOnly())
}

// TestFloat8NeedsNCCL224: a library older than 2.24 has no float8 types; the package says so
// (ErrNotSupported, naming the version) instead of handing NCCL a type it refuses.
func TestFloat8NeedsNCCL224(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := ncclsim.New(b.Sim, ncclsim.Version(22300))
		c := soloComm(t, b, lib)
		defer func() { require.NoError(t, c.Close()) }()
		buf := buffer(t, b.Device(t, 0), 2*mib, 2*mib)
		for _, dt := range []nccl.DataType{nccl.Float8e4m3, nccl.Float8e5m2} {
			err := c.AllReduce(deadline(t, 10*time.Second), buf.Ptr(), buf.Ptr(), 16, dt, nccl.Sum, nil)
			require.ErrorIs(t, err, nccl.ErrNotSupported, fmt.Sprint(dt))
			require.ErrorContains(t, err, "2.24.0")
		}
	}, testutil.SimOnly())
}
