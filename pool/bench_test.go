package pool_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/pool"
	"github.com/cuvmm/cuvmm/vmm"
)

// BenchmarkAllocFree times an alloc+free pair served from the pool's cache and, in the same run,
// the same pair through cuMemAlloc/cuMemFree and through the driver's stream-ordered default pool
// (cuMemAllocAsync/cuMemFreeAsync). It reports ns/op for the pool and x_memalloc, x_async: the
// baselines' time per pair over the pool's. On the simulator and, when one loads, the real driver.
func BenchmarkAllocFree(b *testing.B) {
	benchDevice(b, func(b *testing.B, d *vmm.Device) {
		for _, size := range []uint64{4 << 10, 2 << 20, 64 << 20} {
			b.Run(units.FormatSize(size), func(b *testing.B) { benchAllocFree(b, d, size) })
		}
	})
}

func benchAllocFree(b *testing.B, d *vmm.Device, size uint64) {
	s, err := d.NewStream(true)
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	p, err := pool.New(d, pool.Options{Limit: 1 << 30})
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	pair := map[string]func() error{
		"pool": func() error {
			blk, err := p.Alloc(size, s)
			if err == nil {
				err = p.Free(blk, s)
			}
			return err
		},
		"memalloc": func() error {
			return d.Raw(func(api driver.API) error {
				ptr, err := api.MemAlloc(size)
				if err == nil {
					err = api.MemFree(ptr)
				}
				return err
			})
		},
		"async": func() error {
			return d.Raw(func(api driver.API) error {
				ptr, err := api.MemAllocAsync(size, s.Handle())
				if err == nil {
					err = api.MemFreeAsync(ptr, s.Handle())
				}
				return err
			})
		},
	}
	took := map[string]time.Duration{}
	for name, fn := range pair { // warm-up: the caches hold the size afterwards
		if err := fn(); err != nil {
			b.Fatal(name, err)
		}
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, name := range []string{"pool", "memalloc", "async"} {
			t0 := time.Now()
			if err := pair[name](); err != nil {
				b.Fatal(name, err)
			}
			took[name] += time.Since(t0)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(took["pool"].Nanoseconds())/float64(b.N), "pool-ns/pair")
	b.ReportMetric(float64(took["memalloc"])/float64(took["pool"]), "x_memalloc")
	b.ReportMetric(float64(took["async"])/float64(took["pool"]), "x_async")
	if err := s.Synchronize(); err != nil {
		b.Fatal(err)
	}
	if err := d.Raw(func(api driver.API) error {
		mp, err := api.DeviceGetDefaultMemPool(d.Handle())
		if err == nil {
			err = api.MemPoolTrimTo(mp, 0)
		}
		return err
	}); err != nil {
		b.Fatal(err)
	}
}

// benchDevice runs fn on a simulated device and on the real driver's device 0, if one loads.
func benchDevice(b *testing.B, fn func(b *testing.B, d *vmm.Device)) {
	b.Run("sim", func(b *testing.B) {
		s := sim.New(sim.MemoryPerDevice(4 << 30))
		defer s.Close()
		benchOn(b, s, fn)
	})
	b.Run("cuda", func(b *testing.B) {
		api, err := driver.Open()
		if err != nil {
			b.Skipf("no real driver: %v", err)
		}
		benchOn(b, api, fn)
	})
}

func benchOn(b *testing.B, api driver.API, fn func(b *testing.B, d *vmm.Device)) {
	sys, err := vmm.Open(api)
	if err != nil {
		b.Skip(err)
	}
	defer func() {
		if err := sys.Close(); err != nil {
			b.Error(err)
		}
	}()
	d, err := sys.Device(0)
	if err != nil {
		b.Skip(fmt.Sprint(err))
	}
	fn(b, d)
}
