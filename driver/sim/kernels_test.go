package sim

import (
	"encoding/binary"
	"errors"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/kernels"
)

var one = driver.Dim3{X: 1, Y: 1, Z: 1}

// loadKernels loads the project's PTX and returns fill, verify and read.
func loadKernels(t *testing.T, s *Sim) (driver.Module, driver.Function, driver.Function, driver.Function) {
	t.Helper()
	m, err := s.ModuleLoadData(kernels.PTX)
	require.NoError(t, err)
	var fs [3]driver.Function
	for i, name := range []string{kernels.Fill, kernels.Verify, kernels.Read} {
		fs[i], err = s.ModuleGetFunction(m, name)
		require.NoError(t, err, name)
	}
	return m, fs[0], fs[1], fs[2]
}

// counter reads the uint64 at p.
func counter(t *testing.T, s *Sim, p driver.DevicePtr) uint64 {
	t.Helper()
	var b [8]byte
	require.NoError(t, s.MemcpyDtoH(ptr(b[:]), p, 8))
	return binary.NativeEndian.Uint64(b[:])
}

func TestModules(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	for _, bad := range [][]byte{nil, {}, []byte("\x00"), []byte("garbage"), []byte("\x7fELF\x02\x01\x01")} {
		_, err := s.ModuleLoadData(bad)
		require.ErrorIs(t, err, driver.ErrorInvalidImage, "%q", bad)
	}
	m, fill, _, _ := loadKernels(t, s)
	again, err := s.ModuleGetFunction(m, kernels.Fill)
	require.NoError(t, err)
	require.Equal(t, fill, again)
	_, err = s.ModuleGetFunction(m, "no_such_kernel")
	require.ErrorIs(t, err, driver.ErrorNotFound)

	// In the image but without a Go implementation: NOT_FOUND.
	ptx := []byte(".version 9.0\n.target sm_90\n.address_size 64\n.visible .entry other(\n.param .u64 p\n)\n{\nret;\n}\n")
	m2, err := s.ModuleLoadData(ptx)
	require.NoError(t, err)
	_, err = s.ModuleGetFunction(m2, "other")
	require.ErrorIs(t, err, driver.ErrorNotFound)
	_, err = s.ModuleGetFunction(m2, kernels.Fill)
	require.ErrorIs(t, err, driver.ErrorNotFound, "not in this image")

	require.Equal(t, 2, s.Live().Modules)
	require.NoError(t, s.ModuleUnload(m2))
	require.NoError(t, s.ModuleUnload(m))
	require.ErrorIs(t, s.ModuleUnload(m), driver.ErrorInvalidHandle)
	_, err = s.ModuleGetFunction(m, kernels.Fill)
	require.ErrorIs(t, err, driver.ErrorInvalidHandle)
	require.ErrorIs(t, s.LaunchKernel(fill, one, one, 0, 0, 0, 0, 0, 0), driver.ErrorInvalidHandle, "unloaded")
}

