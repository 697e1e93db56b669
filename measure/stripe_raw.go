package measure

import (
	"errors"
	"fmt"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/stripe"
	"github.com/cuvmm/cuvmm/vmm"
)

// settlePause is how long the timed builds wait after the devices are idle: the driver finishes
// freeing the previous range in the background, and a build that starts at once pays for it (on the
// H200 host an 8 GiB build in 128 MiB stripes takes about 11 ms right after a free, 7 ms after a
// pause, whether raw or not). The simulator has nothing to wait for.
const settlePause = 50 * time.Millisecond

// settle waits until the devices are idle, then pause.
func settle(devs []*vmm.Device, pause time.Duration) error {
	for _, d := range devs {
		if err := d.Synchronize(); err != nil {
			return err
		}
	}
	time.Sleep(pause)
	return nil
}

// span is an address range to read.
type span struct {
	ptr  driver.DevicePtr
	size uint64
}

// readStreams is how many streams the read kernels are spread over. One kernel per segment on one
// stream loses a few microseconds per launch to the ramp-up and tail of each kernel (measured on the
// H200: 128 MiB segments read at 0.91x a single buffer, 32 MiB at 0.70x); kernels on several streams
// overlap those gaps (1.01x for both).
const readStreams = 4

// reader times the read kernel on one device. The kernels go to readStreams blocking streams and the
// timing events to the legacy default stream, which waits for the blocking streams' earlier work and
// makes their later work wait for it: the events bracket every kernel of a pass. So the streams must
// stay blocking: the legacy stream does not wait for non-blocking ones, and the end event would pass
// kernels still queued.
type reader struct {
	d          *vmm.Device
	streams    []*vmm.Stream
	start, end *vmm.Event
}

func newReader(d *vmm.Device) (rd *reader, err error) {
	rd = &reader{d: d}
	for i := 0; i < readStreams && err == nil; i++ {
		var s *vmm.Stream
		if s, err = d.NewStream(false); err == nil {
			rd.streams = append(rd.streams, s)
		}
	}
	if err == nil {
		if rd.start, err = d.NewEvent(true); err == nil {
			rd.end, err = d.NewEvent(true)
		}
	}
	if err != nil {
		return nil, errors.Join(err, rd.close())
	}
	return rd, nil
}

func (rd *reader) close() error {
	errs := []error{rd.end.Close(), rd.start.Close()}
	for _, s := range rd.streams {
		errs = append(errs, s.Close())
	}
	return errors.Join(errs...)
}

// bandwidth reads every span once per pass (one kernel launch per span, round-robin over the streams)
// and returns the best pass's rate in GB/s (1e9 bytes per second), after one untimed pass. No spans,
// or a pass too short for the events to see, gives 0.
func (rd *reader) bandwidth(spans []span, passes int) (float64, error) {
	var bytes uint64
	for _, s := range spans {
		bytes += s.size
	}
	if bytes == 0 {
		return 0, nil
	}
	pass := func() (time.Duration, error) {
		if err := rd.start.Record(nil); err != nil {
			return 0, err
		}
		for i, s := range spans {
			if err := rd.d.LaunchRead(s.ptr, s.size, rd.streams[i%len(rd.streams)]); err != nil {
				return 0, err
			}
		}
		if err := rd.end.Record(nil); err != nil {
			return 0, err
		}
		if err := rd.end.Synchronize(); err != nil {
			return 0, err
		}
		return rd.end.Elapsed(rd.start)
	}
	if _, err := pass(); err != nil { // untimed: first-touch and cache effects
		return 0, err
	}
	var best time.Duration
	for i := 0; i < passes; i++ {
		dt, err := pass()
		if err != nil {
			return 0, err
		}
		if dt > 0 && (best == 0 || dt < best) {
			best = dt
		}
	}
	if best <= 0 {
		return 0, nil
	}
	return float64(bytes) / best.Seconds() / 1e9, nil
}

// rawPiece is one stripe of the raw baseline: where, how big, on which device, with which access.
type rawPiece struct {
	off, size uint64
	loc       driver.Location
	access    []driver.AccessDesc
}

