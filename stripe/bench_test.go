package stripe_test

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/stripe"
	"github.com/cuvmm/cuvmm/vmm"
)

// benchDevices opens two devices of the real driver when it has them (8 GiB in 128 MiB stripes, the
// issue's figure), else of the simulator (256 MiB in 8 MiB stripes: only the ratio means anything).
func benchDevices(b *testing.B) (devs []*vmm.Device, size, stripeSize uint64, real bool) {
	b.Helper()
	var sys *vmm.System
	var s *sim.Sim
	if api, err := driver.Open(); err == nil {
		if sys, err = vmm.Open(api); err == nil && sys.DeviceCount() < 2 {
			b.Logf("the real driver has %d device(s); benchmarking the simulator", sys.DeviceCount())
			require.NoError(b, sys.Close())
			sys = nil
		}
	}
	size, stripeSize = 8<<30, 128<<20
	if sys == nil {
		s = sim.New(sim.Devices(2))
		var err error
		sys, err = vmm.Open(s)
		require.NoError(b, err)
		size, stripeSize = 256<<20, 8<<20
	}
	b.Cleanup(func() {
		require.NoError(b, sys.Close())
		if s != nil {
			require.NoError(b, s.Close())
		}
	})
	for i := 0; i < 2; i++ {
		d, err := sys.Device(i)
		require.NoError(b, err)
		devs = append(devs, d)
	}
	return devs, size, stripeSize, s == nil
}

// settle waits until the devices are idle and, on real GPUs, 50 ms more: the driver finishes freeing
// the previous range in the background, and a build that starts at once pays for it (about 11 ms
// instead of 7 for 8 GiB in 128 MiB stripes on the H200 host, raw or not). Every timed build starts
// from this state.
func settle(b *testing.B, devs []*vmm.Device, real bool) {
	b.Helper()
	for _, d := range devs {
		require.NoError(b, d.Synchronize())
	}
	if real {
		time.Sleep(50 * time.Millisecond)
	}
}

// rawChunk is one stripe of the raw baseline.
type rawChunk struct {
	off, size uint64
	loc       driver.Location
}

// shapeOf lists r's stripes for the raw baseline.
func shapeOf(r *stripe.Range) []rawChunk {
	var out []rawChunk
	for _, c := range r.Chunks() {
		out = append(out, rawChunk{c.Offset, c.Allocation.Size(), c.Allocation.Device().Location()})
	}
	return out
}

// rawBuild is the baseline: the same stripes built with raw driver calls in one context binding
// (reserve; per stripe create, map, set access), timed without the teardown that follows.
func rawBuild(b *testing.B, devs []*vmm.Device, size uint64, chunks []rawChunk) time.Duration {
	b.Helper()
	var dt time.Duration
	access := make([]driver.AccessDesc, len(devs))
	for i, d := range devs {
		access[i] = driver.AccessDesc{Location: d.Location(), Flags: driver.AccessReadWrite}
	}
	err := devs[0].Raw(func(api driver.API) error {
		t0 := time.Now()
		ptr, err := api.MemAddressReserve(size, 0, 0, 0)
		if err != nil {
			return err
		}
		var handles []driver.MemHandle
		var mapped uint64
		for _, c := range chunks {
			prop := driver.AllocationProp{Type: driver.AllocationTypePinned, Location: c.loc}
			n := c.size
			h, e := api.MemCreate(n, &prop, 0)
			if err = e; err != nil {
				break
			}
			handles = append(handles, h)
			if err = api.MemMap(ptr+driver.DevicePtr(c.off), n, 0, h, 0); err != nil {
				break
			}
			mapped = c.off + n
			if err = api.MemSetAccess(ptr+driver.DevicePtr(c.off), n, access); err != nil {
				break
			}
		}
		dt = time.Since(t0)
		var errs []error
		if mapped > 0 {
			errs = append(errs, api.MemUnmap(ptr, mapped))
		}
		for _, h := range handles {
			errs = append(errs, api.MemRelease(h))
		}
		errs = append(errs, api.MemAddressFree(ptr, size))
		return errors.Join(append(errs, err)...)
	})
	require.NoError(b, err)
	return dt
}

// BenchmarkNew reports stripe.New's build time and its ratio to the raw driver sequence measured in
// the same run (the target: at most 2x).
func BenchmarkNew(b *testing.B) {
	devs, size, stripeSize, real := benchDevices(b)
	for _, l := range []stripe.Layout{stripe.Interleaved{Stripe: stripeSize}, stripe.Blocked{}} {
		b.Run(l.String(), func(b *testing.B) {
			// The shape the raw baseline copies.
			r, err := stripe.New(devs, size, l, stripe.Options{})
			require.NoError(b, err)
			shape, rsize := shapeOf(r), r.Size()
			require.NoError(b, r.Close())
			// Each build, raw or not, starts after the other's memory is freed and the devices settle.
			var ours, raw time.Duration
			for i := 0; i < b.N; i++ {
				settle(b, devs, real)
				raw += rawBuild(b, devs, rsize, shape)
				settle(b, devs, real)
				t0 := time.Now()
				r, err := stripe.New(devs, size, l, stripe.Options{})
				ours += time.Since(t0)
				require.NoError(b, err)
				require.NoError(b, r.Close())
			}
			b.ReportMetric(float64(ours.Nanoseconds())/float64(b.N), "ns/build")
			b.ReportMetric(float64(raw.Nanoseconds())/float64(b.N), "raw-ns/build")
			b.ReportMetric(ours.Seconds()/raw.Seconds(), "x-raw")
		})
	}
}
