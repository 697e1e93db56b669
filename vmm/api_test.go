package vmm_test

import (
	"errors"
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/pattern"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/vmm"
)

func TestFeatureCheck(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		require.NoError(t, d.Check(vmm.FeatureVMM))
		require.NoError(t, d.Check(vmm.FeaturePosixFDHandles))
		require.NoError(t, d.Check(vmm.FeatureVMM), "cached")
		err := d.Check(vmm.Feature(99))
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.Equal(t, "feature(99)", vmm.Feature(99).String())
	})
}

func TestFeatureUnsupported(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		err := d.Check(vmm.FeatureHostNUMA)
		require.ErrorIs(t, err, driver.ErrNotSupported)
		var u *vmm.UnsupportedError
		require.ErrorAs(t, err, &u)
		require.Equal(t, vmm.FeatureHostNUMA, u.Feature)
		require.Equal(t, 12020, u.MinVersion)
		require.Contains(t, err.Error(), "host-NUMA VMM allocations not supported (needs CUDA 12.2 or later): attribute 141 is 0")
		require.False(t, d.Supports(driver.AttrHostNUMAVirtualMemoryManagementSupported))
	}, testutil.SimOnly(), testutil.SimOptions(sim.Attribute(0, driver.AttrHostNUMAVirtualMemoryManagementSupported, 0)))
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		err := b.Device(t, 0).Check(vmm.FeatureDMABuf)
		require.ErrorIs(t, err, driver.ErrNotSupported, "the driver is too old")
		require.ErrorContains(t, err, "dma-buf export not supported (needs CUDA 11.7 or later): the driver is version 11000")
	}, testutil.SimOnly(), testutil.SimOptions(sim.DriverVersion(11000)))
}

// A failed attribute query is an error, never "unsupported", and is asked again next time.
func TestFeatureQueryFails(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		b.Sim.FailNth("cuDeviceGetAttribute", 1, driver.ErrorUnknown)
		err := d.Check(vmm.FeatureHostNUMA)
		require.Error(t, err)
		require.NotErrorIs(t, err, driver.ErrNotSupported)
		require.NoError(t, d.Check(vmm.FeatureHostNUMA), "not cached")
		node, err := d.HostNUMANode()
		require.NoError(t, err)
		require.Equal(t, 0, node)

		b.Sim.FailNth("cuDeviceGetAttribute", 2, driver.ErrorUnknown) // the NUMA node query
		require.NoError(t, d.Check(vmm.FeatureHostNUMA), "cached after success")
	}, testutil.SimOnly())
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		err := d.Check(vmm.FeatureHostNUMA)
		require.ErrorIs(t, err, driver.ErrNotSupported)
		require.ErrorContains(t, err, "no host NUMA node")
		b.Sim.FailNth("cuDeviceGetAttribute", 1, driver.ErrorUnknown)
		d2 := b.Device(t, 1)
		b.Sim.FailNth("cuDeviceGetAttribute", 2, driver.ErrorUnknown)
		err = d2.Check(vmm.FeatureHostNUMA)
		require.Error(t, err)
		require.NotErrorIs(t, err, driver.ErrNotSupported)
	}, testutil.SimOnly(), testutil.Devices(2), testutil.SimOptions(sim.Attribute(0, driver.AttrHostNUMAID, -1)))
}

func TestRoundUpAndGranularity(t *testing.T) {
	_, err := vmm.RoundUp("x", 0, 2)
	require.ErrorIs(t, err, vmm.ErrInvalidValue)
	require.ErrorContains(t, err, "x: size 0")
	_, err = vmm.RoundUp("x", 1, 0)
	require.ErrorIs(t, err, vmm.ErrInvalidValue)
	_, err = vmm.RoundUp("x", ^uint64(0), 2*mib)
	require.ErrorContains(t, err, "overflows")
	r, err := vmm.RoundUp("x", 3*mib, 2*mib)
	require.NoError(t, err)
	require.Equal(t, uint64(4*mib), r)

	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		devs, err := b.Sys.Devices()
		require.NoError(t, err)
		g, err := b.Sys.CommonGranularity(driver.Location{}, devs...)
		require.NoError(t, err)
		sg, err := b.Sys.Granularity()
		require.NoError(t, err)
		require.Zero(t, g%sg)
		for _, d := range devs {
			dg, err := d.DeviceGranularity()
			require.NoError(t, err)
			require.Zero(t, g%dg, "a multiple of every device's granularity")
		}
		_, err = b.Sys.CommonGranularity(driver.Location{})
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		_, err = b.Sys.CommonGranularity(driver.Location{}, nil)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
	})
}

