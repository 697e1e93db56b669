package measure

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// bwHost is one kind of host memory of the largest size, with its copy calls.
type bwHost struct {
	kind  string
	mem   []byte
	h2d   func(dst driver.DevicePtr, n uint64, s *vmm.Stream) error
	d2h   func(src driver.DevicePtr, n uint64, s *vmm.Stream) error
	close func() error
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

// bwKind makes one kind of host memory.
type bwKind struct {
	kind, note string
	make       func(d *vmm.Device, size uint64, bar func(string) progressFunc) (bwHost, error)
}

// makeHosts makes each kind of host memory of size bytes and times how long each takes to be ready.
func (b *bwBench) makeHosts(o *BandwidthOptions, size uint64) ([]BandwidthSetup, error) {
	bar := func(label string) progressFunc {
		update, end := lazyBar(o.Progress, label)
		return func(done, total uint64) {
			update(done, total)
			if done >= total {
				end()
			}
		}
	}
	var setup []BandwidthSetup
	for _, k := range bwKinds {
		if k.kind == HostNUMA && !pinned.SupportsHostNUMA(b.d) {
			o.logf("vmmdemo bandwidth: %s reports no host-NUMA VMM support: no host-numa row\n", b.d)
			continue
		}
		t0 := time.Now()
		h, err := k.make(b.d, size, bar)
		if err != nil {
			return setup, fmt.Errorf("%s memory of %s: %w", k.kind, units.FormatSize(size), err)
		}
		setup = append(setup, BandwidthSetup{Kind: k.kind, Seconds: time.Since(t0).Seconds(), Note: k.note})
		if k.kind == HostAlloc {
			// Written outside the clock: the pinned kinds' setup times make memory ready without
			// a CPU pass over it (pageable's first touch is its setup).
			fillBytes(h.mem)
		}
		b.hosts = append(b.hosts, h)
	}
	return setup, nil
}

var bwKinds = []bwKind{
	{HostPageable, "mmap and first touch", makePageable},
	{HostAlloc, "cuMemHostAlloc; copies are raw cuMemcpy*Async calls (the baseline)", makeHostAlloc},
	{HostRegistered, "anonymous memory with transparent huge pages, cuMemHostRegister (pinned.Register)", makeRegistered},
	{HostNUMA, "cuMemCreate at the device's host NUMA node, mapped for the CPU and the device (pinned.New)",
		func(d *vmm.Device, size uint64, bar func(string) progressFunc) (bwHost, error) {
			return makeRegion(d, size, HostNUMA, pinned.Options{Kind: pinned.HostNUMA, Progress: bar("host-NUMA")})
		}},
	{HostSharedMemory, "memfd, mmap MAP_SHARED, cuMemHostRegister (pinned.New, the fallback kind)",
		func(d *vmm.Device, size uint64, bar func(string) progressFunc) (bwHost, error) {
			return makeRegion(d, size, HostSharedMemory, pinned.Options{Kind: pinned.SharedMemory, Progress: bar("shared memory")})
		}},
}

// makePageable is plain anonymous memory (not Go heap: the copies are queued on a stream).
func makePageable(d *vmm.Device, size uint64, _ func(string) progressFunc) (bwHost, error) {
	mem, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return bwHost{}, err
	}
	fillBytes(mem)
	p := unsafe.Pointer(&mem[0])
	return bwHost{kind: HostPageable, mem: mem,
		h2d:   func(dst driver.DevicePtr, n uint64, s *vmm.Stream) error { return d.CopyHtoDAsync(dst, p, n, s) },
		d2h:   func(src driver.DevicePtr, n uint64, s *vmm.Stream) error { return d.CopyDtoHAsync(p, src, n, s) },
		close: func() error { return unix.Munmap(mem) }}, nil
}

