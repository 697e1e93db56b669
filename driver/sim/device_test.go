package sim

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
)

func TestInitRequired(t *testing.T) {
	s := New()
	defer s.Close()
	v, err := s.DriverGetVersion() // works before cuInit, as in the driver
	require.NoError(t, err)
	require.Equal(t, 13000, v)
	_, err = s.DeviceGetCount()
	require.ErrorIs(t, err, driver.ErrorNotInitialized)
	require.ErrorIs(t, err, driver.ErrNotInitialized)
	_, err = s.DevicePrimaryCtxRetain(0)
	require.ErrorIs(t, err, driver.ErrorNotInitialized)
	require.ErrorIs(t, s.Init(1), driver.ErrorInvalidValue)
	require.NoError(t, s.Init(0))
	n, err := s.DeviceGetCount()
	require.NoError(t, err)
	require.Equal(t, 1, n)

	require.NoError(t, s.Close())
	_, err = s.DeviceGetCount()
	require.ErrorIs(t, err, driver.ErrorDeinitialized)
	require.NoError(t, s.Close(), "Close is idempotent")

	s2 := New(DriverVersion(12080), Devices(0))
	defer s2.Close()
	require.NoError(t, s2.Init(0))
	v, _ = s2.DriverGetVersion()
	require.Equal(t, 12080, v)
	n, _ = s2.DeviceGetCount()
	require.Equal(t, 0, n)
}

func TestDevices(t *testing.T) {
	s := start(t, Devices(4), MemoryPerDevice(80*gib))
	n, err := s.DeviceGetCount()
	require.NoError(t, err)
	require.Equal(t, 4, n)

	uuids := map[[16]byte]bool{}
	buses := map[int]bool{}
	for i := range n {
		dev, err := s.DeviceGet(i)
		require.NoError(t, err)
		require.Equal(t, driver.Device(i), dev)
		name, err := s.DeviceGetName(dev)
		require.NoError(t, err)
		require.Contains(t, name, "H200")
		require.Contains(t, name, "sim")
		total, err := s.DeviceTotalMem(dev)
		require.NoError(t, err)
		require.Equal(t, 80*gib, total)
		u, err := s.DeviceGetUUID(dev)
		require.NoError(t, err)
		uuids[u] = true
		bus, err := s.DeviceGetAttribute(driver.AttrPCIBusID, dev)
		require.NoError(t, err)
		buses[bus] = true
	}
	require.Len(t, uuids, 4, "UUIDs are distinct")
	require.Len(t, buses, 4, "PCI bus ids are distinct")

	_, err = s.DeviceGet(4)
	require.ErrorIs(t, err, driver.ErrorInvalidDevice)
	_, err = s.DeviceGet(-1)
	require.ErrorIs(t, err, driver.ErrorInvalidDevice)
	_, err = s.DeviceGetName(4)
	require.ErrorIs(t, err, driver.ErrorInvalidDevice)
	_, err = s.DeviceGetAttribute(driver.AttrMultiprocessorCount, 7)
	require.ErrorIs(t, err, driver.ErrorInvalidDevice)
	_, err = s.DeviceTotalMem(4)
	require.ErrorIs(t, err, driver.ErrorInvalidDevice)
	_, err = s.DeviceGetUUID(4)
	require.ErrorIs(t, err, driver.ErrorInvalidDevice)
	_, err = s.DevicePrimaryCtxRetain(4)
	require.ErrorIs(t, err, driver.ErrorInvalidDevice)
	_, err = s.DeviceCanAccessPeer(0, 4)
	require.ErrorIs(t, err, driver.ErrorInvalidDevice)

	// The same ordinal has the same UUID in another simulator (another process): same machine.
	s2 := start(t, Devices(1))
	u0, _ := s.DeviceGetUUID(0)
	u0b, _ := s2.DeviceGetUUID(0)
	require.Equal(t, u0, u0b)
}

func TestAttributes(t *testing.T) {
	s := start(t, Devices(2), Attribute(1, driver.AttrHandleTypeFabricSupported, 0), Attribute(0, 9999, 42))
	want := map[driver.DeviceAttribute]int{
		driver.AttrVirtualMemoryManagementSupported:         1,
		driver.AttrHandleTypePosixFDSupported:               1,
		driver.AttrGPUDirectRDMAWithCUDAVMMSupported:        1,
		driver.AttrDMABufSupported:                          1,
		driver.AttrGenericCompressionSupported:              1,
		driver.AttrHandleTypeFabricSupported:                1,
		driver.AttrHostNUMAID:                               0,
		driver.AttrNUMAID:                                   -1,
		driver.AttrNUMAConfig:                               0,
		driver.AttrHostNUMAVirtualMemoryManagementSupported: 1,
		driver.AttrHostVirtualMemoryManagementSupported:     1,
		driver.AttrCanUseHostPointerForRegisteredMem:        1,
		driver.AttrHostRegisterSupported:                    1,
		driver.AttrReadOnlyHostRegisterSupported:            1,
		driver.AttrUnifiedAddressing:                        1,
		driver.AttrComputeCapabilityMajor:                   9,
		driver.AttrComputeCapabilityMinor:                   0,
		driver.AttrMultiprocessorCount:                      132,
	}
	for attr, v := range want {
		got, err := s.DeviceGetAttribute(attr, 0)
		require.NoError(t, err)
		require.Equal(t, v, got, "attribute %d", attr)
	}
	got, err := s.DeviceGetAttribute(driver.AttrHandleTypeFabricSupported, 1)
	require.NoError(t, err)
	require.Equal(t, 0, got, "overridden")
	got, err = s.DeviceGetAttribute(9999, 0)
	require.NoError(t, err)
	require.Equal(t, 42, got, "added")
	_, err = s.DeviceGetAttribute(9999, 1)
	require.ErrorIs(t, err, driver.ErrorInvalidValue)

	require.Panics(t, func() { New(Attribute(3, 1, 1)) })
	require.Panics(t, func() { New(Granularity(3 << 20)) })
}