func TestMapChunks(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		a, err := d.Allocate(2*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		specs := []vmm.ChunkSpec{
			{Offset: 0, Size: 2 * mib, Device: d, Access: []vmm.Access{vmm.ReadWrite(d)}},
			{Offset: 2 * mib, Allocation: a, Own: true, Access: []vmm.Access{vmm.ReadWrite(d)}},
		}
		r, maps, err := b.Sys.ReserveChunks(4*mib, vmm.ReserveOptions{}, specs)
		require.NoError(t, err)
		require.Len(t, maps, 2)
		require.Same(t, a, maps[1].Allocation())
		require.True(t, maps[1].OwnsAllocation())
		require.Same(t, r, maps[1].Reservation())
		require.Equal(t, uint64(2*mib), maps[1].Offset())
		require.Equal(t, uint64(2*mib), r.Granularity())
		require.NoError(t, d.Fill(r.Ptr(), 4*mib, 0, 3))
		bad, err := d.Verify(r.Ptr(), 4*mib, 0, 3)
		require.NoError(t, err)
		require.Zero(t, bad)
		require.NoError(t, r.UnmapRange(0, 4*mib))
		require.NoError(t, a.Close(), "released with its mapping: Close is a no-op")
		require.NoError(t, r.Close())

		_, err = vmm.MapChunks([]vmm.ChunkSpec{{Offset: 0}})
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.NoError(t, vmm.UndoClose(nil))
	})
}

func TestMapChunksRollsBack(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		a, err := d.Allocate(2*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		specs := []vmm.ChunkSpec{
			{Offset: 0, Size: 2 * mib, Device: d, Access: []vmm.Access{vmm.ReadWrite(d)}},
			{Offset: 2 * mib, Size: 2 * mib, Device: d, Access: []vmm.Access{vmm.ReadWrite(d)}},
			{Offset: 4 * mib, Allocation: a, Own: true},
		}
		b.Sim.FailNth("cuMemCreate", 2, driver.ErrorOutOfMemory)
		_, _, err = b.Sys.ReserveChunks(6*mib, vmm.ReserveOptions{}, specs)
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.ErrorContains(t, err, "chunk 1 of 3 (offset 0x200000)")
		require.Equal(t, sim.Live{Contexts: 1}, b.Sim.Live(), "the Own allocation was released too")

		// A reservation that fails releases the Own allocations as well.
		a, err = d.Allocate(2*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		b.Sim.FailNth("cuMemAddressReserve", 1, driver.ErrorOutOfMemory)
		_, _, err = b.Sys.ReserveChunks(2*mib, vmm.ReserveOptions{}, []vmm.ChunkSpec{{Allocation: a, Own: true}})
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.Equal(t, sim.Live{Contexts: 1}, b.Sim.Live())

		// A clean-up that fails leaves the object with the System, which frees it when asked.
		b.Sim.FailNth("cuMemSetAccess", 1, driver.ErrorOutOfMemory)
		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown)
		b.Sim.FailNth("cuMemUnmap", 2, driver.ErrorUnknown)
		_, _, err = b.Sys.ReserveChunks(2*mib, vmm.ReserveOptions{}, specs[:1])
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.ErrorContains(t, err, "kept by the System")
		require.NotEmpty(t, b.Sys.Orphans())
		require.NoError(t, b.Sys.RetryOrphans())
		require.Empty(t, b.Sys.Orphans())
		require.Equal(t, sim.Live{Contexts: 1}, b.Sim.Live())
	}, testutil.SimOnly())
}

