package growbuf_test

import (
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// The benchmarks time growbuf and the raw driver sequence for the same work in the same process,
// interleaved in batches, and report both per chunk and their ratio:
//
//	ns/grow, ns/shrink   growbuf's time per chunk
//	ns/raw               the raw driver calls' time per chunk, through Device.Raw (one context
//	                     binding per chunk, as growbuf does)
//	x_raw                growbuf / raw (target on the H200: at most 1.1 for a grow)
//
// They run on the simulator always (where the ratio shows growbuf's Go overhead against a cheap
// driver) and on the real driver when one loads.

const benchBatch = 32

var (
	realBenchOnce sync.Once
	realBenchDev  *vmm.Device
	realBenchErr  error
)

// benchDevices runs fn on the simulator's device 0 and on the real driver's device 0, if any.
func benchDevices(b *testing.B, fn func(b *testing.B, d *vmm.Device)) {
	b.Run("sim", func(b *testing.B) {
		s := sim.New(sim.Devices(1))
		sys, err := vmm.Open(s)
		if err != nil {
			b.Fatal(err)
		}
		defer func() {
			if err := sys.Close(); err != nil {
				b.Error(err)
			}
			if live := s.Live(); !live.Zero() {
				b.Errorf("simulator objects leaked: %s", live)
			}
			s.Close()
		}()
		d, err := sys.Device(0)
		if err != nil {
			b.Fatal(err)
		}
		fn(b, d)
	})
	b.Run("cuda", func(b *testing.B) {
		realBenchOnce.Do(func() {
			api, err := driver.Open()
			if err != nil {
				realBenchErr = err
				return
			}
			sys, err := vmm.Open(api)
			if err == nil && sys.DeviceCount() == 0 {
				err = errors.New("no devices")
			}
			if err != nil {
				realBenchErr = err
				return
			}
			realBenchDev, realBenchErr = sys.Device(0)
		})
		if realBenchErr != nil {
			if testutil.RequireGPU() {
				b.Fatalf("CUVMM_REQUIRE_GPU=1 but the real driver is not usable: %v", realBenchErr)
			}
			b.Skipf("real driver not usable here: %v", realBenchErr)
		}
		fn(b, realBenchDev)
	})
}

func benchChunks(b *testing.B, fn func(b *testing.B, d *vmm.Device, chunk uint64)) {
	benchDevices(b, func(b *testing.B, d *vmm.Device) {
		for _, chunk := range []uint64{2 << 20, 32 << 20, 256 << 20} {
			b.Run(fmt.Sprintf("chunk=%s", units.FormatSize(chunk)), func(b *testing.B) { fn(b, d, chunk) })
		}
	})
}

// rawSpace is a reservation for the raw driver sequence, with the properties growbuf uses.
type rawSpace struct {
	d       *vmm.Device
	ptr     driver.DevicePtr
	size    uint64
	chunk   uint64
	prop    driver.AllocationProp
	descs   []driver.AccessDesc
	handles []driver.MemHandle
}

func newRawSpace(b *testing.B, d *vmm.Device, chunk uint64) *rawSpace {
	r := &rawSpace{d: d, size: benchBatch * chunk, chunk: chunk,
		prop:  driver.AllocationProp{Type: driver.AllocationTypePinned, Location: d.Location()},
		descs: []driver.AccessDesc{{Location: d.Location(), Flags: driver.AccessReadWrite}}}
	if err := d.Raw(func(api driver.API) error {
		var err error
		r.ptr, err = api.MemAddressReserve(r.size, 0, 0, 0)
		return err
	}); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if err := d.Raw(func(api driver.API) error { return api.MemAddressFree(r.ptr, r.size) }); err != nil {
			b.Error(err)
		}
	})
	return r
}

// grow is cuMemCreate, cuMemMap, cuMemSetAccess of chunk i with one context binding.
func (r *rawSpace) grow(i int) error {
	ptr := r.ptr + driver.DevicePtr(uint64(i)*r.chunk)
	return r.d.Raw(func(api driver.API) error {
		h, err := api.MemCreate(r.chunk, &r.prop, 0)
		if err != nil {
			return err
		}
		if err := api.MemMap(ptr, r.chunk, 0, h, 0); err != nil {
			return errors.Join(err, api.MemRelease(h))
		}
		if err := api.MemSetAccess(ptr, r.chunk, r.descs); err != nil {
			return errors.Join(err, api.MemUnmap(ptr, r.chunk), api.MemRelease(h))
		}
		r.handles = append(r.handles, h)
		return nil
	})
}

