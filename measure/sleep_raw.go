package measure

import (
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// sleepPiece is the size of the raw copies: the slot size offload copies in.
func (r *sleepRun) sleepPiece() uint64 { return min(r.opts.SlotSize, r.opts.Size) }

// rawHostLimit bounds the pinned memory each device's raw copies cycle through.
const rawHostLimit = 2 << 30

// rawHostSize is the raw copies' host memory on each device: the buffer, up to rawHostLimit, in
// whole pieces, and at least one piece (a piece larger than the limit is used whole).
func rawHostSize(size, piece uint64) uint64 {
	h := min(size, rawHostLimit)
	return max(h-h%piece, piece)
}

// rawHost is pinned memory made the way offload makes its slots (registered THP), up to 2 GiB, that
// the raw copies cycle through.
type rawHost struct {
	mem    []byte
	region *pinned.Region
}

func newRawHost(d *vmm.Device, size uint64) (*rawHost, error) {
	mem, err := pinned.MapAnonymous(size)
	if err != nil {
		return nil, err
	}
	reg, err := pinned.Register(d, mem, pinned.RegisterOptions{HugePages: true})
	if err != nil {
		return nil, errors.Join(err, pinned.Unmap(mem))
	}
	return &rawHost{mem: mem, region: reg}, nil
}

func (h *rawHost) close() error { return errors.Join(h.region.Close(), pinned.Unmap(h.mem)) }

// measureRaw copies every buffer out and back in pieces, every device at once: all devices pin,
// then all copy out (D2H) together, then all copy in (H2D) together. The aggregate rates are over
// each phase's window, from its common start to the last device's finish; the per-device rates
// are over each device's own copy time.
func (r *sleepRun) measureRaw() (err error) {
	piece, n := r.sleepPiece(), len(r.devs)
	hostSize := rawHostSize(r.opts.Size, piece)
	hosts := make([]*rawHost, n)
	pin, repin, d2h, h2d := make([]float64, n), make([]float64, n), make([]float64, n), make([]float64, n)
	defer func() {
		for _, h := range hosts {
			if h != nil {
				err = errors.Join(err, h.close())
			}
		}
	}()
	copies := func(toHost bool, out []float64) func(int) error {
		return func(i int) (err error) {
			out[i], err = sleepRawCopy(r.devs[i], r.ptrs[i], r.opts.Size, piece, hosts[i].mem, toHost)
			return err
		}
	}
	win, err := inStep(n, func(i int) (err error) {
		pin[i], repin[i], hosts[i], err = pinTwice(r.devs[i], hostSize)
		return err
	}, copies(true, d2h), copies(false, h2d))
	if err != nil {
		return err
	}
	for i := range r.devs {
		r.res.PerDevice[i].RawD2HGBps = sleepGBps(r.opts.Size, d2h[i])
		r.res.PerDevice[i].RawH2DGBps = sleepGBps(r.opts.Size, h2d[i])
	}
	r.res.RawD2HGBps, r.res.RawH2DGBps = sleepGBps(r.res.TotalBytes, win[1]), sleepGBps(r.res.TotalBytes, win[2])
	r.res.RawPinGBps = sleepGBps(hostSize*uint64(n), slices.Max(pin))
	r.res.RawRepinGBps = sleepGBps(hostSize*uint64(n), slices.Max(repin))
	return nil
}

// inStep runs each step for i in [0, n), each i on a goroutine of its own, step after step: no i
// starts step k+1 before every i finished step k (a barrier between the steps). It returns each
// step's window, from its common start to the last finish; the first failing step ends it.
func inStep(n int, steps ...func(i int) error) ([]float64, error) {
	windows := make([]float64, len(steps))
	for k, step := range steps {
		errs := make([]error, n)
		var wg sync.WaitGroup
		start := time.Now()
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = step(i)
			}()
		}
		wg.Wait()
		windows[k] = time.Since(start).Seconds()
		if err := errors.Join(errs...); err != nil {
			return nil, err
		}
	}
	return windows, nil
}

// pinTwice times pinning size bytes of fresh memory, gives it back, and times pinning as much again
// (memory the process has had); it returns the second region.
func pinTwice(d *vmm.Device, size uint64) (pin, repin float64, h *rawHost, err error) {
	start := time.Now()
	if h, err = newRawHost(d, size); err != nil {
		return 0, 0, nil, err
	}
	pin = time.Since(start).Seconds()
	if err = h.close(); err != nil {
		return 0, 0, nil, err
	}
	start = time.Now()
	if h, err = newRawHost(d, size); err != nil {
		return 0, 0, nil, err
	}
	return pin, time.Since(start).Seconds(), h, nil
}

// sleepRawCopy times cuMemcpyDtoH (toHost) or cuMemcpyHtoD of size bytes at ptr in pieces, cycling
// through host.
func sleepRawCopy(d *vmm.Device, ptr driver.DevicePtr, size, piece uint64, host []byte, toHost bool) (float64, error) {
	start := time.Now()
	for off := uint64(0); off < size; off += piece {
		n := min(piece, size-off)
		h := host[off%uint64(len(host)):][:n]
		var err error
		if toHost {
			err = d.CopyDtoH(h, ptr+driver.DevicePtr(off))
		} else {
			err = d.CopyHtoD(ptr+driver.DevicePtr(off), h)
		}
		if err != nil {
			return 0, err
		}
	}
	return time.Since(start).Seconds(), nil
}