// An orphan left by a failed undo is freed by System.Close, and System.Close lists what a caller
// still holds.
func TestSystemCloseRetriesAndLists(t *testing.T) {
	s, sys, d := ownSim(t)
	r, err := sys.Reserve(2*mib, vmm.ReserveOptions{})
	require.NoError(t, err)
	s.FailNth("cuMemMap", 1, driver.ErrorOutOfMemory)
	s.FailNth("cuMemRelease", 1, driver.ErrorUnknown)
	_, err = r.MapNew(0, 2*mib, d, vmm.AllocOptions{})
	require.ErrorIs(t, err, driver.ErrOutOfMemory)
	require.Len(t, sys.Orphans(), 1)
	err = sys.Close()
	require.ErrorIs(t, err, vmm.ErrInUse)
	require.ErrorContains(t, err, "device 0: 1 reservation(s)")
	require.Empty(t, sys.Orphans(), "the orphan was freed by the first Close")
	require.NoError(t, r.Close())
	require.NoError(t, sys.Close())
	require.NoError(t, sys.Close())
	require.True(t, s.Live().Zero(), s.Live().String())
	_, err = sys.Device(0)
	require.ErrorIs(t, err, vmm.ErrClosed)
	require.ErrorIs(t, d.Synchronize(), vmm.ErrClosed)
}

// System.Close and allocations racing: either Close refuses (the allocation counted) or the
// allocation fails (the system closed); never both succeed.
func TestSystemCloseRacesAllocations(t *testing.T) {
	for i := 0; i < 50; i++ {
		s := sim.New()
		sys, err := vmm.Open(s)
		require.NoError(t, err)
		d, err := sys.Device(0)
		require.NoError(t, err)
		var wg sync.WaitGroup
		var a *vmm.Allocation
		var allocErr, closeErr error
		wg.Add(2)
		go func() { defer wg.Done(); a, allocErr = d.Allocate(2*mib, vmm.AllocOptions{}) }()
		go func() { defer wg.Done(); closeErr = sys.Close() }()
		wg.Wait()
		if allocErr == nil {
			require.ErrorIs(t, closeErr, vmm.ErrInUse, "an allocation made while the system closed")
			require.NoError(t, a.Close())
			require.NoError(t, sys.Close())
		} else {
			require.ErrorIs(t, allocErr, vmm.ErrClosed)
			require.NoError(t, closeErr)
		}
		require.True(t, s.Live().Zero(), s.Live().String())
		require.NoError(t, s.Close())
	}
}

// Pattern checks on one device run concurrently and each sees its own result.
func TestConcurrentPatternChecks(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		require.NoError(t, d.LoadKernels())
		const n = 8
		r, err := b.Sys.Reserve(n*2*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, r.Close()) }()
		m, err := r.MapNew(0, n*2*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
		require.NoError(t, err)
		defer func() { require.NoError(t, m.Close()) }()
		var wg sync.WaitGroup
		errs := make([]error, n)
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ptr, off := m.Ptr()+driver.DevicePtr(i*2*mib), uint64(i*2*mib)
				if err := d.Fill(ptr, 2*mib, off, 5); err != nil {
					errs[i] = err
					return
				}
				bad, err := d.Verify(ptr, 2*mib, off, uint64(5+i%2))
				if err == nil && bad != uint64(i%2)*2*mib/8 {
					err = errors.New("wrong mismatch count")
				}
				errs[i] = err
			}()
		}
		wg.Wait()
		require.NoError(t, errors.Join(errs...))
		host := make([]byte, n*2*mib)
		require.NoError(t, d.CopyDtoH(host, m.Ptr()))
		require.Zero(t, pattern.CountHost(host, 0, 5), "the CPU reference agrees with the kernels")
		pattern.FillHost(host[:2*mib], 0, 6)
		require.NoError(t, d.CopyHtoD(m.Ptr(), host[:2*mib]))
		bad, err := d.Verify(m.Ptr(), 2*mib, 0, 6)
		require.NoError(t, err)
		require.Zero(t, bad, "the kernels agree with the CPU reference")
	})
}

