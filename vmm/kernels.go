package vmm

import (
	"errors"
	"fmt"
	"sync"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/pattern"
	"github.com/cuvmm/cuvmm/internal/units"
)

// kernelSet is the project's kernel module loaded into one device's primary context, with a small
// device buffer of counterSlots words: the read kernel's sink (word 0) and the lanes' counters.
type kernelSet struct {
	*pattern.Kernels
	words driver.DevicePtr // counterSlots*8 bytes from cuMemAlloc, freed with the set
}

// counterSlots is the number of 8-byte words in kernelSet.words; lanes past it allocate their own.
const counterSlots = 64

func (ks *kernelSet) sink() driver.DevicePtr { return ks.words }

// Unload frees the words and unloads the module.
func (ks *kernelSet) Unload(api driver.API) error {
	return errors.Join(api.MemFree(ks.words), ks.Kernels.Unload(api))
}

// lanePool keeps the lanes (a stream and a counter each) of finished pattern checks for the next
// ones, so that checks on one device run concurrently without a stream or allocation per call.
type lanePool struct {
	mu    sync.Mutex
	idle  []*pattern.Lane
	slots int                // counter words of the kernel set handed out (word 0 is the sink)
	words []driver.DevicePtr // counter words of freed lanes, for the next new lane
}

func (p *lanePool) get(api driver.API, ks *kernelSet) (*pattern.Lane, error) {
	p.mu.Lock()
	if n := len(p.idle); n > 0 {
		l := p.idle[n-1]
		p.idle = p.idle[:n-1]
		p.mu.Unlock()
		return l, nil
	}
	var counter driver.DevicePtr
	if n := len(p.words); n > 0 {
		counter, p.words = p.words[n-1], p.words[:n-1]
	} else if p.slots+1 < counterSlots {
		p.slots++
		counter = ks.words + driver.DevicePtr(8*p.slots)
	}
	p.mu.Unlock()
	l, err := pattern.NewLane(api, counter)
	if err != nil && counter != 0 {
		p.mu.Lock()
		p.words = append(p.words, counter) // for the next lane
		p.mu.Unlock()
	}
	return l, err
}

// maxIdleLanes is how many finished lanes a device keeps: enough for the usual one or two checks at
// a time without a new stream each, few enough that a burst of concurrent checks does not keep its
// streams (and the device memory the driver gives them) until the device is released.
const maxIdleLanes = 2

// put keeps l for the next check, or frees it (with the context bound by the caller) when enough
// lanes are kept already. A lane whose free fails is dropped: its stream dies with the context.
func (p *lanePool) put(api driver.API, l *pattern.Lane) error {
	p.mu.Lock()
	if len(p.idle) < maxIdleLanes {
		p.idle = append(p.idle, l)
		p.mu.Unlock()
		return nil
	}
	if !l.OwnsCounter() {
		p.words = append(p.words, l.Counter)
	}
	p.mu.Unlock()
	return l.Free(api)
}

// free frees every idle lane (the device is being released: none is in use).
func (p *lanePool) free(api driver.API) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for _, l := range p.idle {
		errs = append(errs, l.Free(api))
	}
	p.idle = nil
	p.slots = 0
	p.words = nil
	return errors.Join(errs...)
}

