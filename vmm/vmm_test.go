package vmm_test

import (
	"errors"
	"os"
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

const mib = 1 << 20

func TestDeviceInfo(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		require.NotEmpty(t, d.Name())
		require.NotZero(t, d.TotalMemory())
		g, err := d.DeviceGranularity()
		require.NoError(t, err)
		require.Equal(t, uint64(2*mib), g)
		require.True(t, d.Supports(driver.AttrVirtualMemoryManagementSupported))
		require.True(t, d.Supports(driver.AttrHandleTypePosixFDSupported))
		free, total, err := d.MemInfo()
		require.NoError(t, err)
		require.NotZero(t, total)
		require.LessOrEqual(t, free, total)
		require.GreaterOrEqual(t, b.Sys.DriverVersion(), 10020)

		_, err = b.Sys.Device(b.Sys.DeviceCount())
		require.ErrorIs(t, err, vmm.ErrNoDevice)
		require.ErrorContains(t, err, "out of range")
		_, err = b.Sys.Device(-1)
		require.ErrorIs(t, err, vmm.ErrNoDevice)
	})
}

// ownSim opens a System over a simulator of the test's own (closed at the end of the test), for
// tests that close the System themselves, and opens device 0.
func ownSim(t *testing.T, opts ...sim.Option) (*sim.Sim, *vmm.System, *vmm.Device) {
	t.Helper()
	s := sim.New(opts...)
	t.Cleanup(func() { _ = s.Close() })
	sys, err := vmm.Open(s)
	require.NoError(t, err)
	d, err := sys.Device(0)
	require.NoError(t, err)
	return s, sys, d
}

// mapFilled reserves size bytes, maps one new allocation read-write for d and fills it.
func mapFilled(t *testing.T, d *vmm.Device, size, seed uint64) (*vmm.Reservation, *vmm.Mapping) {
	t.Helper()
	r, err := d.System().Reserve(size, vmm.ReserveOptions{})
	require.NoError(t, err)
	m, err := r.MapNew(0, size, d, vmm.AllocOptions{HandleTypes: driver.HandleTypePosixFD}, vmm.ReadWrite(d))
	require.NoError(t, err)
	require.NoError(t, d.Fill(m.Ptr(), size, 0, seed))
	return r, m
}

func TestReserveMapAccessVerify(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		a, err := d.Allocate(3*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		require.Equal(t, uint64(4*mib), a.Size(), "size rounds up to the 2 MiB granularity")
		r, err := b.Sys.Reserve(5*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		require.Equal(t, uint64(6*mib), r.Size())

		m, err := r.MapAccess(2*mib, a, vmm.ReadWrite(d))
		require.NoError(t, err)
		require.Equal(t, r.Ptr()+2*mib, m.Ptr())
		flags, err := m.Access(d.Location())
		require.NoError(t, err)
		require.Equal(t, driver.AccessReadWrite, flags)

		require.NoError(t, d.Fill(m.Ptr(), m.Size(), 0, 7))
		bad, err := d.Verify(m.Ptr(), m.Size(), 0, 7)
		require.NoError(t, err)
		require.Zero(t, bad)
		bad, err = d.Verify(m.Ptr(), m.Size(), 0, 8)
		require.NoError(t, err)
		require.Equal(t, m.Size()/8, bad, "a wrong seed must show every word as a mismatch")

		// Host copies see the same pattern.
		buf := make([]byte, 64)
		require.NoError(t, d.CopyDtoH(buf, m.Ptr()+1024))
		for i := 0; i < 8; i++ {
			w := *(*uint64)(unsafe.Pointer(&buf[i*8]))
			require.Equal(t, pattern.Word(uint64(1024/8+i), 7), w)
		}

		// Parents refuse to close under live children.
		require.ErrorIs(t, a.Close(), vmm.ErrInUse)
		require.ErrorIs(t, r.Close(), vmm.ErrInUse)
		require.ErrorIs(t, b.Sys.Close(), vmm.ErrInUse)

		require.NoError(t, m.Close())
		require.NoError(t, m.Close(), "double Close is fine")
		require.NoError(t, a.Close())
		require.NoError(t, a.Close())
		require.NoError(t, r.Close())
		require.NoError(t, r.Close())
		var nilAlloc *vmm.Allocation
		require.NoError(t, nilAlloc.Close())
	})
}