// shrink waits for queued work (as growbuf's Shrink must), then unmaps and releases the last chunk.
func (r *rawSpace) shrink() error {
	i := len(r.handles) - 1
	ptr := r.ptr + driver.DevicePtr(uint64(i)*r.chunk)
	return r.d.Raw(func(api driver.API) error {
		if err := api.CtxSynchronize(); err != nil {
			return err
		}
		if err := api.MemUnmap(ptr, r.chunk); err != nil {
			return err
		}
		err := api.MemRelease(r.handles[i])
		r.handles = r.handles[:i]
		return err
	})
}

func (r *rawSpace) clear() error {
	for len(r.handles) > 0 {
		if err := r.shrink(); err != nil {
			return err
		}
	}
	return nil
}

func newBenchBuffer(b *testing.B, d *vmm.Device, chunk uint64) *growbuf.Buffer {
	buf, err := growbuf.New(d, growbuf.Options{MaxSize: benchBatch * chunk, Chunk: growbuf.FixedChunks(chunk)})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if err := buf.Close(); err != nil {
			b.Error(err)
		}
	})
	return buf
}

func report(b *testing.B, unit string, gb, raw time.Duration) {
	n := float64(b.N)
	b.ReportMetric(float64(gb.Nanoseconds())/n, "ns/"+unit)
	b.ReportMetric(float64(raw.Nanoseconds())/n, "ns/raw")
	if raw > 0 {
		b.ReportMetric(float64(gb)/float64(raw), "x_raw")
	}
}

// BenchmarkGrowOneChunk: Grow by one chunk (cuMemCreate, cuMemMap, cuMemSetAccess inside) against
// the same three raw calls.
func BenchmarkGrowOneChunk(b *testing.B) {
	benchChunks(b, func(b *testing.B, d *vmm.Device, chunk uint64) {
		buf := newBenchBuffer(b, d, chunk)
		raw := newRawSpace(b, d, chunk)
		var gbTime, rawTime time.Duration
		b.ResetTimer()
		for done, round := 0, 0; done < b.N; round++ {
			k := min(benchBatch, b.N-done)
			timeGrowbuf := func() {
				t0 := time.Now()
				for i := 1; i <= k; i++ {
					if err := buf.Grow(uint64(i) * chunk); err != nil {
						b.Fatal(err)
					}
				}
				gbTime += time.Since(t0)
			}
			timeRaw := func() {
				t0 := time.Now()
				for i := 0; i < k; i++ {
					if err := raw.grow(i); err != nil {
						b.Fatal(err)
					}
				}
				rawTime += time.Since(t0)
			}
			if round%2 == 0 { // alternate the order so that neither always runs on a warm cache
				timeGrowbuf()
				timeRaw()
			} else {
				timeRaw()
				timeGrowbuf()
			}
			if err := buf.Resize(0); err != nil {
				b.Fatal(err)
			}
			if err := raw.clear(); err != nil {
				b.Fatal(err)
			}
			done += k
		}
		b.StopTimer()
		report(b, "grow", gbTime, rawTime)
	})
}

// BenchmarkShrinkOneChunk: Shrink by one chunk (cuCtxSynchronize, cuMemUnmap, cuMemRelease inside)
// against the same three raw calls.
func BenchmarkShrinkOneChunk(b *testing.B) {
	benchChunks(b, func(b *testing.B, d *vmm.Device, chunk uint64) {
		buf := newBenchBuffer(b, d, chunk)
		raw := newRawSpace(b, d, chunk)
		var gbTime, rawTime time.Duration
		b.ResetTimer()
		for done := 0; done < b.N; {
			k := min(benchBatch, b.N-done)
			if err := buf.Grow(uint64(k) * chunk); err != nil {
				b.Fatal(err)
			}
			for i := 0; i < k; i++ {
				if err := raw.grow(i); err != nil {
					b.Fatal(err)
				}
			}
			t0 := time.Now()
			for i := k - 1; i >= 0; i-- {
				if err := buf.Shrink(uint64(i) * chunk); err != nil {
					b.Fatal(err)
				}
			}
			gbTime += time.Since(t0)
			t0 = time.Now()
			for i := 0; i < k; i++ {
				if err := raw.shrink(); err != nil {
					b.Fatal(err)
				}
			}
			rawTime += time.Since(t0)
			done += k
		}
		b.StopTimer()
		report(b, "shrink", gbTime, rawTime)
	})
}
