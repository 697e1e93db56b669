package pinned_test

import (
	"os"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// BenchmarkReady breaks down what making a large region ready costs: pinned.Register as a whole,
// then its two steps timed apart (faulting the pages in from several threads, then one
// cuMemHostRegister), and a copy at pinned speed from the result. Size: $CUVMM_BENCH_READY_SIZE
// (default 16 GiB on a GPU, 64 MiB on the simulator). Run with -test.benchtime 1x. On a virtual
// machine whose memory grows as it is used, the first run pays for that growth; later runs show the
// steady cost.
func BenchmarkReady(b *testing.B) {
	d, real := benchDevice(b)
	size := uint64(64 << 20)
	piece := uint64(16 << 20)
	if real {
		size, piece = 16<<30, 1<<30
	}
	if v := os.Getenv("CUVMM_BENCH_READY_SIZE"); v != "" {
		n, err := units.ParseSize(v)
		check(b, err)
		size = n
	}
	b.Run("library", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			mem, err := pinned.MapAnonymous(size)
			check(b, err)
			t0 := time.Now()
			r, err := pinned.Register(d, mem, pinned.RegisterOptions{HugePages: true})
			check(b, err)
			b.ReportMetric(time.Since(t0).Seconds(), "ready_s")
			check(b, r.Close())
			check(b, pinned.Unmap(mem))
		}
	})
	b.Run("steps", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			mem, err := pinned.MapAnonymous(size)
			check(b, err)
			t0 := time.Now()
			parallelPopulate(mem)
			pop := time.Since(t0)
			t1 := time.Now()
			hr, err := d.HostRegister(mem, driver.HostRegisterPortable|driver.HostRegisterDeviceMap)
			check(b, err)
			reg := time.Since(t1)
			b.ReportMetric(pop.Seconds(), "populate_s")
			b.ReportMetric(reg.Seconds(), "register_s")
			b.ReportMetric((pop + reg).Seconds(), "ready_s")
			// The registration copies at pinned speed.
			dev, err := d.AllocPlain(piece)
			check(b, err)
			t := newEventTimer(b, d)
			el := t.time(b, func() error {
				return d.CopyHtoDAsync(dev.Ptr(), unsafe.Pointer(&mem[size-piece]), piece, t.s)
			})
			b.ReportMetric(float64(piece)/el.Seconds()/1e9, "h2d_GB/s")
			check(b, dev.Close())
			check(b, hr.Close())
			check(b, pinned.Unmap(mem))
		}
	})
}

// parallelPopulate faults mem in with MADV_POPULATE_WRITE from up to 16 threads, 64 MiB at a time.
func parallelPopulate(mem []byte) {
	const step = 64 << 20
	var wg sync.WaitGroup
	next := make(chan int, len(mem)/step+1)
	for off := 0; off < len(mem); off += step {
		next <- off
	}
	close(next)
	for w := 0; w < 16; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for off := range next {
				_ = unix.Madvise(mem[off:min(off+step, len(mem))], unix.MADV_POPULATE_WRITE)
			}
		}()
	}
	wg.Wait()
}

// BenchmarkRegisterContexts times cuMemHostRegister in a process that holds one GPU against one
// that holds two: memory already faulted in (MapAnonymous, transparent huge pages) is registered in
// pieces (256 MiB on a GPU) from one goroutine and unregistered, first with only device 0 open (one
// primary context), then with device 1 open as well. Each reports register_s with the flags
// pinned.Register uses (PORTABLE|DEVICEMAP) and register_devicemap_s without PORTABLE; the second
// reports x_one_context, its register_s over the first's. Size as BenchmarkReady. Run with
// -test.benchtime 2x; it skips the second half where there is one device.
func BenchmarkRegisterContexts(b *testing.B) {
	d, real := benchDeviceOf(b, 2)
	size, piece := uint64(64<<20), uint64(16<<20)
	if real {
		size, piece = 16<<30, 256<<20
	}
	if v := os.Getenv("CUVMM_BENCH_READY_SIZE"); v != "" {
		n, err := units.ParseSize(v)
		check(b, err)
		size = max(n/piece, 1) * piece
	}
	mem, err := pinned.MapAnonymous(size)
	check(b, err)
	b.Cleanup(func() { check(b, pinned.Unmap(mem)) })
	parallelPopulate(mem)
	var one float64
	measure := func(b *testing.B) float64 {
		var all, devmap float64
		for i := 0; i < b.N; i++ {
			all += registerPieces(b, d, mem, piece, driver.HostRegisterPortable|driver.HostRegisterDeviceMap)
			devmap += registerPieces(b, d, mem, piece, driver.HostRegisterDeviceMap)
		}
		n := float64(b.N)
		b.ReportMetric(all/n, "register_s")
		b.ReportMetric(devmap/n, "register_devicemap_s")
		b.ReportMetric(float64(size)/(all/n)/1e9, "register_GB/s")
		return all / n
	}
	b.Run("one-context", func(b *testing.B) { one = measure(b) })
	b.Run("two-contexts", func(b *testing.B) {
		if _, err := d.System().Device(1); err != nil {
			b.Skipf("a second device is needed: %v", err)
		}
		b.ReportMetric(measure(b)/one, "x_one_context")
	})
}

// registerPieces registers mem in pieces of piece bytes with flags, then unregisters them; it
// returns the seconds the registrations took.
func registerPieces(b *testing.B, d *vmm.Device, mem []byte, piece uint64, flags uint32) float64 {
	regs := make([]*vmm.HostRegistration, 0, uint64(len(mem))/piece)
	t0 := time.Now()
	for off := uint64(0); off < uint64(len(mem)); off += piece {
		r, err := d.HostRegister(mem[off:off+piece], flags)
		check(b, err)
		regs = append(regs, r)
	}
	took := time.Since(t0).Seconds()
	for _, r := range regs {
		check(b, r.Close())
	}
	return took
}
