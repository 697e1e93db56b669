package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/kernels"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

func init() {
	register(&command{
		name:    "bandwidth",
		summary: "host↔device copy bandwidth: pageable, cuMemHostAlloc, registered, host-NUMA and shared-memory regions; async staging",
		run:     runBandwidth,
		tour:    []string{"--max-size", "16MiB", "--staging", "64MiB"},
	})
}

// bwSizes are the copy sizes measured (those up to --max-size).
var bwSizes = []uint64{64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30}

// The memory kinds, in table order. host-alloc with the raw driver call is the baseline.
const (
	bwPageable     = "pageable"
	bwHostAlloc    = "host-alloc"
	bwRegistered   = "registered"
	bwHostNUMA     = "host-numa"
	bwSharedMemory = "shared-memory"
)

type bwRow struct {
	Kind      string  `json:"kind"`
	Direction string  `json:"direction"` // "h2d" or "d2h"
	SizeBytes uint64  `json:"size_bytes"`
	Iters     int     `json:"iterations"`
	MedianGBs float64 `json:"median_gbps"`
	BestGBs   float64 `json:"best_gbps"`
	// VsHostAlloc is this row's median over the raw cuMemcpy on cuMemHostAlloc memory at the same
	// size and direction, measured in the same run.
	VsHostAlloc float64 `json:"vs_host_alloc"`
}

type bwSetup struct {
	Kind    string  `json:"kind"`
	Seconds float64 `json:"seconds"` // time to make max-size bytes of this kind ready
	Note    string  `json:"note,omitempty"`
}

type bwStaging struct {
	SizeBytes   uint64  `json:"size_bytes"`
	ChunkBytes  uint64  `json:"chunk_bytes"`
	Buffers     int     `json:"buffers"`
	D2HGBs      float64 `json:"d2h_gbps"`       // device → discarding io.Writer, wall clock
	H2DGBs      float64 `json:"h2d_gbps"`       // non-copying io.Reader → device, wall clock
	RawD2HGBs   float64 `json:"raw_d2h_gbps"`   // baseline: host-alloc D2H at the largest size
	RawH2DGBs   float64 `json:"raw_h2d_gbps"`   // baseline: host-alloc H2D at the largest size
	D2HVsRaw    float64 `json:"d2h_vs_raw"`     // target on the GPU host: ≥ 0.9
	H2DVsRaw    float64 `json:"h2d_vs_raw"`     //
	BaselineLen uint64  `json:"baseline_bytes"` // the size the baseline was measured at
}

type bwResult struct {
	Backend  string     `json:"backend"`
	Device   int        `json:"device"`
	Name     string     `json:"device_name"`
	Timing   string     `json:"timing"`
	Setup    []bwSetup  `json:"setup"`
	Rows     []bwRow    `json:"rows"`
	Verified bool       `json:"verified"`
	Staging  *bwStaging `json:"staging,omitempty"`
	// MinPinnedVsHostAlloc is the lowest VsHostAlloc of the pinned kinds at 16 MiB and above
	// (target on the GPU host: ≥ 0.97).
	MinPinnedVsHostAlloc float64 `json:"min_pinned_vs_host_alloc"`
}

func runBandwidth(e *env, args []string) error {
	var c common
	fs := newFlags(e, "bandwidth")
	c.register(fs, 1)
	device := fs.Int("device", 0, "device ordinal")
	var maxSize, staging, chunk sizeFlag
	fs.Var(&maxSize, "max-size", "largest copy measured (default 1GiB on a GPU, 64MiB on the simulator)")
	fs.Var(&staging, "staging", "bytes moved through async staging to a discarding writer and from a non-copying reader (default 8GiB on a GPU, 64MiB on the simulator; 0 with --no-staging)")
	fs.Var(&chunk, "staging-chunk", "staging buffer size (default 32MiB)")
	buffers := fs.Int("staging-buffers", 2, "staging buffers (at least 2)")
	noStaging := fs.Bool("no-staging", false, "skip the staging measurement")
	iters := fs.Int("iters", 0, "timed iterations per size (default: 5 to 50, fewer for large sizes)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *iters < 0 || *buffers < 2 {
		return fmt.Errorf("--iters must be ≥ 0 and --staging-buffers ≥ 2: %w", errUsage)
	}
	b, err := c.openLegacy(e)
	if err != nil {
		return err
	}
	defer b.Close()
	d, err := b.sys.Device(*device)
	if err != nil {
		return err
	}
	if maxSize.v == 0 {
		maxSize.v = 1 << 30
		if b.sim != nil {
			maxSize.v = 64 << 20
		}
	}
	if staging.v == 0 && !*noStaging {
		staging.v = 8 << 30
		if b.sim != nil {
			staging.v = 64 << 20
		}
	}
	if *noStaging {
		staging.v = 0
	}
	if chunk.v == 0 {
		chunk.v = 32 << 20
	}
	var sizes []uint64
	for _, s := range bwSizes {
		if s <= maxSize.v {
			sizes = append(sizes, s)
		}
	}
	if len(sizes) == 0 {
		return fmt.Errorf("--max-size %s is below the smallest size measured (64KiB): %w", units.FormatSize(maxSize.v), errUsage)
	}
	res, err := measureBandwidth(e, b, d, sizes, *iters, c.json)
	if err != nil {
		return err
	}
	if staging.v > 0 {
		if res.Staging, err = measureStaging(e, d, staging.v, chunk.v, *buffers, res, c.json); err != nil {
			return err
		}
	}
	if c.json {
		return writeJSON(e.stdout, res)
	}
	printBandwidth(e, res, sizes)
	return nil
}