func TestBadInput(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		_, err := d.Allocate(0, vmm.AllocOptions{})
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.ErrorContains(t, err, "size 0")
		_, err = b.Sys.Reserve(0, vmm.ReserveOptions{})
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		_, err = d.Allocate(^uint64(0), vmm.AllocOptions{})
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.ErrorContains(t, err, "overflows")
		_, err = b.Sys.Reserve(4*mib, vmm.ReserveOptions{Alignment: 3 * mib})
		require.ErrorIs(t, err, vmm.ErrInvalidValue)

		r, err := b.Sys.Reserve(4*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, r.Close()) }()
		a, err := d.Allocate(2*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, a.Close()) }()

		_, err = r.Map(4096, a)
		require.ErrorIs(t, err, vmm.ErrInvalidValue, "offset not a multiple of the granularity")
		require.ErrorContains(t, err, "granularity")
		_, err = r.Map(4*mib, a)
		require.ErrorIs(t, err, vmm.ErrInvalidValue, "past the end")
		require.ErrorContains(t, err, "past the end")
		big, err := d.Allocate(6*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		_, err = r.Map(0, big)
		require.ErrorIs(t, err, vmm.ErrInvalidValue, "larger than the reservation")
		require.NoError(t, big.Close())

		m, err := r.Map(0, a)
		require.NoError(t, err)
		_, err = r.Map(0, a)
		require.ErrorIs(t, err, vmm.ErrInvalidValue, "mapping over a mapping")
		require.ErrorContains(t, err, "overlaps")
		require.ErrorIs(t, r.SetAccess(0, 4*mib, vmm.ReadWrite(d)), vmm.ErrInvalidValue, "access over an unmapped part")
		require.ErrorIs(t, r.SetAccess(0, 2*mib), vmm.ErrInvalidValue, "no descriptors")
		require.NoError(t, m.SetAccess(vmm.ReadWrite(d)))

		// Export of an allocation made without that handle type.
		_, err = a.Export(driver.HandleTypePosixFD)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.ErrorContains(t, err, "handle types")

		require.NoError(t, m.Close())
		require.ErrorIs(t, m.SetAccess(vmm.ReadWrite(d)), vmm.ErrClosed)

		// Use after Close.
		c, err := d.Allocate(2*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		require.NoError(t, c.Close())
		_, err = r.Map(2*mib, c)
		require.ErrorIs(t, err, vmm.ErrClosed)
		_, err = c.Export(driver.HandleTypePosixFD)
		require.ErrorIs(t, err, vmm.ErrClosed)
		r2, err := b.Sys.Reserve(2*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		require.NoError(t, r2.Close())
		_, err = r2.Map(0, a)
		require.ErrorIs(t, err, vmm.ErrClosed)
		s, err := d.NewStream(true)
		require.NoError(t, err)
		require.NoError(t, s.Close())
		require.ErrorIs(t, s.Synchronize(), vmm.ErrClosed)
		require.NoError(t, s.Close())
	})
}

func TestImportNotACUDAHandle(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		pr, pw, err := os.Pipe()
		require.NoError(t, err)
		defer pr.Close()
		defer pw.Close()
		_, err = d.Import(pr, 2*mib, driver.HandleTypePosixFD)
		require.Error(t, err)
		require.ErrorContains(t, err, "import")
		_, err = d.Import(nil, 2*mib, driver.HandleTypePosixFD)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
	})
}

func TestExportImportSameBytes(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, m := mapFilled(t, d, 4*mib, 42)
		f, err := m.Allocation().Export(driver.HandleTypePosixFD)
		require.NoError(t, err)
		imp, err := d.Import(f, m.Size(), driver.HandleTypePosixFD)
		require.NoError(t, err)
		require.NoError(t, f.Close(), "the import stays valid after the file is closed")
		require.True(t, imp.Imported())
		require.Equal(t, d.Location(), imp.Location())

		r2, err := b.Sys.Reserve(imp.Size(), vmm.ReserveOptions{})
		require.NoError(t, err)
		m2, err := r2.MapAccess(0, imp, vmm.ReadWrite(d))
		require.NoError(t, err)
		bad, err := d.Verify(m2.Ptr(), m2.Size(), 0, 42)
		require.NoError(t, err)
		require.Zero(t, bad, "the second mapping sees the same physical memory")

		// Release while mapped: closing the original mapping (which releases its allocation) keeps
		// the memory alive for the imported mapping.
		require.NoError(t, m.Close())
		bad, err = d.Verify(m2.Ptr(), m2.Size(), 0, 42)
		require.NoError(t, err)
		require.Zero(t, bad)

		require.NoError(t, m2.Close())
		require.NoError(t, imp.Close())
		require.NoError(t, r2.Close())
		require.NoError(t, r.Close())
	})
}