func TestPeerMatrix(t *testing.T) {
	s := start(t, Devices(3), PeerAccess(0, 2, false))
	for a := range 3 {
		for b := range 3 {
			ok, err := s.DeviceCanAccessPeer(driver.Device(a), driver.Device(b))
			require.NoError(t, err)
			want := a != b && !(a == 0 && b == 2) && !(a == 2 && b == 0)
			require.Equal(t, want, ok, "%d -> %d", a, b)
		}
	}
}

func TestContexts(t *testing.T) {
	s := start(t, Devices(2))
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	// No context bound on this thread: every "needs a context" call is refused.
	_, err := s.MemCreate(2*mib, deviceProp(0, 0), 0)
	require.ErrorIs(t, err, driver.ErrorInvalidContext)
	require.ErrorIs(t, err, driver.ErrInvalidContext)
	_, _, err = s.MemGetInfo()
	require.ErrorIs(t, err, driver.ErrorInvalidContext)
	require.ErrorIs(t, s.CtxSynchronize(), driver.ErrorInvalidContext)

	c0, err := s.DevicePrimaryCtxRetain(0)
	require.NoError(t, err)
	c0b, err := s.DevicePrimaryCtxRetain(0)
	require.NoError(t, err)
	require.Equal(t, c0, c0b, "the primary context is one context")
	c1, err := s.DevicePrimaryCtxRetain(1)
	require.NoError(t, err)
	require.NotEqual(t, c0, c1)
	require.Equal(t, 2, s.Live().Contexts)

	require.ErrorIs(t, s.CtxSetCurrent(12345), driver.ErrorInvalidContext)
	require.NoError(t, s.CtxSetCurrent(c1))
	cur, err := s.CtxGetCurrent()
	require.NoError(t, err)
	require.Equal(t, c1, cur)
	require.NoError(t, s.CtxSynchronize())

	// The current device is the current context's: a legacy allocation lands on device 1.
	free1, _, err := s.MemGetInfo()
	require.NoError(t, err)
	p, err := s.MemAlloc(4 * mib)
	require.NoError(t, err)
	free1b, _, _ := s.MemGetInfo()
	require.Equal(t, 4*mib, free1-free1b)
	require.NoError(t, s.MemFree(p))

	// Released to zero: the thread's binding is dead.
	require.NoError(t, s.DevicePrimaryCtxRelease(1))
	require.ErrorIs(t, s.DevicePrimaryCtxRelease(1), driver.ErrorInvalidContext)
	require.ErrorIs(t, s.CtxSynchronize(), driver.ErrorInvalidContext)
	require.ErrorIs(t, s.CtxSetCurrent(c1), driver.ErrorInvalidContext)

	require.NoError(t, s.CtxSetCurrent(c0))
	require.NoError(t, s.DevicePrimaryCtxRelease(0))
	require.NoError(t, s.CtxSynchronize(), "one reference left")
	require.NoError(t, s.DevicePrimaryCtxRelease(0))
	require.ErrorIs(t, s.CtxSynchronize(), driver.ErrorInvalidContext)
	require.NoError(t, s.CtxSetCurrent(0))
	cur, err = s.CtxGetCurrent()
	require.NoError(t, err)
	require.Zero(t, cur)
}

// TestContextPerThread: the binding belongs to the OS thread, so a goroutine on another thread has no
// context even while this one has.
func TestContextPerThread(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	_, _, err := s.MemGetInfo()
	require.NoError(t, err)

	errc := make(chan error)
	go func() {
		// This thread is locked by the test goroutine, so this goroutine runs on another one.
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		_, err := s.MemCreate(2*mib, deviceProp(0, 0), 0)
		errc <- err
	}()
	require.ErrorIs(t, <-errc, driver.ErrorInvalidContext)
}

func TestReleaseDestroysContextObjects(t *testing.T) {
	s := start(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	ctx, err := s.DevicePrimaryCtxRetain(0)
	require.NoError(t, err)
	require.NoError(t, s.CtxSetCurrent(ctx))
	_, err = s.StreamCreate(0)
	require.NoError(t, err)
	_, err = s.EventCreate(0)
	require.NoError(t, err)
	_, err = s.ModuleLoadData([]byte(".version 9.0\n.target sm_90\n"))
	require.NoError(t, err)
	l := s.Live()
	require.Equal(t, 1, l.Streams)
	require.Equal(t, 1, l.Events)
	require.Equal(t, 1, l.Modules)
	require.NoError(t, s.DevicePrimaryCtxRelease(0))
	require.NoError(t, s.CtxSetCurrent(0))
	require.True(t, s.Live().Zero(), s.Live().String())
}

// Attributes newer than the driver version are unknown to the simulator, as to such a driver.
func TestAttributesNewerThanTheDriverAreUnknown(t *testing.T) {
	for v, want := range map[int][2]bool{12080: {false, false}, 12090: {true, false}, 13000: {true, true}} {
		s := New(DriverVersion(v))
		require.NoError(t, s.Init(0))
		for i, attr := range []driver.DeviceAttribute{driver.AttrHostNUMAVirtualMemoryManagementSupported, driver.AttrHostVirtualMemoryManagementSupported} {
			_, err := s.DeviceGetAttribute(attr, 0)
			if want[i] {
				require.NoError(t, err, "attribute %d on %d", attr, v)
			} else {
				require.ErrorIs(t, err, driver.ErrorInvalidValue, "attribute %d on %d", attr, v)
			}
		}
		require.NoError(t, s.Close())
	}
}