// bwHost is one kind of host memory of the largest size, with its copy calls.
type bwHost struct {
	kind  string
	mem   []byte
	h2d   func(dst driver.DevicePtr, n uint64, s *vmm.Stream) error
	d2h   func(src driver.DevicePtr, n uint64, s *vmm.Stream) error
	close func() error
}

func bwIters(size uint64, fixed int) int {
	if fixed > 0 {
		return fixed
	}
	return int(min(max((1<<30)/size, 5), 50))
}

func measureBandwidth(e *env, b *backend, d *vmm.Device, sizes []uint64, fixed int, jsonOut bool) (res *bwResult, err error) {
	top := sizes[len(sizes)-1]
	res = &bwResult{Backend: b.name, Device: d.Ordinal(), Name: d.Name(),
		Timing: "CUDA events around each copy on a non-blocking stream; GB/s = 1e9 bytes/s; median and best of the iterations"}
	if b.sim != nil {
		res.Timing += " (simulator: wall time of Go copies, not GPU figures)"
	}
	dev, err := d.AllocPlain(top)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, dev.Close()) }()
	s, err := d.NewStream(true)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, s.Close()) }()
	start, err := d.NewEvent(true)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, start.Close()) }()
	end, err := d.NewEvent(true)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, end.Close()) }()

	hosts, setup, err := bwMakeHosts(e, d, top, jsonOut)
	defer func() {
		for _, h := range hosts {
			err = errors.Join(err, h.close())
		}
	}()
	if err != nil {
		return nil, err
	}
	res.Setup = setup

	// The device holds a pattern; each kind copies it down (checked on the CPU) and back up
	// (checked on the GPU) at the largest size.
	const seed = 0xb4
	if err := d.Fill(dev.Ptr(), top, 0, seed); err != nil {
		return nil, err
	}
	timeIt := func(fn func() error) (time.Duration, error) {
		if err := start.Record(s); err != nil {
			return 0, err
		}
		if err := fn(); err != nil {
			return 0, err
		}
		if err := end.Record(s); err != nil {
			return 0, err
		}
		if err := end.Synchronize(); err != nil {
			return 0, err
		}
		el, err := end.Elapsed(start)
		return max64(el, time.Nanosecond), err
	}
	res.Verified = true
	bar := newProgress(e, "bandwidth", uint64(2*len(sizes)), jsonOut)
	defer bar.Done()
	done := uint64(0)
	// The kinds take turns within each size and direction, iteration by iteration, so that noise
	// that comes and goes over the run (other copies, the host's page handling) falls on all of them
	// alike and the ratios compare like with like.
	for _, dir := range []string{"d2h", "h2d"} {
		for _, size := range sizes {
			n := bwIters(size, fixed)
			copyFns := make([]func() error, len(hosts))
			times := make([][]time.Duration, len(hosts))
			for k, h := range hosts {
				copyFns[k] = func() error { return h.d2h(dev.Ptr(), size, s) }
				if dir == "h2d" {
					copyFns[k] = func() error { return h.h2d(dev.Ptr(), size, s) }
				}
				if _, err := timeIt(copyFns[k]); err != nil { // warm-up
					return nil, fmt.Errorf("%s %s %s: %w", h.kind, dir, units.FormatSize(size), err)
				}
				times[k] = make([]time.Duration, n)
			}
			for i := 0; i < n; i++ {
				for k, h := range hosts {
					if times[k][i], err = timeIt(copyFns[k]); err != nil {
						return nil, fmt.Errorf("%s %s %s: %w", h.kind, dir, units.FormatSize(size), err)
					}
				}
			}
			gbs := func(t time.Duration) float64 { return float64(size) / t.Seconds() / 1e9 }
			for k, h := range hosts {
				ts := times[k]
				sort.Slice(ts, func(i, j int) bool { return ts[i] < ts[j] })
				res.Rows = append(res.Rows, bwRow{Kind: h.kind, Direction: dir, SizeBytes: size, Iters: n,
					MedianGBs: gbs(ts[n/2]), BestGBs: gbs(ts[0])})
			}
			done++
			bar.Update(done)
		}
		for _, h := range hosts {
			if dir == "d2h" {
				// The host copy holds the device's pattern.
				w := unsafe.Slice((*uint64)(unsafe.Pointer(&h.mem[0])), top/8)
				for _, i := range []uint64{0, 1, top/16 + 3, top/8 - 1} {
					if w[i] != kernels.Pattern(i, seed) {
						res.Verified = false
					}
				}
			}
		}
		if dir == "h2d" {
			// Every kind copied the same pattern back up; the device still holds it.
			bad, err := d.Verify(dev.Ptr(), top, 0, seed)
			if err != nil {
				return nil, err
			}
			res.Verified = res.Verified && bad == 0
		}
	}
	sort.SliceStable(res.Rows, func(i, j int) bool { return res.Rows[i].Kind < res.Rows[j].Kind })
	base := map[string]float64{}
	for _, r := range res.Rows {
		if r.Kind == bwHostAlloc {
			base[fmt.Sprint(r.Direction, r.SizeBytes)] = r.MedianGBs
		}
	}
	res.MinPinnedVsHostAlloc = 0
	for i := range res.Rows {
		r := &res.Rows[i]
		if b := base[fmt.Sprint(r.Direction, r.SizeBytes)]; b > 0 {
			r.VsHostAlloc = r.MedianGBs / b
		}
		if r.Kind != bwPageable && r.Kind != bwHostAlloc && r.SizeBytes >= 16<<20 {
			if res.MinPinnedVsHostAlloc == 0 || r.VsHostAlloc < res.MinPinnedVsHostAlloc {
				res.MinPinnedVsHostAlloc = r.VsHostAlloc
			}
		}
	}
	return res, nil
}