func TestDMABufExport(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		if !d.Supports(driver.AttrDMABufSupported) {
			t.Skip("device reports no dma-buf support")
		}
		r, m := mapFilled(t, d, 4*mib, 1)
		defer func() { require.NoError(t, r.Close()) }()
		defer func() { require.NoError(t, m.Close()) }()
		f, err := r.ExportDMABuf(0, 4*mib)
		require.NoError(t, err)
		end, err := unix.Seek(int(f.Fd()), 0, unix.SEEK_END)
		require.NoError(t, err)
		require.Equal(t, int64(4*mib), end, "the dma-buf's size is the range's size")
		require.NoError(t, f.Close())
		_, err = r.ExportDMABuf(0, 6*mib)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
	})
}

func TestUnmapRangeSpansMappings(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, err := b.Sys.Reserve(8*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		for off := uint64(0); off < 8*mib; off += 2 * mib {
			_, err := r.MapNew(off, 2*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
			require.NoError(t, err)
		}
		// One set-access and one fill over several chunks.
		require.NoError(t, r.SetAccess(0, 8*mib, vmm.ReadWrite(d)))
		require.NoError(t, d.Fill(r.Ptr(), 8*mib, 0, 3))
		require.ErrorIs(t, r.UnmapRange(mib*2, mib*3), vmm.ErrInvalidValue, "half a mapping")
		require.NoError(t, r.UnmapRange(4*mib, 4*mib))
		bad, err := d.Verify(r.Ptr(), 4*mib, 0, 3)
		require.NoError(t, err)
		require.Zero(t, bad)
		require.Len(t, r.Mappings(), 2)
		require.NoError(t, r.UnmapRange(0, 4*mib))
		require.NoError(t, r.Close())
	})
}

func TestReserveHintExtendsInPlace(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		r, err := b.Sys.Reserve(64*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		next, err := b.Sys.Reserve(64*mib, vmm.ReserveOptions{Hint: r.End(), RequireHint: true})
		require.NoError(t, err)
		require.Equal(t, r.End(), next.Ptr())
		// The same hint again is taken: RequireHint fails and leaves nothing behind.
		_, err = b.Sys.Reserve(64*mib, vmm.ReserveOptions{Hint: r.End(), RequireHint: true})
		require.ErrorIs(t, err, vmm.ErrHintNotGranted)
		require.NoError(t, next.Close())
		require.NoError(t, r.Close())
	})
}

// A hint is advice unless RequireHint: when the driver refuses a hinted range outright (out of
// memory), Reserve asks again without the hint. With RequireHint the refusal is the hint not
// granted; without a hint it is the answer.
func TestReserveHintRefusedIsAskedAgainWithout(t *testing.T) {
	s, sys, _ := ownSim(t)
	first, err := sys.Reserve(64*mib, vmm.ReserveOptions{})
	require.NoError(t, err)
	s.FailNth("cuMemAddressReserve", 1, driver.ErrorOutOfMemory)
	r, err := sys.Reserve(64*mib, vmm.ReserveOptions{Hint: first.End()})
	require.NoError(t, err, "placed elsewhere, or at the hint, but not refused")
	require.NoError(t, r.Close())
	s.FailNth("cuMemAddressReserve", 1, driver.ErrorOutOfMemory)
	s.FailNth("cuMemAddressReserve", 2, driver.ErrorOutOfMemory)
	_, err = sys.Reserve(64*mib, vmm.ReserveOptions{Hint: first.End()})
	require.ErrorIs(t, err, driver.ErrOutOfMemory)
	require.ErrorContains(t, err, "(at the hint: ", "both refusals are told")
	for _, opts := range []vmm.ReserveOptions{{Hint: first.End(), RequireHint: true}, {}} {
		s.FailNth("cuMemAddressReserve", 1, driver.ErrorOutOfMemory)
		_, err = sys.Reserve(64*mib, opts)
		require.ErrorIs(t, err, driver.ErrOutOfMemory, "%+v", opts)
		require.Equal(t, opts.RequireHint, errors.Is(err, vmm.ErrHintNotGranted), "%+v: %v", opts, err)
	}
	require.NoError(t, first.Close())
	require.Equal(t, sim.Live{Contexts: 1}, s.Live())
	require.NoError(t, sys.Close())
}