func TestPlainHostAndRegistrations(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		require.Equal(t, 0, d.Ordinal())
		require.NotZero(t, d.Context())
		require.Equal(t, d.Handle(), driver.Device(0))
		require.NotEqual(t, [16]byte{}, d.UUID())
		require.Contains(t, d.String(), "device 0")
		require.NoError(t, d.Synchronize())
		require.NoError(t, d.Raw(func(api driver.API) error { return api.CtxSynchronize() }))

		p, err := d.AllocPlain(2 * mib)
		require.NoError(t, err)
		require.Equal(t, uint64(2*mib), p.Size())
		require.NotZero(t, p.Ptr())
		_, err = d.AllocPlain(0)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		h, err := d.HostAlloc(2*mib, driver.HostAllocPortable)
		require.NoError(t, err)
		require.Equal(t, uint64(2*mib), h.Size())
		_, err = d.HostAlloc(0, 0)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		s, err := d.CreateStream(vmm.StreamOptions{NonBlocking: true})
		require.NoError(t, err)
		require.Same(t, d, s.Device())
		require.NotZero(t, s.Handle())
		require.Zero(t, (*vmm.Stream)(nil).Handle())

		// Device to host memory and back through asynchronous copies.
		pattern.FillHost(h.Bytes(), 0, 9)
		require.NoError(t, d.CopyHtoDAsync(p.Ptr(), h.Pointer(), 2*mib, s))
		require.NoError(t, s.Synchronize())
		bad, err := d.Verify(p.Ptr(), 2*mib, 0, 9)
		require.NoError(t, err)
		require.Zero(t, bad)
		require.NoError(t, d.Memset(p.Ptr(), 0, 2*mib))
		require.NoError(t, d.CopyAsync(p.Ptr(), h.Ptr(), 2*mib, s))
		require.NoError(t, s.Synchronize())
		bad, err = d.Verify(p.Ptr(), 2*mib, 0, 9)
		require.NoError(t, err)
		require.Zero(t, bad)

		require.NoError(t, s.Close())
		require.ErrorIs(t, s.Synchronize(), vmm.ErrClosed)
		require.ErrorIs(t, d.CopyAsync(p.Ptr(), h.Ptr(), 8, s), vmm.ErrClosed)
		require.NoError(t, p.Close())
		require.NoError(t, p.Close())
		require.NoError(t, h.Close())
		require.NoError(t, (*vmm.PlainBuffer)(nil).Close())
		require.NoError(t, (*vmm.HostBuffer)(nil).Close())
		require.NoError(t, (*vmm.Stream)(nil).Close())
		require.NoError(t, (*vmm.Event)(nil).Close())
		require.NoError(t, (*vmm.HostRegistration)(nil).Close())

		// Memory other code registered is unregistered with HostUnregister.
		mem, err := unix.Mmap(-1, 0, 2*mib, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		defer unix.Munmap(mem)
		require.NoError(t, d.Raw(func(api driver.API) error {
			return api.MemHostRegister(unsafe.Pointer(&mem[0]), 2*mib, driver.HostRegisterPortable)
		}))
		require.NoError(t, d.HostUnregister(mem))
		require.Error(t, d.HostUnregister(mem), "no longer registered")
		require.ErrorIs(t, d.HostUnregister(nil), vmm.ErrInvalidValue)
	})
}

// HostRegister whose device-pointer lookup fails and whose undo fails too leaves the registration
// with the System.
func TestHostRegisterUndoFails(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		mem, err := unix.Mmap(-1, 0, 2*mib, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		defer unix.Munmap(mem)
		b.Sim.FailNth("cuMemHostGetDevicePointer", 1, driver.ErrorOutOfMemory)
		b.Sim.FailNth("cuMemHostUnregister", 1, driver.ErrorUnknown)
		_, err = d.HostRegister(mem, 0)
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.Len(t, b.Sys.Orphans(), 1)
		require.Equal(t, 1, b.Sim.Live().HostRegistrations)
		require.NoError(t, b.Sys.RetryOrphans())
		require.Zero(t, b.Sim.Live().HostRegistrations)
	}, testutil.SimOnly())
}