func max64(a, b time.Duration) time.Duration {
	if a > b {
		return a
	}
	return b
}

// fillBytes writes a byte pattern over mem, faulting every page in (so no page fault is timed).
func fillBytes(mem []byte) {
	if len(mem) == 0 {
		return
	}
	mem[0] = 0x5a
	for n := 1; n < len(mem); n *= 2 {
		copy(mem[n:], mem[:n])
	}
}

// bwMakeHosts makes each kind of host memory of size bytes and times how long it takes to be ready.
func bwMakeHosts(e *env, d *vmm.Device, size uint64, jsonOut bool) (hosts []bwHost, setup []bwSetup, err error) {
	timed := func(kind string, fn func() error) error {
		t0 := time.Now()
		if err := fn(); err != nil {
			return fmt.Errorf("%s memory of %s: %w", kind, units.FormatSize(size), err)
		}
		setup = append(setup, bwSetup{Kind: kind, Seconds: time.Since(t0).Seconds()})
		return nil
	}
	bar := func(label string) func(done, total uint64) {
		p := newProgress(e, label, size, jsonOut)
		return func(done, total uint64) {
			p.Update(done)
			if done >= total {
				p.Done()
			}
		}
	}

	// Pageable: plain anonymous memory (not Go heap: the copies are queued on a stream).
	err = timed(bwPageable, func() error {
		mem, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			return err
		}
		fillBytes(mem)
		p := unsafe.Pointer(&mem[0])
		hosts = append(hosts, bwHost{kind: bwPageable, mem: mem,
			h2d:   func(dst driver.DevicePtr, n uint64, s *vmm.Stream) error { return d.CopyHtoDAsync(dst, p, n, s) },
			d2h:   func(src driver.DevicePtr, n uint64, s *vmm.Stream) error { return d.CopyDtoHAsync(p, src, n, s) },
			close: func() error { return unix.Munmap(mem) }})
		return nil
	})
	if err != nil {
		return hosts, setup, err
	}
	setup[len(setup)-1].Note = "mmap and first touch"

	// cuMemHostAlloc with the raw driver calls: the baseline.
	err = timed(bwHostAlloc, func() error {
		hb, err := d.HostAlloc(size, driver.HostAllocPortable|driver.HostAllocDeviceMap)
		if err != nil {
			return err
		}
		fillBytes(hb.Bytes())
		p := hb.Pointer()
		hosts = append(hosts, bwHost{kind: bwHostAlloc, mem: hb.Bytes(),
			h2d: func(dst driver.DevicePtr, n uint64, s *vmm.Stream) error {
				return d.Raw(func(api driver.API) error { return api.MemcpyHtoDAsync(dst, p, n, s.Handle()) })
			},
			d2h: func(src driver.DevicePtr, n uint64, s *vmm.Stream) error {
				return d.Raw(func(api driver.API) error { return api.MemcpyDtoHAsync(p, src, n, s.Handle()) })
			},
			close: hb.Close})
		return nil
	})
	if err != nil {
		return hosts, setup, err
	}
	setup[len(setup)-1].Note = "cuMemHostAlloc; copies are raw cuMemcpy*Async calls (the baseline)"

	region := func(kind string, r *pinned.Region, unmap []byte) bwHost {
		return bwHost{kind: kind, mem: r.Bytes(),
			h2d: func(dst driver.DevicePtr, n uint64, s *vmm.Stream) error { return r.CopyToDevice(s, dst, 0, n) },
			d2h: func(src driver.DevicePtr, n uint64, s *vmm.Stream) error { return r.CopyFromDevice(s, src, 0, n) },
			close: func() error {
				err := r.Close()
				if unmap != nil {
					err = errors.Join(err, pinned.Unmap(unmap))
				}
				return err
			}}
	}
	err = timed(bwRegistered, func() error {
		mem, err := pinned.MapAnonymous(size)
		if err != nil {
			return err
		}
		r, err := pinned.Register(d, mem, pinned.RegisterOptions{HugePages: true, Progress: bar("registering")})
		if err != nil {
			return errors.Join(err, pinned.Unmap(mem))
		}
		hosts = append(hosts, region(bwRegistered, r, mem))
		return nil
	})
	if err != nil {
		return hosts, setup, err
	}
	setup[len(setup)-1].Note = "anonymous memory with transparent huge pages, cuMemHostRegister (pinned.Register)"

	if pinned.SupportsHostNUMA(d) {
		err = timed(bwHostNUMA, func() error {
			r, err := pinned.New(d, size, pinned.Options{Kind: pinned.HostNUMA, Progress: bar("host-NUMA")})
			if err != nil {
				return err
			}
			hosts = append(hosts, region(bwHostNUMA, r, nil))
			return nil
		})
		if err != nil {
			return hosts, setup, err
		}
		setup[len(setup)-1].Note = "cuMemCreate at the device's host NUMA node, mapped for the CPU and the device (pinned.New)"
	} else {
		fmt.Fprintf(e.stderr, "vmmdemo bandwidth: %s reports no host-NUMA VMM support: no host-numa row\n", d)
	}

	err = timed(bwSharedMemory, func() error {
		r, err := pinned.New(d, size, pinned.Options{Kind: pinned.SharedMemory, Progress: bar("shared memory")})
		if err != nil {
			return err
		}
		hosts = append(hosts, region(bwSharedMemory, r, nil))
		return nil
	})
	if err != nil {
		return hosts, setup, err
	}
	setup[len(setup)-1].Note = "memfd, mmap MAP_SHARED, cuMemHostRegister (pinned.New, the fallback kind)"
	return hosts, setup, nil
}

