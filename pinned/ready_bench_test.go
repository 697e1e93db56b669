package pinned_test

import (
	"os"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// BenchmarkReady breaks down what making a large region ready costs: faulting the pages in from
// several threads, then cuMemHostRegister of the whole range or of 1 GiB pieces registered from
// several threads at once, and whether a copy across two pieces still runs at pinned speed. Size:
// $CUVMM_BENCH_READY_SIZE (default 16 GiB on a GPU, 64 MiB on the simulator). Run with
// -test.benchtime 1x.
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
	for _, split := range []bool{false, true} {
		name := "whole"
		if split {
			name = "pieces"
		}
		b.Run(name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				mem, err := pinned.MapAnonymous(size)
				check(b, err)
				t0 := time.Now()
				parallelPopulate(mem)
				pop := time.Since(t0)
				t1 := time.Now()
				var regs []*vmm.HostRegistration
				if !split {
					reg, err := d.HostRegister(mem, 1|2)
					check(b, err)
					regs = append(regs, reg)
				} else {
					n := int((size + piece - 1) / piece)
					regs = make([]*vmm.HostRegistration, n)
					errs := make([]error, n)
					var wg sync.WaitGroup
					for k := 0; k < n; k++ {
						wg.Add(1)
						go func() {
							defer wg.Done()
							off := uint64(k) * piece
							regs[k], errs[k] = d.HostRegister(mem[off:min(off+piece, size)], 1|2)
						}()
					}
					wg.Wait()
					for _, err := range errs {
						check(b, err)
					}
				}
				reg := time.Since(t1)
				b.ReportMetric(pop.Seconds(), "populate_s")
				b.ReportMetric(reg.Seconds(), "register_s")
				b.ReportMetric((pop + reg).Seconds(), "ready_s")
				if size >= 2*piece {
					// A copy of one piece's size straddling the boundary between the first two pieces,
					// against one inside the first piece.
					dev, err := d.AllocPlain(piece)
					check(b, err)
					t := newEventTimer(b, d)
					inside := t.time(b, func() error {
						return d.CopyHtoDAsync(dev.Ptr(), unsafe.Pointer(&mem[0]), piece, t.s)
					})
					across := t.time(b, func() error {
						return d.CopyHtoDAsync(dev.Ptr(), unsafe.Pointer(&mem[piece/2]), piece, t.s)
					})
					b.ReportMetric(float64(piece)/inside.Seconds()/1e9, "inside_GB/s")
					b.ReportMetric(float64(piece)/across.Seconds()/1e9, "across_GB/s")
					check(b, dev.Close())
				}
				for _, r := range regs {
					check(b, r.Close())
				}
				check(b, pinned.Unmap(mem))
			}
		})
	}
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