// loadKernels loads internal/kernels' PTX on first use; only loading is serialized.
func (d *Device) loadKernels() (*kernelSet, error) {
	if ks := d.kernels.Load(); ks != nil {
		return ks, nil
	}
	d.kernMu.Lock()
	defer d.kernMu.Unlock()
	if ks := d.kernels.Load(); ks != nil {
		return ks, nil
	}
	mp, err := d.Attribute(driver.AttrMultiprocessorCount)
	if err != nil || mp <= 0 {
		mp = 1
	}
	var ks *kernelSet
	err = d.do(func(api driver.API) error {
		k, err := pattern.Load(api, mp)
		if err != nil {
			return err
		}
		words, err := api.MemAlloc(8 * counterSlots)
		if err != nil {
			return errors.Join(fmt.Errorf("cuMemAlloc for the counters: %w", err), k.Unload(api))
		}
		ks = &kernelSet{Kernels: k, words: words}
		d.kernels.Store(ks) // inside the gate: System.Close sees it
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("vmm: device %d: load kernels: %w", d.ordinal, err)
	}
	return ks, nil
}

func checkPattern(op string, ptr driver.DevicePtr, size, patternOffset uint64) error {
	if why := pattern.Check(ptr, size, patternOffset); why != "" {
		return fmt.Errorf("vmm: %s %s at %#x (pattern offset %#x): %s: %w", op, units.FormatSize(size), uint64(ptr), patternOffset, why, ErrInvalidValue)
	}
	return nil
}

// withLane runs fn with the kernels and a lane of their own, with the context bound. No lock is held
// while fn launches and waits, so pattern checks on one device run concurrently.
func (d *Device) withLane(fn func(api driver.API, ks *kernelSet, l *pattern.Lane) error) error {
	ks, err := d.loadKernels()
	if err != nil {
		return err
	}
	return d.do(func(api driver.API) error {
		l, err := d.lanes.get(api, ks)
		if err != nil {
			return err
		}
		err = fn(api, ks, l)
		if perr := d.lanes.put(api, l); perr != nil {
			err = errors.Join(err, fmt.Errorf("free a spare pattern lane: %w", perr))
		}
		return err
	})
}

// Fill writes the project's test pattern (internal/pattern) over [ptr, ptr+size) with a kernel on
// this device and waits. patternOffset is the byte offset the range has in the pattern (so a buffer
// filled in pieces holds one continuous pattern); seed varies the pattern. The kernel runs on a
// stream of its own (which waits for work queued on the legacy default stream), so concurrent
// Fill and Verify calls on one device do not wait for each other.
func (d *Device) Fill(ptr driver.DevicePtr, size, patternOffset, seed uint64) error {
	if err := checkPattern("fill", ptr, size, patternOffset); err != nil {
		return err
	}
	err := d.withLane(func(api driver.API, ks *kernelSet, l *pattern.Lane) error {
		return ks.Fill(api, l, ptr, size/pattern.WordSize, patternOffset/pattern.WordSize, seed)
	})
	if err != nil {
		return fmt.Errorf("vmm: device %d: fill %s at %#x: %w", d.ordinal, units.FormatSize(size), uint64(ptr), err)
	}
	return nil
}

// Verify counts the 8-byte words of [ptr, ptr+size) that differ from the pattern Fill writes with
// the same patternOffset and seed, using a kernel on this device. Zero means the content is intact.
func (d *Device) Verify(ptr driver.DevicePtr, size, patternOffset, seed uint64) (mismatches uint64, err error) {
	if err := checkPattern("verify", ptr, size, patternOffset); err != nil {
		return 0, err
	}
	err = d.withLane(func(api driver.API, ks *kernelSet, l *pattern.Lane) error {
		var err error
		mismatches, err = ks.Verify(api, l, ptr, size/pattern.WordSize, patternOffset/pattern.WordSize, seed)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("vmm: device %d: verify %s at %#x: %w", d.ordinal, units.FormatSize(size), uint64(ptr), err)
	}
	return mismatches, nil
}

// LaunchRead queues the read kernel over [ptr, ptr+size) on s (nil: the default stream): every
// byte is loaded once with 16-byte loads. Time it with events to measure read bandwidth. ptr must be
// 16-byte aligned and size a multiple of 16.
func (d *Device) LaunchRead(ptr driver.DevicePtr, size uint64, s *Stream) error {
	if size == 0 || size%16 != 0 || uint64(ptr)%16 != 0 {
		return fmt.Errorf("vmm: read %s at %#x: address and size must be non-zero multiples of 16: %w", units.FormatSize(size), uint64(ptr), ErrInvalidValue)
	}
	end, err := s.begin("read kernel")
	if err != nil {
		return err
	}
	defer end()
	ks, err := d.loadKernels()
	if err != nil {
		return err
	}
	err = d.do(func(api driver.API) error {
		return ks.Read(api, s.Handle(), ptr, size/pattern.WordSize, ks.sink())
	})
	if err != nil {
		return fmt.Errorf("vmm: device %d: read %s at %#x: %w", d.ordinal, units.FormatSize(size), uint64(ptr), err)
	}
	return nil
}

// LoadKernels loads the project's kernels into the device now rather than on first use (so that
// timing and memory measurements do not include the load).
func (d *Device) LoadKernels() error {
	_, err := d.loadKernels()
	return err
}