// rawPlan copies the built range's shape (the same stripes on the same devices with the same access)
// for the raw baseline.
func rawPlan(r *stripe.Range, holders, accessOnly []*vmm.Device, readOnly bool) []rawPiece {
	all := append(append([]*vmm.Device(nil), holders...), accessOnly...)
	var out []rawPiece
	for _, c := range r.Chunks() {
		owner := c.Allocation.Device()
		p := rawPiece{off: c.Offset, size: c.Allocation.Size(), loc: owner.Location()}
		for _, d := range all {
			f := driver.AccessReadWrite
			if readOnly && d != owner {
				f = driver.AccessRead
			}
			p.access = append(p.access, driver.AccessDesc{Location: d.Location(), Flags: f})
		}
		out = append(out, p)
	}
	return out
}

// rawRange is the baseline: the range built with raw driver calls in one context binding, the
// sequence of the driver's multi-device sample.
type rawRange struct {
	dev     *vmm.Device
	ptr     driver.DevicePtr
	size    uint64
	handles []driver.MemHandle
	mapped  uint64 // bytes mapped from ptr
}

// buildRaw reserves size bytes, then for every stripe creates its memory, maps it and sets access,
// and reports the time those calls took. On failure it frees what it made.
func buildRaw(d *vmm.Device, size uint64, plan []rawPiece) (*rawRange, time.Duration, error) {
	rr := &rawRange{dev: d, size: size}
	var dt time.Duration
	err := d.Raw(func(api driver.API) error {
		t0 := time.Now()
		ptr, err := api.MemAddressReserve(size, 0, 0, 0)
		if err != nil {
			return fmt.Errorf("cuMemAddressReserve %s: %w", units.FormatSize(size), err)
		}
		rr.ptr = ptr
		for _, p := range plan {
			prop := driver.AllocationProp{Type: driver.AllocationTypePinned, Location: p.loc}
			h, err := api.MemCreate(p.size, &prop, 0)
			if err != nil {
				return fmt.Errorf("cuMemCreate %s at %s: %w", units.FormatSize(p.size), p.loc, err)
			}
			rr.handles = append(rr.handles, h)
			if err := api.MemMap(ptr+driver.DevicePtr(p.off), p.size, 0, h, 0); err != nil {
				return fmt.Errorf("cuMemMap at offset %#x: %w", p.off, err)
			}
			rr.mapped = p.off + p.size
			if err := api.MemSetAccess(ptr+driver.DevicePtr(p.off), p.size, p.access); err != nil {
				return fmt.Errorf("cuMemSetAccess at offset %#x: %w", p.off, err)
			}
		}
		dt = time.Since(t0)
		return nil
	})
	if err != nil {
		return nil, 0, errors.Join(err, rr.free())
	}
	return rr, dt, nil
}

// free unmaps the raw range in one call, releases every allocation and frees the addresses.
func (rr *rawRange) free() error {
	if rr == nil || rr.ptr == 0 {
		return nil
	}
	err := rr.dev.Raw(func(api driver.API) error {
		var errs []error
		if rr.mapped > 0 {
			if err := api.MemUnmap(rr.ptr, rr.mapped); err != nil {
				return fmt.Errorf("cuMemUnmap: %w", err) // releasing or freeing now would fail too
			}
			rr.mapped = 0
		}
		for len(rr.handles) > 0 {
			h := rr.handles[len(rr.handles)-1]
			if err := api.MemRelease(h); err != nil {
				errs = append(errs, fmt.Errorf("cuMemRelease: %w", err))
			}
			rr.handles = rr.handles[:len(rr.handles)-1]
		}
		if err := api.MemAddressFree(rr.ptr, rr.size); err != nil {
			return errors.Join(append(errs, fmt.Errorf("cuMemAddressFree: %w", err))...)
		}
		rr.ptr = 0
		return errors.Join(errs...)
	})
	if err != nil {
		return fmt.Errorf("free the raw baseline range: %w", err)
	}
	return nil
}