// The kernel tests run eagerly, so that each launch's memory error is its own; deferred, the same
// errors come from the next synchronize (TestDeferredKernelFaultsAtSynchronize).
func TestKernels(t *testing.T) {
	s := start(t, Eager())
	bind(t, s, 0)
	m, fill, verify, read := loadKernels(t, s)
	b := makeBuffer(t, s, deviceProp(0, 0), 8, 2*mib, rw(0))
	cnt, err := s.MemAlloc(8)
	require.NoError(t, err)
	require.NoError(t, s.MemsetD8(cnt, 0, 8))
	grid, block := driver.Dim3{X: 132, Y: 1, Z: 1}, driver.Dim3{X: 256, Y: 1, Z: 1}
	words := b.size / 8
	base := uint64(b.base)

	require.NoError(t, s.LaunchKernel(fill, grid, block, 0, 0, base, words, 1000, 42))
	// The pattern is exactly kernels.Pattern of the global word index.
	var w [8]byte
	require.NoError(t, s.MemcpyDtoH(ptr(w[:]), b.base+8*77, 8))
	require.Equal(t, kernels.Pattern(1077, 42), binary.NativeEndian.Uint64(w[:]))

	require.NoError(t, s.LaunchKernel(verify, grid, block, 0, 0, base, words, 1000, 42, uint64(cnt)))
	require.Zero(t, counter(t, s, cnt))
	// Corrupt two words in different chunks; verify a sub-range with its own first word.
	require.NoError(t, s.MemsetD8(b.base+5, 0xab, 1))
	require.NoError(t, s.MemsetD8(b.base+driver.DevicePtr(5*mib), 0xab, 1))
	require.NoError(t, s.LaunchKernel(verify, grid, block, 0, 0, base, words, 1000, 42, uint64(cnt)))
	require.Equal(t, uint64(2), counter(t, s, cnt))
	require.NoError(t, s.LaunchKernel(verify, grid, block, 0, 0, base+8*10, 100, 1010, 42, uint64(cnt)))
	require.Equal(t, uint64(2), counter(t, s, cnt), "no mismatch in that range")
	require.NoError(t, s.LaunchKernel(read, grid, block, 0, 0, base, words, uint64(cnt)))

	// Argument count and launch shape.
	require.ErrorIs(t, s.LaunchKernel(fill, grid, block, 0, 0, base, words, 0), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.LaunchKernel(fill, driver.Dim3{}, block, 0, 0, base, words, 0, 0), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.LaunchKernel(fill, grid, driver.Dim3{X: 2048, Y: 1, Z: 1}, 0, 0, base, words, 0, 0), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.LaunchKernel(fill, grid, block, 0, 0xbad0, base, words, 0, 0), driver.ErrorInvalidHandle)
	// Dynamic shared memory beyond MAX_SHARED_MEMORY_PER_BLOCK (48 KiB) needs an opt-in
	// (cuFuncSetAttribute) that driver.API does not have.
	require.ErrorIs(t, s.LaunchKernel(fill, grid, block, 48<<10+1, 0, base, words, 0, 0), driver.ErrorInvalidValue)
	require.NoError(t, s.LaunchKernel(fill, grid, block, 48<<10, 0, base, words, 1000, 42))

	// Memory the device may not touch: ILLEGAL_ADDRESS, and the simulator stays usable.
	require.ErrorIs(t, s.LaunchKernel(fill, grid, block, 0, 0, base+b.size-8, 2, 0, 0), driver.ErrorIllegalAddress, "past the end")
	require.NoError(t, s.MemSetAccess(b.chunks[7].va, 2*mib, []driver.AccessDesc{ro(0)}))
	require.ErrorIs(t, s.LaunchKernel(fill, grid, block, 0, 0, base, words, 0, 0), driver.ErrorIllegalAddress, "read-only chunk")
	require.NoError(t, s.LaunchKernel(verify, grid, block, 0, 0, base, words, 1000, 42, uint64(cnt)), "reading it is fine")
	require.ErrorIs(t, s.LaunchKernel(fill, grid, block, 0, 0, base+4, 1, 0, 0), driver.ErrorIllegalAddress, "misaligned")
	pageable := make([]uint64, 4)
	require.ErrorIs(t, s.LaunchKernel(fill, grid, block, 0, 0, uint64(uintptr(unsafe.Pointer(ptr8(pageable)))), 4, 0, 0), driver.ErrorIllegalAddress,
		"pageable host memory")
	require.NoError(t, s.CtxSynchronize())

	// Kernels reach cuMemHostAlloc memory by its address.
	hp, err := s.MemHostAlloc(4096, 0)
	require.NoError(t, err)
	require.NoError(t, s.LaunchKernel(fill, grid, block, 0, 0, uint64(uintptr(hp)), 512, 0, 7))
	require.Equal(t, kernels.Pattern(3, 7), *(*uint64)(addrPtr(uintptr(hp) + 24)))
	require.NoError(t, s.MemFreeHost(hp))

	require.NoError(t, s.MemFree(cnt))
	require.NoError(t, s.ModuleUnload(m))
	b.free(t, s)
}

func ptr8(w []uint64) *uint64 { return &w[0] }