func TestTransferOwnership(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r1, m1 := mapFilled(t, d, 2*mib, 4)
		r2, err := b.Sys.Reserve(2*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		m2, err := r2.MapAccess(0, m1.Allocation(), vmm.ReadWrite(d))
		require.NoError(t, err)
		require.ErrorIs(t, vmm.TransferOwnership(m1, m2), vmm.ErrInvalidValue, "m2 does not own")
		require.ErrorIs(t, vmm.TransferOwnership(nil, m2), vmm.ErrInvalidValue)
		require.NoError(t, vmm.TransferOwnership(m1, m1))
		require.NoError(t, vmm.TransferOwnership(m2, m1))
		require.True(t, m2.OwnsAllocation())
		require.False(t, m1.OwnsAllocation())
		require.NoError(t, m1.Close())
		require.ErrorIs(t, vmm.TransferOwnership(m1, m2), vmm.ErrClosed)
		bad, err := d.Verify(m2.Ptr(), 2*mib, 0, 4)
		require.NoError(t, err)
		require.Zero(t, bad, "the bytes live on under the new mapping")
		require.NoError(t, m2.Close())
		require.NoError(t, r1.Close())
		require.NoError(t, r2.Close())
		flags, err := m2.Access(d.Location())
		require.ErrorIs(t, err, vmm.ErrClosed)
		require.Zero(t, flags)
		require.ErrorIs(t, m2.SetAccess(vmm.NoAccess(d)), vmm.ErrClosed)
	})
}

func TestAccessorsAndErrors(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		a, err := d.Allocate(2*mib, vmm.AllocOptions{HandleTypes: driver.HandleTypeFabric})
		require.NoError(t, err)
		require.Same(t, d, a.Device())
		require.Equal(t, driver.HandleTypeFabric, a.HandleTypes())
		require.Equal(t, d.Location(), a.Properties().Location)
		require.NotZero(t, a.Handle())
		_, err = a.ExportFabric()
		require.NoError(t, err)
		require.NoError(t, a.Close())
		_, err = a.ExportFabric()
		require.ErrorIs(t, err, vmm.ErrClosed)
		a, err = d.Allocate(2*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		_, err = a.ExportFabric()
		require.ErrorIs(t, err, vmm.ErrInvalidValue, "not created with the fabric type")
		require.NoError(t, a.Close())

		require.Equal(t, driver.AccessRead, vmm.HostReadOnly().Flags)
		_, err = d.CanAccessPeer(nil)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		ok, err := d.CanAccessPeer(d)
		require.NoError(t, err)
		require.True(t, ok)
		require.ErrorIs(t, d.Fill(1, 8, 0, 0), vmm.ErrInvalidValue, "unaligned")
		require.ErrorIs(t, d.LaunchRead(0, 8, nil), vmm.ErrInvalidValue)

		// Closed streams and events are refused by every call that uses them.
		s, err := d.CreateStream(vmm.StreamOptions{})
		require.NoError(t, err)
		e, err := d.NewEvent(false)
		require.NoError(t, err)
		require.NoError(t, e.Record(s))
		require.NoError(t, e.Synchronize())
		require.NoError(t, s.Close())
		require.ErrorIs(t, e.Record(s), vmm.ErrClosed)
		require.ErrorIs(t, d.LaunchRead(0, 16, s), vmm.ErrClosed)
		require.ErrorIs(t, d.CopyHtoDAsync(0, nil, 8, s), vmm.ErrClosed)
		require.ErrorIs(t, d.CopyDtoHAsync(nil, 0, 8, s), vmm.ErrClosed)
		require.NoError(t, e.Close())
		require.ErrorIs(t, e.Synchronize(), vmm.ErrClosed)
		require.ErrorIs(t, (*vmm.Event)(nil).Record(nil), vmm.ErrInvalidValue)
		require.NoError(t, d.CopyHtoD(0, nil), "nothing to copy")
		require.NoError(t, d.CopyDtoH(nil, 0))
	}, testutil.SimOnly(), testutil.SimOptions(sim.EnableFabric()))
}