// A hint whose range covers host memory of the process cannot be granted there: Reserve places
// the range elsewhere, from 1 GiB to more than a device's memory. What the driver itself answers
// to the same hinted call is logged.
func TestReserveHintOverHostMemoryIsPlacedElsewhere(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		host, err := unix.Mmap(-1, 0, 64*mib, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		defer func() { require.NoError(t, unix.Munmap(host)) }()
		h := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(host))))
		for _, size := range []uint64{1 << 30, 160 << 30} {
			hint := driver.DevicePtr((h - size/2) &^ (2*mib - 1))
			logDriverAnswer(t, d, size, hint)
			r, err := b.Sys.Reserve(size, vmm.ReserveOptions{Hint: hint})
			require.NoError(t, err, "%d GiB at %#x", size>>30, uint64(hint))
			end := uint64(r.End())
			require.True(t, end <= h || uint64(r.Ptr()) >= h+64*mib, "%v overlaps the host memory at %#x", r, h)
			require.NoError(t, r.Close())
		}
		// A range just freed, as a checkpoint's saved address is, asked for at many times its size.
		small, err := b.Sys.Reserve(4*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		hint := small.Ptr()
		require.NoError(t, small.Close())
		logDriverAnswer(t, d, 160<<30, hint)
		r, err := b.Sys.Reserve(160<<30, vmm.ReserveOptions{Hint: hint})
		require.NoError(t, err, "160 GiB at %#x", uint64(hint))
		require.NoError(t, r.Close())
	})
}

// logDriverAnswer logs what cuMemAddressReserve itself answers to size bytes at hint, and frees
// what it reserved.
func logDriverAnswer(t *testing.T, d *vmm.Device, size uint64, hint driver.DevicePtr) {
	t.Helper()
	require.NoError(t, d.Raw(func(api driver.API) error {
		p, err := api.MemAddressReserve(size, 0, hint, 0)
		t.Logf("cuMemAddressReserve(%d GiB, hint %#x): %#x, %v", size>>30, uint64(hint), uint64(p), err)
		if err != nil {
			return nil
		}
		return api.MemAddressFree(p, size)
	}))
}

func TestHostNUMACPUAccess(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		node := d.HostNUMAID()
		if node < 0 || !d.Supports(driver.AttrHostNUMAVirtualMemoryManagementSupported) {
			t.Skip("device reports no host-NUMA VMM support")
		}
		r, err := b.Sys.Reserve(2*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		m, err := r.MapNew(0, 2*mib, d, vmm.AllocOptions{Location: driver.HostNUMALocation(node), HandleTypes: driver.HandleTypePosixFD},
			vmm.ReadWrite(d), vmm.HostReadWrite())
		require.NoError(t, err)
		require.NoError(t, d.Fill(m.Ptr(), m.Size(), 0, 5))
		// The CPU reads the GPU's writes through the same virtual address.
		view := vmm.HostView(m.Ptr(), m.Size())
		words := unsafe.Slice((*uint64)(unsafe.Pointer(&view[0])), len(view)/8)
		for _, i := range []int{0, 1, len(words) - 1} {
			require.Equal(t, pattern.Word(uint64(i), 5), words[i])
		}
		words[3] = 0
		bad, err := d.Verify(m.Ptr(), m.Size(), 0, 5)
		require.NoError(t, err)
		require.Equal(t, uint64(1), bad, "the GPU sees the CPU's write")
		require.NoError(t, m.Close())
		require.NoError(t, r.Close())
	})
}

