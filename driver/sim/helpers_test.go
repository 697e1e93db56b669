package sim

import (
	"os"
	"runtime"
	"runtime/debug"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
)

const (
	mib = uint64(1) << 20
	gib = uint64(1) << 30
)

// start makes an initialized simulator. When the test ends (after the cleanups registered later, such
// as bind's), it checks that nothing is left alive unless the test failed, then closes the simulator.
func start(t *testing.T, opts ...Option) *Sim {
	t.Helper()
	s := New(opts...)
	require.NoError(t, s.Init(0))
	t.Cleanup(func() {
		if !t.Failed() {
			require.True(t, s.Live().Zero(), "leaked: %v", s.Live())
		}
		require.NoError(t, s.Close())
	})
	return s
}

// bind locks the test goroutine to its OS thread and makes dev's primary context current there, as
// the project's callers must; the test's end unbinds, releases and unlocks.
func bind(t *testing.T, s *Sim, dev driver.Device) driver.Context {
	t.Helper()
	runtime.LockOSThread()
	ctx, err := s.DevicePrimaryCtxRetain(dev)
	require.NoError(t, err)
	require.NoError(t, s.CtxSetCurrent(ctx))
	t.Cleanup(func() {
		_ = s.CtxSetCurrent(0)
		_ = s.DevicePrimaryCtxRelease(dev)
		runtime.UnlockOSThread()
	})
	return ctx
}

func deviceProp(dev int, types driver.HandleType) *driver.AllocationProp {
	return &driver.AllocationProp{
		Type:                 driver.AllocationTypePinned,
		RequestedHandleTypes: types,
		Location:             driver.DeviceLocation(driver.Device(dev)),
	}
}

func hostNUMAProp(types driver.HandleType) *driver.AllocationProp {
	return &driver.AllocationProp{
		Type:                 driver.AllocationTypePinned,
		RequestedHandleTypes: types,
		Location:             driver.HostNUMALocation(0),
	}
}

// chunk is one mapped allocation of a test buffer.
type chunk struct {
	h    driver.MemHandle
	va   driver.DevicePtr
	size uint64
}

// buffer is a reservation with chunks mapped in it.
type buffer struct {
	base   driver.DevicePtr
	size   uint64
	chunks []chunk
}

// makeBuffer reserves n chunks of size bytes with prop, maps them back to back and grants access.
func makeBuffer(t *testing.T, s *Sim, prop *driver.AllocationProp, n int, size uint64, access ...driver.AccessDesc) *buffer {
	t.Helper()
	total := uint64(n) * size
	base, err := s.MemAddressReserve(total, 0, 0, 0)
	require.NoError(t, err)
	b := &buffer{base: base, size: total}
	for i := range n {
		h, err := s.MemCreate(size, prop, 0)
		require.NoError(t, err)
		va := base + driver.DevicePtr(uint64(i)*size)
		require.NoError(t, s.MemMap(va, size, 0, h, 0))
		b.chunks = append(b.chunks, chunk{h, va, size})
	}
	if len(access) > 0 {
		require.NoError(t, s.MemSetAccess(base, total, access))
	}
	return b
}

// free undoes makeBuffer: unmap, release, address free.
func (b *buffer) free(t *testing.T, s *Sim) {
	t.Helper()
	require.NoError(t, s.MemUnmap(b.base, b.size))
	for _, c := range b.chunks {
		require.NoError(t, s.MemRelease(c.h))
	}
	require.NoError(t, s.MemAddressFree(b.base, b.size))
}

func rw(dev int) driver.AccessDesc {
	return driver.AccessDesc{Location: driver.DeviceLocation(driver.Device(dev)), Flags: driver.AccessReadWrite}
}

func ro(dev int) driver.AccessDesc {
	return driver.AccessDesc{Location: driver.DeviceLocation(driver.Device(dev)), Flags: driver.AccessRead}
}

func hostAccess(f driver.AccessFlags) driver.AccessDesc {
	return driver.AccessDesc{Location: driver.HostLocation(), Flags: f}
}

// pattern is n bytes that differ per seed and position.
func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7) ^ seed
	}
	return b
}

func ptr(b []byte) unsafe.Pointer { return unsafe.Pointer(&b[0]) }

// at is the host pointer for a simulated virtual address (host-NUMA memory the CPU was granted).
func at(va driver.DevicePtr) unsafe.Pointer { return addrPtr(uintptr(va)) }

// faults reports whether reading the byte at va faults.
func faults(va driver.DevicePtr) (faulted bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if recover() != nil {
			faulted = true
		}
	}()
	sinkByte = *(*byte)(at(va))
	return false
}

var sinkByte byte

// openFDs counts this process's open descriptors, for FD leak checks.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}
