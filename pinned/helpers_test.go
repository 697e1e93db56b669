package pinned_test

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/pattern"
	"github.com/cuvmm/cuvmm/vmm"
)

const (
	kib = 1 << 10
	mib = 1 << 20
)

// words views b (8-byte aligned, length a multiple of 8) as 64-bit words.
func words(b []byte) []uint64 {
	return unsafe.Slice((*uint64)(unsafe.Pointer(&b[0])), len(b)/8)
}

// fillCPU writes the kernels' pattern into b as if b sat at byte offset off of a patterned range.
func fillCPU(b []byte, off, seed uint64) { pattern.FillHost(b, off, seed) }

// badWords counts the words of b that differ from the pattern at offset off.
func badWords(b []byte, off, seed uint64) int { return int(pattern.CountHost(b, off, seed)) }

// deviceBuffer maps size bytes of device memory for d.
func deviceBuffer(t testing.TB, d *vmm.Device, size uint64) (driver.DevicePtr, func()) {
	t.Helper()
	r, err := d.System().Reserve(size, vmm.ReserveOptions{})
	require.NoError(t, err)
	m, err := r.MapNew(0, r.Size(), d, vmm.AllocOptions{}, vmm.ReadWrite(d))
	require.NoError(t, err)
	return m.Ptr(), func() {
		require.NoError(t, m.Close())
		require.NoError(t, r.Close())
	}
}

// freeMemory reads every device's free memory.
func freeMemory(t testing.TB, sys *vmm.System) []uint64 {
	t.Helper()
	devs, err := sys.Devices()
	require.NoError(t, err)
	out := make([]uint64, len(devs))
	for i, d := range devs {
		require.NoError(t, d.Synchronize())
		out[i], _, err = d.MemInfo()
		require.NoError(t, err)
	}
	return out
}

// used is how much less free memory each device has in after than in before.
func used(before, after []uint64) []int64 {
	out := make([]int64, len(before))
	for i := range before {
		out[i] = int64(before[i]) - int64(after[i])
	}
	return out
}

func driverPtr(n uint64) driver.DevicePtr { return driver.DevicePtr(n) }