func TestReadOnlyPeer(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		ok, err := d1.CanAccessPeer(d0)
		require.NoError(t, err)
		if !ok {
			t.Skip("devices 0 and 1 cannot access each other")
		}
		r, err := b.Sys.Reserve(2*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		m, err := r.MapNew(0, 2*mib, d0, vmm.AllocOptions{}, vmm.ReadWrite(d0), vmm.ReadOnly(d1))
		require.NoError(t, err)
		f, err := m.Access(d1.Location())
		require.NoError(t, err)
		require.Equal(t, driver.AccessRead, f)
		require.NoError(t, d0.Fill(m.Ptr(), m.Size(), 0, 9))
		bad, err := d1.Verify(m.Ptr(), m.Size(), 0, 9)
		require.NoError(t, err)
		require.Zero(t, bad, "the read-only peer reads")
		require.Error(t, d1.Memset(m.Ptr(), 0, 4096), "the read-only peer cannot write")
		require.NoError(t, m.Close())
		require.NoError(t, r.Close())
	}, testutil.Devices(2))
}

func TestStreamsEventsCopies(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, m := mapFilled(t, d, 2*mib, 11)
		defer func() { require.NoError(t, r.Close()) }()
		defer func() { require.NoError(t, m.Close()) }()
		host, err := d.HostAlloc(2*mib, driver.HostAllocPortable)
		require.NoError(t, err)
		defer func() { require.NoError(t, host.Close()) }()
		s, err := d.NewStream(true)
		require.NoError(t, err)
		defer func() { require.NoError(t, s.Close()) }()
		e0, err := d.NewEvent(true)
		require.NoError(t, err)
		defer func() { require.NoError(t, e0.Close()) }()
		e1, err := d.NewEvent(true)
		require.NoError(t, err)
		defer func() { require.NoError(t, e1.Close()) }()

		require.NoError(t, e0.Record(s))
		require.NoError(t, d.CopyDtoHAsync(host.Pointer(), m.Ptr(), 2*mib, s))
		require.NoError(t, d.LaunchRead(m.Ptr(), 2*mib, s))
		require.NoError(t, e1.Record(s))
		require.NoError(t, e1.Synchronize())
		el, err := e1.Elapsed(e0)
		require.NoError(t, err)
		require.GreaterOrEqual(t, el, 0*el)
		words := unsafe.Slice((*uint64)(host.Pointer()), 2*mib/8)
		require.Equal(t, pattern.Word(100, 11), words[100])

		// Round trip through a host registration.
		mem, err := unix.Mmap(-1, 0, 2*mib, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		defer unix.Munmap(mem)
		reg, err := d.HostRegister(mem, 0)
		require.NoError(t, err)
		require.NoError(t, d.Copy(reg.Ptr(), m.Ptr(), 2*mib))
		require.Equal(t, host.Bytes()[:4096], mem[:4096])
		require.NoError(t, reg.Close())
		require.NoError(t, reg.Close())

		_, err = d.HostRegister(mem[1:4097], 0)
		require.ErrorIs(t, err, vmm.ErrInvalidValue, "unaligned registration")
		_, err = d.HostRegister(nil, 0)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
	})
}

// The simulator's fault hook checks that multi-step operations undo what they did.
func TestMapNewRollsBack(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, err := b.Sys.Reserve(4*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		for _, fn := range []string{"cuMemCreate", "cuMemMap", "cuMemSetAccess"} {
			b.Sim.FailNth(fn, 1, driver.ErrorOutOfMemory)
			_, err := r.MapNew(0, 2*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
			require.ErrorIs(t, err, driver.ErrOutOfMemory, fn)
			require.ErrorContains(t, err, fn)
			require.Empty(t, r.Mappings(), fn)
			live := b.Sim.Live()
			require.Zero(t, live.Allocations, "after a failed %s: %s", fn, live)
			require.Zero(t, live.Mappings, "after a failed %s: %s", fn, live)
		}
		a, err := d.Allocate(2*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		b.Sim.FailNth("cuMemSetAccess", 1, driver.ErrorInvalidValue)
		_, err = r.MapAccess(0, a, vmm.ReadWrite(d))
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.Zero(t, b.Sim.Live().Mappings)
		require.NoError(t, a.Close(), "the allocation is not left mapped")
		require.NoError(t, r.Close())
	}, testutil.SimOnly())
}

func TestCloseOrderErrors(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		s, err := d.NewStream(false)
		require.NoError(t, err)
		err = b.Sys.Close()
		require.True(t, errors.Is(err, vmm.ErrInUse), "system close with a live stream: %v", err)
		require.NoError(t, s.Close())
	})
}