// Keep hands the System an object of another package; RetryOrphans retries it until it succeeds.
func TestKeep(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		fails := 1
		err := b.Sys.Keep("test object", func() error {
			if fails > 0 {
				fails--
				return errors.New("still busy")
			}
			return nil
		})
		require.ErrorContains(t, err, "test object is kept by the System")
		require.Equal(t, []string{"test object"}, b.Sys.Orphans())
		require.Error(t, b.Sys.RetryOrphans())
		require.Len(t, b.Sys.Orphans(), 1)
		require.NoError(t, b.Sys.RetryOrphans(), "the second retry succeeds")
		require.Empty(t, b.Sys.Orphans())

		// A stream whose destruction fails in an undo goes to the System too.
		d := b.Device(t, 0)
		s, err := d.CreateStream(vmm.StreamOptions{})
		require.NoError(t, err)
		b.Sim.FailNth("cuStreamDestroy", 1, driver.ErrorUnknown)
		require.ErrorContains(t, vmm.UndoClose(s), "kept by the System")
		require.Len(t, b.Sys.Orphans(), 1)
		require.NoError(t, b.Sys.RetryOrphans())
		require.Empty(t, b.Sys.Orphans())
	}, testutil.SimOnly())
}

// A kept object whose clean-up still fails holds System.Close back (ErrInUse, naming it), so that it
// keeps a context to be retried with; once it succeeds, Close does.
func TestCloseWaitsForAFailingKeptObject(t *testing.T) {
	_, sys, _ := ownSim(t)
	busy := true
	_ = sys.Keep("host resource", func() error {
		if busy {
			return errors.New("still busy")
		}
		return nil
	})
	err := sys.Close()
	require.ErrorIs(t, err, vmm.ErrInUse)
	require.ErrorContains(t, err, "host resource")
	require.Equal(t, []string{"host resource"}, sys.Orphans())
	_, err = sys.Device(0)
	require.NoError(t, err, "the System stays open")
	busy = false
	require.NoError(t, sys.Close())
	require.Empty(t, sys.Orphans())
}

func TestOpenFails(t *testing.T) {
	_, err := vmm.Open(nil)
	require.ErrorIs(t, err, vmm.ErrInvalidValue)
	for _, fn := range []string{"cuInit", "cuDriverGetVersion", "cuDeviceGetCount"} {
		s := sim.New()
		s.FailNth(fn, 1, driver.ErrorUnknown)
		_, err := vmm.Open(s)
		require.ErrorContains(t, err, fn)
		require.NoError(t, s.Close())
	}
}

// A primary context whose release fails in System.Close is kept: a later Close retries releasing it
// rather than reporting success with the context still retained.
func TestSystemCloseRetriesContextRelease(t *testing.T) {
	s, sys, _ := ownSim(t, sim.Devices(2))
	_, err := sys.Devices()
	require.NoError(t, err)
	s.FailNth("cuDevicePrimaryCtxRelease", 2, driver.ErrorUnknown)
	err = sys.Close()
	require.ErrorIs(t, err, driver.ErrorUnknown)
	require.ErrorContains(t, err, "device 1")
	require.Equal(t, 1, s.Live().Contexts, "device 1's context is still retained")
	require.NoError(t, sys.Close(), "the retry releases it")
	require.True(t, s.Live().Zero(), s.Live().String())
	require.NoError(t, sys.Close())
	_, err = sys.Device(0)
	require.ErrorIs(t, err, vmm.ErrClosed)
}