// makeHostAlloc is cuMemHostAlloc with the raw driver calls: the baseline.
func makeHostAlloc(d *vmm.Device, size uint64, _ func(string) progressFunc) (bwHost, error) {
	hb, err := d.HostAlloc(size, driver.HostAllocPortable|driver.HostAllocDeviceMap)
	if err != nil {
		return bwHost{}, err
	}
	p := hb.Pointer()
	return bwHost{kind: HostAlloc, mem: hb.Bytes(),
		h2d: func(dst driver.DevicePtr, n uint64, s *vmm.Stream) error {
			return d.Raw(func(api driver.API) error { return api.MemcpyHtoDAsync(dst, p, n, s.Handle()) })
		},
		d2h: func(src driver.DevicePtr, n uint64, s *vmm.Stream) error {
			return d.Raw(func(api driver.API) error { return api.MemcpyDtoHAsync(p, src, n, s.Handle()) })
		},
		close: hb.Close}, nil
}

func makeRegistered(d *vmm.Device, size uint64, bar func(string) progressFunc) (bwHost, error) {
	mem, err := pinned.MapAnonymous(size)
	if err != nil {
		return bwHost{}, err
	}
	r, err := pinned.Register(d, mem, pinned.RegisterOptions{HugePages: true, Progress: bar("registering")})
	if err != nil {
		return bwHost{}, errors.Join(err, pinned.Unmap(mem))
	}
	return regionHost(HostRegistered, r, mem), nil
}

func makeRegion(d *vmm.Device, size uint64, kind string, opts pinned.Options) (bwHost, error) {
	r, err := pinned.New(d, size, opts)
	if err != nil {
		return bwHost{}, err
	}
	return regionHost(kind, r, nil), nil
}

func regionHost(kind string, r *pinned.Region, unmap []byte) bwHost {
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

// bwReader is an io.Reader that hands out len(p) bytes without writing them: the input side of the
// staging measurement, so that only the staging is timed.
type bwReader struct{}

func (bwReader) Read(p []byte) (int, error) { return len(p), nil }

// measureStaging moves Staging bytes from the device to a discarding writer and from a non-copying
// reader to the device through a pinned.Stager, median of three, against the raw host-alloc
// copies at the largest size.
func measureStaging(o *BandwidthOptions, d *vmm.Device, res *BandwidthResult) (st *BandwidthStaging, err error) {
	size := o.Staging
	dev, err := d.AllocPlain(size)
	if err != nil {
		return nil, fmt.Errorf("staging: %w", err)
	}
	defer func() { err = errors.Join(err, dev.Close()) }()
	if err := d.Memset(dev.Ptr(), 0x33, size); err != nil {
		return nil, err
	}
	stager, err := pinned.NewStager(d, pinned.StagerOptions{Buffers: o.StagingBuffers, BufferSize: o.StagingChunk, SpinWait: o.StagingSpin})
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, stager.Close()) }()
	st = &BandwidthStaging{SizeBytes: size, ChunkBytes: stager.ChunkSize(), Buffers: o.StagingBuffers, SpinWait: o.StagingSpin}
	bar := beginSteps(o.Progress, "staging", 6)
	defer bar.Done()
	ctx := context.Background()
	var runs uint64
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
			gbs = append(gbs, float64(size)/max(time.Since(t0), time.Nanosecond).Seconds()/1e9)
			runs++
			bar.Update(runs)
		}
		return median(gbs), nil
	}
	if st.D2HGBs, err = best(func() (int64, error) { return stager.DeviceToWriter(ctx, io.Discard, dev.Ptr(), size) }); err != nil {
		return nil, fmt.Errorf("staging device to writer: %w", err)
	}
	if st.H2DGBs, err = best(func() (int64, error) { return stager.ReaderToDevice(ctx, dev.Ptr(), bwReader{}, size) }); err != nil {
		return nil, fmt.Errorf("staging reader to device: %w", err)
	}
	st.baseline(res.Rows)
	return st, nil
}

// baseline takes the raw host-alloc copies at the largest size as the staging's baseline.
func (st *BandwidthStaging) baseline(rows []BandwidthRow) {
	for _, r := range rows {
		if r.Kind == HostAlloc && r.SizeBytes >= st.BaselineLen {
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
}

// progressFunc is the pinned package's progress callback.
type progressFunc = func(done, total uint64)