func TestKernelOnPeer(t *testing.T) {
	s := start(t, Devices(2), Eager())
	c1, err := s.DevicePrimaryCtxRetain(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.DevicePrimaryCtxRelease(1)) }()
	c0 := bind(t, s, 0)
	m0, fill0, _, _ := loadKernels(t, s)
	b := makeBuffer(t, s, deviceProp(0, 0), 2, 2*mib, rw(0), ro(1))
	require.NoError(t, s.LaunchKernel(fill0, one, one, 0, 0, uint64(b.base), b.size/8, 0, 1))

	require.NoError(t, s.CtxSetCurrent(c1))
	require.ErrorIs(t, s.LaunchKernel(fill0, one, one, 0, 0, uint64(b.base), 1, 0, 1), driver.ErrorInvalidContext,
		"a function of device 0's module")
	m1, fill1, verify1, read1 := loadKernels(t, s)
	cnt, err := s.MemAlloc(8) // on device 1
	require.NoError(t, err)
	require.NoError(t, s.MemsetD8(cnt, 0, 8))
	require.NoError(t, s.LaunchKernel(verify1, one, one, 0, 0, uint64(b.base), b.size/8, 0, 1, uint64(cnt)), "peer read")
	require.Zero(t, counter(t, s, cnt))
	require.NoError(t, s.LaunchKernel(read1, one, one, 0, 0, uint64(b.base), b.size/8, uint64(cnt)))
	require.ErrorIs(t, s.LaunchKernel(fill1, one, one, 0, 0, uint64(b.base), 1, 0, 1), driver.ErrorIllegalAddress, "peer write to READ")
	require.NoError(t, s.MemFree(cnt))
	require.NoError(t, s.ModuleUnload(m1))

	require.NoError(t, s.CtxSetCurrent(c0))
	require.NoError(t, s.ModuleUnload(m0))
	b.free(t, s)
}

func TestCustomKernel(t *testing.T) {
	var seen *KernelCall
	double := func(k *KernelCall) error {
		seen = k
		ws, err := k.Words(k.Arg(0), k.Arg(1), true)
		if err != nil {
			return err
		}
		for _, w := range ws {
			for i := range w {
				w[i] *= 2
			}
		}
		if k.Arg(1) > 1000 {
			return errors.New("too big")
		}
		return nil
	}
	s := start(t, Kernel("double", double), Eager())
	bind(t, s, 0)
	m, err := s.ModuleLoadData([]byte(".version 9.0\n.target sm_90\n.visible .entry double(.param .u64 p, .param .u64 n)\n{ ret; }\n"))
	require.NoError(t, err)
	f, err := s.ModuleGetFunction(m, "double")
	require.NoError(t, err)
	b := makeBuffer(t, s, deviceProp(0, 0), 1, 2*mib, rw(0))
	require.NoError(t, s.MemsetD32(b.base, 21, 4))
	require.NoError(t, s.LaunchKernel(f, driver.Dim3{X: 2, Y: 1, Z: 1}, one, 0, 0, uint64(b.base), 2))
	require.Equal(t, uint64(42)|uint64(42)<<32, counter(t, s, b.base))
	require.Equal(t, "double", seen.Name)
	require.Equal(t, driver.Device(0), seen.Device)
	require.Equal(t, uint32(2), seen.Grid.X)
	_, err = seen.Memory(uint64(b.base), 8, false)
	require.ErrorIs(t, err, driver.ErrorIllegalAddress, "a KernelCall is dead after its launch")
	require.ErrorIs(t, s.LaunchKernel(f, one, one, 0, 0, uint64(b.base), 2000), driver.ErrorLaunchFailed)
	require.ErrorIs(t, s.LaunchKernel(f, one, one, 0, 0, uint64(b.base)), driver.ErrorInvalidValue, "one argument short")
	require.NoError(t, s.ModuleUnload(m))
	b.free(t, s)
}

// TestFillSpeed keeps the built-in kernels fast enough for tests and the demo that fill hundreds of
// MiB in the simulator.
func TestFillSpeed(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	m, fill, verify, _ := loadKernels(t, s)
	b := makeBuffer(t, s, deviceProp(0, 0), 16, 16*mib, rw(0))
	cnt, err := s.MemAlloc(8)
	require.NoError(t, err)
	require.NoError(t, s.MemsetD8(cnt, 0, 8))
	t0 := time.Now()
	require.NoError(t, s.LaunchKernel(fill, one, one, 0, 0, uint64(b.base), b.size/8, 0, 3))
	require.NoError(t, s.LaunchKernel(verify, one, one, 0, 0, uint64(b.base), b.size/8, 0, 3, uint64(cnt)))
	el := time.Since(t0)
	require.Zero(t, counter(t, s, cnt))
	t.Logf("fill+verify 256 MiB: %v", el)
	require.Less(t, el, 10*time.Second)
	require.NoError(t, s.MemFree(cnt))
	require.NoError(t, s.ModuleUnload(m))
	b.free(t, s)
}
