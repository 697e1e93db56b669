package pinned_test

import (
	"context"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// benchDevice opens device 0 of the real driver, or of the simulator where there is none (the
// simulator's figures say nothing about a GPU; the ratios are what the benchmarks are for).
func benchDevice(b *testing.B) (*vmm.Device, bool) {
	b.Helper()
	return benchDeviceOf(b, 1)
}

// benchDeviceOf is benchDevice with simDevices devices in the simulator.
func benchDeviceOf(b *testing.B, simDevices int) (*vmm.Device, bool) {
	b.Helper()
	var api driver.API
	real := true
	api, err := driver.Open()
	if err != nil {
		s := sim.New(sim.Devices(simDevices))
		b.Cleanup(func() { s.Close() })
		api, real = s, false
	}
	sys, err := vmm.Open(api)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if err := sys.Close(); err != nil {
			b.Error(err)
		}
	})
	d, err := sys.Device(0)
	if err != nil {
		b.Fatal(err)
	}
	return d, real
}

func check(b *testing.B, err error) {
	b.Helper()
	if err != nil {
		b.Fatal(err)
	}
}

// eventTimer times work queued on one stream with two events.
type eventTimer struct {
	s          *vmm.Stream
	start, end *vmm.Event
}

func newEventTimer(b *testing.B, d *vmm.Device) *eventTimer {
	s, err := d.NewStream(true)
	check(b, err)
	start, err := d.NewEvent(true)
	check(b, err)
	end, err := d.NewEvent(true)
	check(b, err)
	b.Cleanup(func() {
		check(b, end.Close())
		check(b, start.Close())
		check(b, s.Close())
	})
	return &eventTimer{s, start, end}
}

func (t *eventTimer) time(b *testing.B, fn func() error) time.Duration {
	check(b, t.start.Record(t.s))
	check(b, fn())
	check(b, t.end.Record(t.s))
	check(b, t.end.Synchronize())
	el, err := t.end.Elapsed(t.start)
	check(b, err)
	return max(el, time.Nanosecond)
}

// BenchmarkCopy measures copies through each region kind against raw cuMemcpy*Async on
// cuMemHostAlloc memory, interleaved in the same run. Metrics: GB/s of the region and x_hostalloc,
// its ratio to the baseline (target on the GPU host: ≥ 0.97 from 16 MiB).
func BenchmarkCopy(b *testing.B) {
	d, real := benchDevice(b)
	sizes := []uint64{16 << 20, 256 << 20}
	if !real {
		sizes = []uint64{1 << 20, 16 << 20}
	}
	top := sizes[len(sizes)-1]
	dev, err := d.AllocPlain(top)
	check(b, err)
	b.Cleanup(func() { check(b, dev.Close()) })
	hb, err := d.HostAlloc(top, driver.HostAllocPortable|driver.HostAllocDeviceMap)
	check(b, err)
	b.Cleanup(func() { check(b, hb.Close()) })
	t := newEventTimer(b, d)

	kinds := []pinned.Kind{pinned.SharedMemory, pinned.Registered}
	if pinned.SupportsHostNUMA(d) {
		kinds = append([]pinned.Kind{pinned.HostNUMA}, kinds...)
	}
	for _, kind := range kinds {
		var r *pinned.Region
		if kind == pinned.Registered {
			mem, err := pinned.MapAnonymous(top)
			check(b, err)
			b.Cleanup(func() { check(b, pinned.Unmap(mem)) })
			r, err = pinned.Register(d, mem, pinned.RegisterOptions{HugePages: true})
			check(b, err)
		} else {
			r, err = pinned.New(d, top, pinned.Options{Kind: kind})
			check(b, err)
		}
		b.Cleanup(func() { check(b, r.Close()) })
		for _, size := range sizes {
			for _, dir := range []string{"h2d", "d2h"} {
				b.Run(fmt.Sprintf("%s/%s/%s", kind, dir, units.FormatSize(size)), func(b *testing.B) {
					raw := func() error {
						return d.Raw(func(api driver.API) error {
							if dir == "h2d" {
								return api.MemcpyHtoDAsync(dev.Ptr(), hb.Pointer(), size, t.s.Handle())
							}
							return api.MemcpyDtoHAsync(hb.Pointer(), dev.Ptr(), size, t.s.Handle())
						})
					}
					mine := func() error {
						if dir == "h2d" {
							return r.CopyToDevice(t.s, dev.Ptr(), 0, size)
						}
						return r.CopyFromDevice(t.s, dev.Ptr(), 0, size)
					}
					t.time(b, raw)
					t.time(b, mine)
					var rawT, mineT time.Duration
					b.SetBytes(int64(size))
					b.ResetTimer()
					for i := 0; i < b.N; i++ {
						rawT += t.time(b, raw)
						mineT += t.time(b, mine)
					}
					n := float64(b.N) * float64(size)
					b.ReportMetric(n/mineT.Seconds()/1e9, "GB/s")
					b.ReportMetric(n/rawT.Seconds()/1e9, "raw_GB/s")
					b.ReportMetric(rawT.Seconds()/mineT.Seconds(), "x_hostalloc")
				})
			}
		}
	}
}

// BenchmarkStaging moves 8 GiB (64 MiB on the simulator) of device memory into a discarding
// io.Writer through a Stager and compares with raw D2H copies of the same bytes into cuMemHostAlloc
// memory, in the same run: metric x_raw (target on the GPU host: ≥ 0.9).
func BenchmarkStaging(b *testing.B) {
	d, real := benchDevice(b)
	size, chunk := uint64(8<<30), uint64(32<<20)
	if !real {
		size = 64 << 20
	}
	dev, err := d.AllocPlain(size)
	check(b, err)
	b.Cleanup(func() { check(b, dev.Close()) })
	check(b, d.Memset(dev.Ptr(), 1, size))
	const rawPiece = 1 << 30
	hb, err := d.HostAlloc(min(size, rawPiece), driver.HostAllocPortable)
	check(b, err)
	b.Cleanup(func() { check(b, hb.Close()) })
	st, err := pinned.NewStager(d, pinned.StagerOptions{BufferSize: chunk})
	check(b, err)
	b.Cleanup(func() { check(b, st.Close()) })
	t := newEventTimer(b, d)
	// The baseline: the same bytes in 1 GiB copies into pinned memory, back to back on one stream.
	raw := func() error {
		return d.Raw(func(api driver.API) error {
			for off := uint64(0); off < size; off += rawPiece {
				n := min(rawPiece, size-off)
				if err := api.MemcpyDtoHAsync(hb.Pointer(), dev.Ptr()+driver.DevicePtr(off), n, t.s.Handle()); err != nil {
					return err
				}
			}
			return nil
		})
	}
	stage := func() {
		n, err := st.DeviceToWriter(context.Background(), io.Discard, dev.Ptr(), size)
		check(b, err)
		if uint64(n) != size {
			b.Fatalf("staged %d of %d bytes", n, size)
		}
	}
	t.time(b, raw)
	stage()
	var rawT, stageT time.Duration
	b.SetBytes(int64(size))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		rawT += t.time(b, raw)
		t0 := time.Now()
		stage()
		stageT += time.Since(t0)
	}
	n := float64(b.N) * float64(size)
	b.ReportMetric(n/stageT.Seconds()/1e9, "GB/s")
	b.ReportMetric(n/rawT.Seconds()/1e9, "raw_GB/s")
	b.ReportMetric(rawT.Seconds()/stageT.Seconds(), "x_raw")
}
