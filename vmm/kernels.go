package vmm

import (
	"encoding/binary"
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/kernels"
	"github.com/cuvmm/cuvmm/internal/units"
)

// kernelSet is the project's kernel module loaded into one device's primary context, with a small
// device buffer for the verify kernel's mismatch counter.
type kernelSet struct {
	module             driver.Module
	fill, verify, read driver.Function
	counter            driver.DevicePtr // 8 bytes from cuMemAlloc, freed with the set
	blocks             uint32           // grid size for grid-stride kernels
}

const kernelThreads = 256

// loadKernels loads internal/kernels' PTX on first use. The caller holds d.kernMu.
func (d *Device) loadKernels() (*kernelSet, error) {
	if d.kernels != nil {
		return d.kernels, nil
	}
	mp, err := d.Attribute(driver.AttrMultiprocessorCount)
	if err != nil || mp <= 0 {
		mp = 1
	}
	ks := &kernelSet{blocks: uint32(mp) * 8}
	err = d.do(func(api driver.API) error {
		var err error
		if ks.module, err = api.ModuleLoadData(kernels.PTX); err != nil {
			return fmt.Errorf("cuModuleLoadData: %w", err)
		}
		for name, f := range map[string]*driver.Function{kernels.Fill: &ks.fill, kernels.Verify: &ks.verify, kernels.Read: &ks.read} {
			if *f, err = api.ModuleGetFunction(ks.module, name); err != nil {
				_ = api.ModuleUnload(ks.module)
				return fmt.Errorf("cuModuleGetFunction(%s): %w", name, err)
			}
		}
		if ks.counter, err = api.MemAlloc(8); err != nil {
			_ = api.ModuleUnload(ks.module)
			return fmt.Errorf("cuMemAlloc for the mismatch counter: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("vmm: device %d: load kernels: %w", d.ordinal, err)
	}
	d.kernels = ks
	return ks, nil
}

func (ks *kernelSet) grid(n uint64) driver.Dim3 {
	b := (n + kernelThreads - 1) / kernelThreads
	b = min(max(b, 1), uint64(ks.blocks))
	return driver.Dim3{X: uint32(b), Y: 1, Z: 1}
}

var block = driver.Dim3{X: kernelThreads, Y: 1, Z: 1}

func checkPattern(op string, ptr driver.DevicePtr, size, patternOffset uint64) error {
	if size == 0 || size%kernels.WordSize != 0 || uint64(ptr)%kernels.WordSize != 0 || patternOffset%kernels.WordSize != 0 {
		return fmt.Errorf("vmm: %s %s at %#x (pattern offset %#x): address, size and offset must be non-zero multiples of 8: %w", op, units.FormatSize(size), uint64(ptr), patternOffset, ErrInvalidValue)
	}
	return nil
}

// Fill writes the project's test pattern (internal/kernels.Pattern) over [ptr, ptr+size) with a
// kernel on this device and waits. patternOffset is the byte offset the range has in the pattern
// (so a buffer filled in pieces holds one continuous pattern); seed varies the pattern.
func (d *Device) Fill(ptr driver.DevicePtr, size, patternOffset, seed uint64) error {
	if err := checkPattern("fill", ptr, size, patternOffset); err != nil {
		return err
	}
	d.kernMu.Lock()
	defer d.kernMu.Unlock()
	ks, err := d.loadKernels()
	if err != nil {
		return err
	}
	n := size / kernels.WordSize
	err = d.do(func(api driver.API) error {
		if err := api.LaunchKernel(ks.fill, ks.grid(n), block, 0, 0, uint64(ptr), n, patternOffset/kernels.WordSize, seed); err != nil {
			return err
		}
		return api.CtxSynchronize()
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
	d.kernMu.Lock()
	defer d.kernMu.Unlock()
	ks, err := d.loadKernels()
	if err != nil {
		return 0, err
	}
	n := size / kernels.WordSize
	var out [8]byte
	err = d.do(func(api driver.API) error {
		if err := api.MemsetD8(ks.counter, 0, 8); err != nil {
			return err
		}
		if err := api.LaunchKernel(ks.verify, ks.grid(n), block, 0, 0, uint64(ptr), n, patternOffset/kernels.WordSize, seed, uint64(ks.counter)); err != nil {
			return err
		}
		return api.MemcpyDtoH(ptrOf(out[:]), ks.counter, 8)
	})
	if err != nil {
		return 0, fmt.Errorf("vmm: device %d: verify %s at %#x: %w", d.ordinal, units.FormatSize(size), uint64(ptr), err)
	}
	return binary.LittleEndian.Uint64(out[:]), nil
}

// LaunchRead queues the read kernel over [ptr, ptr+size) on s (nil: the default stream): every
// byte is loaded once with 16-byte loads. Time it with events to measure read bandwidth. ptr must be
// 16-byte aligned and size a multiple of 16.
func (d *Device) LaunchRead(ptr driver.DevicePtr, size uint64, s *Stream) error {
	if size == 0 || size%16 != 0 || uint64(ptr)%16 != 0 {
		return fmt.Errorf("vmm: read %s at %#x: address and size must be non-zero multiples of 16: %w", units.FormatSize(size), uint64(ptr), ErrInvalidValue)
	}
	if err := s.use("read kernel"); err != nil {
		return err
	}
	d.kernMu.Lock()
	defer d.kernMu.Unlock()
	ks, err := d.loadKernels()
	if err != nil {
		return err
	}
	n := size / kernels.WordSize
	// One vector of 16 bytes per thread per iteration, four iterations unrolled.
	g := ks.grid(n / 8)
	err = d.do(func(api driver.API) error {
		return api.LaunchKernel(ks.read, g, block, 0, s.Handle(), uint64(ptr), n, uint64(ks.counter))
	})
	if err != nil {
		return fmt.Errorf("vmm: device %d: read %s at %#x: %w", d.ordinal, units.FormatSize(size), uint64(ptr), err)
	}
	return nil
}

// LoadKernels loads the project's kernels into the device now rather than on first use (so that
// timing and memory measurements do not include the load).
func (d *Device) LoadKernels() error {
	d.kernMu.Lock()
	defer d.kernMu.Unlock()
	_, err := d.loadKernels()
	return err
}