// unmapWays are the two ways to unmap a mapping m that r holds at offset 0.
var unmapWays = map[string]func(r *vmm.Reservation, m *vmm.Mapping) error{
	"Mapping.Close":          func(_ *vmm.Reservation, m *vmm.Mapping) error { return m.Close() },
	"Reservation.UnmapRange": func(r *vmm.Reservation, m *vmm.Mapping) error { return r.UnmapRange(0, m.Size()) },
}

// An allocation mapped in a second range whose undo failed (the range, still mapping it, is kept by
// the System) is released by its owner's Close or UnmapRange without the owner knowing of that
// range: the release retries the System's ranges that still map the allocation first, and nothing
// is left.
func TestReleaseRetriesOrphanMappingIt(t *testing.T) {
	for name, unmap := range unmapWays {
		t.Run(name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				d := b.Device(t, 0)
				r, m := mapFilled(t, d, 2*mib, 4)
				orphanMapping(t, b, m.Allocation())

				require.NoError(t, unmap(r, m), "unmapped and released")
				require.True(t, m.Allocation().Closed())
				require.NoError(t, r.Close())
				require.Empty(t, b.Sys.Orphans())
			}, testutil.SimOnly())
		})
	}
}

// A mapping that does not own its allocation releases nothing when it goes, so its Close and
// UnmapRange leave the System's range that still maps the allocation alone; the allocation's own
// Close, which releases it, retries that range first, and nothing is left.
func TestNonOwningUnmapLeavesOrphanToAllocationClose(t *testing.T) {
	for name, unmap := range unmapWays {
		t.Run(name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				d := b.Device(t, 0)
				a, err := d.Allocate(2*mib, vmm.AllocOptions{})
				require.NoError(t, err)
				r, err := b.Sys.Reserve(2*mib, vmm.ReserveOptions{})
				require.NoError(t, err)
				m, err := r.MapAccess(0, a, vmm.ReadWrite(d))
				require.NoError(t, err)
				orphanMapping(t, b, a)

				frees := b.Sim.Calls("cuMemAddressFree")
				require.NoError(t, unmap(r, m))
				require.False(t, a.Closed(), "the mapping did not own it")
				require.Equal(t, frees, b.Sim.Calls("cuMemAddressFree"), "no range freed: nothing was to be released")
				require.NotEmpty(t, b.Sys.Orphans())

				require.NoError(t, a.Close(), "the release retries the range first")
				require.NoError(t, r.Close())
				require.Empty(t, b.Sys.Orphans())
			}, testutil.SimOnly())
		})
	}
}

// orphanMapping leaves a range kept by the System (an orphan) that maps a on device 0: a
// ReserveChunks of a and a new chunk whose creation fails, and whose undo's unmap fails twice.
func orphanMapping(t *testing.T, b *testutil.Backend, a *vmm.Allocation) {
	t.Helper()
	d := b.Device(t, 0)
	rw := []vmm.Access{vmm.ReadWrite(d)}
	specs := []vmm.ChunkSpec{
		{Offset: 0, Allocation: a, Access: rw},
		{Offset: 2 * mib, Size: 2 * mib, Device: d, Access: rw},
	}
	b.Sim.FailNth("cuMemCreate", 1, driver.ErrorOutOfMemory)
	b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown) // the undo's unmap
	b.Sim.FailNth("cuMemUnmap", 2, driver.ErrorUnknown) // its retry, as the range is freed
	_, _, err := b.Sys.ReserveChunks(4*mib, vmm.ReserveOptions{}, specs)
	require.ErrorIs(t, err, driver.ErrOutOfMemory)
	require.NotEmpty(t, b.Sys.Orphans(), "the second range still maps the allocation")
}

func TestCheckHandleTypes(t *testing.T) {
	require.NoError(t, vmm.CheckHandleTypes(driver.HandleTypeNone))
	require.NoError(t, vmm.CheckHandleTypes(driver.HandleTypePosixFD|driver.HandleTypeFabric))
	err := vmm.CheckHandleTypes(driver.HandleTypePosixFD | 0x40)
	require.ErrorIs(t, err, vmm.ErrInvalidValue)
	require.ErrorContains(t, err, "unknown bits 0x40")
}