// bwReader is an io.Reader that hands out len(p) bytes without writing them: the input side of the
// staging measurement, so that only the staging is timed.
type bwReader struct{}

func (bwReader) Read(p []byte) (int, error) { return len(p), nil }

func measureStaging(e *env, d *vmm.Device, size, chunk uint64, buffers int, res *bwResult, jsonOut bool) (st *bwStaging, err error) {
	dev, err := d.AllocPlain(size)
	if err != nil {
		return nil, fmt.Errorf("staging: %w", err)
	}
	defer func() { err = errors.Join(err, dev.Close()) }()
	if err := d.Memset(dev.Ptr(), 0x33, size); err != nil {
		return nil, err
	}
	stager, err := pinned.NewStager(d, pinned.StagerOptions{Buffers: buffers, BufferSize: chunk})
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, stager.Close()) }()
	st = &bwStaging{SizeBytes: size, ChunkBytes: stager.ChunkSize(), Buffers: buffers}
	bar := newProgress(e, "staging", 6, jsonOut)
	defer bar.Done()
	ctx := context.Background()
	best := func(fn func() (int64, error)) (float64, error) {
		var gbs []float64
		for i := 0; i < 3; i++ {
			t0 := time.Now()
			n, err := fn()
			if err != nil {
				return 0, err
			}
			if uint64(n) != size {
				return 0, fmt.Errorf("staging moved %d of %d bytes", n, size)
			}
			gbs = append(gbs, float64(size)/max64(time.Since(t0), time.Nanosecond).Seconds()/1e9)
			bar.Update(uint64(len(gbs)))
		}
		sort.Float64s(gbs)
		return gbs[1], nil // the median of three
	}
	if st.D2HGBs, err = best(func() (int64, error) { return stager.DeviceToWriter(ctx, io.Discard, dev.Ptr(), size) }); err != nil {
		return nil, fmt.Errorf("staging device to writer: %w", err)
	}
	if st.H2DGBs, err = best(func() (int64, error) { return stager.ReaderToDevice(ctx, dev.Ptr(), bwReader{}, size) }); err != nil {
		return nil, fmt.Errorf("staging reader to device: %w", err)
	}
	for _, r := range res.Rows {
		if r.Kind == bwHostAlloc && r.SizeBytes >= st.BaselineLen {
			st.BaselineLen = r.SizeBytes
			if r.Direction == "d2h" {
				st.RawD2HGBs = r.MedianGBs
			} else {
				st.RawH2DGBs = r.MedianGBs
			}
		}
	}
	if st.RawD2HGBs > 0 {
		st.D2HVsRaw = st.D2HGBs / st.RawD2HGBs
	}
	if st.RawH2DGBs > 0 {
		st.H2DVsRaw = st.H2DGBs / st.RawH2DGBs
	}
	return st, nil
}