// TestAllocationClosed: Closed turns true when the allocation is closed, directly or through the
// mapping that owns it.
func TestAllocationClosed(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		a, err := d.Allocate(2*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		require.False(t, a.Closed())
		require.NoError(t, a.Close())
		require.True(t, a.Closed())

		r, m := mapFilled(t, d, 2*mib, 3)
		defer func() { require.NoError(t, r.Close()) }()
		owned := m.Allocation()
		require.False(t, owned.Closed())
		require.NoError(t, m.Close())
		require.True(t, owned.Closed(), "closing the owning mapping closes the allocation")
	})
}

// SetAccess on a mapping racing its Close (and a new mapping made at the same offset right after):
// SetAccess either happens before the Close or fails with ErrClosed; it never reports the range as
// not made of mappings, nor grants access on the mapping that took the closed one's place.
func TestSetAccessRacesClose(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d, r := raceRange(t, b)
		for range 300 {
			m, err := r.MapNew(0, 2*mib, d, vmm.AllocOptions{})
			require.NoError(t, err)
			var serr error
			next := closeAndRemapWhile(t, r, d, m, func() { serr = m.SetAccess(vmm.ReadWrite(d)) })
			flags, ferr := next.Access(d.Location())
			require.NoError(t, next.Close())
			require.NoError(t, ferr)
			require.Equal(t, driver.AccessNone, flags, "set access of a closed mapping reached its successor")
			if serr != nil {
				require.ErrorIs(t, serr, vmm.ErrClosed)
			}
		}
	}, testutil.SimOnly())
}

// Access on a mapping racing its Close (and a new mapping without access made at the same offset
// right after): Access reads the closed mapping's read-write flags or fails with ErrClosed; it never
// reads its successor's flags nor fails with the driver's error for an unmapped range.
func TestAccessRacesClose(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d, r := raceRange(t, b)
		for range 300 {
			m, err := r.MapNew(0, 2*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
			require.NoError(t, err)
			var flags driver.AccessFlags
			var aerr error
			next := closeAndRemapWhile(t, r, d, m, func() { flags, aerr = m.Access(d.Location()) })
			require.NoError(t, next.Close())
			if aerr != nil {
				require.ErrorIs(t, aerr, vmm.ErrClosed)
				continue
			}
			require.Equal(t, driver.AccessReadWrite, flags, "access of a closed mapping read its successor's")
		}
	}, testutil.SimOnly())
}

// raceRange reserves the 2 MiB range on device 0 that the Close races remap, closed at cleanup.
func raceRange(t *testing.T, b *testutil.Backend) (*vmm.Device, *vmm.Reservation) {
	t.Helper()
	r, err := b.Sys.Reserve(2*mib, vmm.ReserveOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, r.Close()) })
	return b.Device(t, 0), r
}

// closeAndRemapWhile runs call beside m's Close and, once that succeeds, a new mapping without
// access at offset 0 of r, which takes the closed one's place; it returns the new mapping.
func closeAndRemapWhile(t *testing.T, r *vmm.Reservation, d *vmm.Device, m *vmm.Mapping, call func()) *vmm.Mapping {
	var next *vmm.Mapping
	var cerr, nerr error
	var wg sync.WaitGroup
	wg.Go(call)
	wg.Go(func() {
		if cerr = m.Close(); cerr == nil {
			next, nerr = r.MapNew(0, 2*mib, d, vmm.AllocOptions{})
		}
	})
	wg.Wait()
	require.NoError(t, cerr)
	require.NoError(t, nerr)
	return next
}

// A dependent (AddDependent: an object of another package using the device through Raw) makes
// System.Close fail with ErrInUse, naming its kind, until its done is called; done is idempotent. A
// closed System refuses new dependents.
func TestAddDependent(t *testing.T) {
	_, sys, d := ownSim(t)
	done, err := d.AddDependent("test communicator")
	require.NoError(t, err)
	err = sys.Close()
	require.ErrorIs(t, err, vmm.ErrInUse)
	require.ErrorContains(t, err, "1 test communicator(s)")
	done()
	done()
	require.NoError(t, sys.Close())
	_, err = d.AddDependent("late communicator")
	require.ErrorIs(t, err, vmm.ErrClosed)
	require.Zero(t, sys.Stats().Devices[0].LiveOwners, "nothing counted on a closed System")
}