func printBandwidth(e *env, r *bwResult, sizes []uint64) {
	w := e.stdout
	fmt.Fprintf(w, "bandwidth on device %d (%s), %s backend\n", r.Device, r.Name, r.Backend)
	fmt.Fprintf(w, "timing: %s\n", r.Timing)
	fmt.Fprintln(w, "ready (time to make the largest size usable):")
	for _, s := range r.Setup {
		fmt.Fprintf(w, "  %-14s %8.1f ms  %s\n", s.Kind, s.Seconds*1e3, s.Note)
	}
	var kinds []string
	seen := map[string]bool{}
	for _, row := range r.Rows {
		if !seen[row.Kind] {
			seen[row.Kind] = true
			kinds = append(kinds, row.Kind)
		}
	}
	for _, dir := range []string{"h2d", "d2h"} {
		fmt.Fprintf(w, "\n%s median GB/s (× host-alloc)\n", map[string]string{"h2d": "host → device", "d2h": "device → host"}[dir])
		fmt.Fprintf(w, "  %-8s", "size")
		for _, k := range kinds {
			fmt.Fprintf(w, " %20s", k)
		}
		fmt.Fprintln(w)
		for _, size := range sizes {
			fmt.Fprintf(w, "  %-8s", units.FormatSize(size))
			for _, k := range kinds {
				for _, row := range r.Rows {
					if row.Kind == k && row.Direction == dir && row.SizeBytes == size {
						fmt.Fprintf(w, " %12.1f (%5.2f)", row.MedianGBs, row.VsHostAlloc)
					}
				}
			}
			fmt.Fprintln(w)
		}
	}
	fmt.Fprintf(w, "\npinned regions vs raw cuMemcpy on cuMemHostAlloc memory, sizes ≥ 16 MiB: lowest ratio %.3f (target ≥ 0.97)\n", r.MinPinnedVsHostAlloc)
	if s := r.Staging; s != nil {
		fmt.Fprintf(w, "async staging of %s in %d × %s buffers:\n", units.FormatSize(s.SizeBytes), s.Buffers, units.FormatSize(s.ChunkBytes))
		fmt.Fprintf(w, "  device → discarding writer %6.1f GB/s = %.3f × raw D2H %.1f GB/s (target ≥ 0.9)\n", s.D2HGBs, s.D2HVsRaw, s.RawD2HGBs)
		fmt.Fprintf(w, "  reader → device            %6.1f GB/s = %.3f × raw H2D %.1f GB/s\n", s.H2DGBs, s.H2DVsRaw, s.RawH2DGBs)
	}
	fmt.Fprintf(w, "patterns verified: %s\n", yesNo(r.Verified))
}
