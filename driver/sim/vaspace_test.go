package sim

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
)

func TestReserveRules(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	for _, c := range []struct {
		size, align uint64
		code        driver.Result
	}{
		{0, 0, driver.ErrorInvalidValue},
		{1 * mib, 0, driver.ErrorInvalidValue},
		{2*mib + 4096, 0, driver.ErrorInvalidValue},
		{2 * mib, 3 * mib, driver.ErrorInvalidValue}, // not a power of two
	} {
		_, err := s.MemAddressReserve(c.size, c.align, 0, 0)
		require.ErrorIs(t, err, c.code, "size %d align %d", c.size, c.align)
	}
	_, err := s.MemAddressReserve(2*mib, 0, 0, 1)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "flags must be 0")

	for _, align := range []uint64{0, 4096, 2 * mib, 64 * mib, 1 * gib} {
		p, err := s.MemAddressReserve(4*mib, align, 0, 0)
		require.NoError(t, err)
		require.Zero(t, uint64(p)%max(align, 2*mib), "align %d", align)
		require.True(t, faults(p), "reserved space is inaccessible to the CPU")
		require.NoError(t, s.MemAddressFree(p, 4*mib))
	}
}

func TestReserveHugeRanges(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	// The real driver grants 64 TiB (measured). The simulator reserves in this process's own address
	// space, whose largest free gap depends on where the kernel placed the mappings (seen below 64 TiB
	// on the GPU host now and then): it must grant what fits and refuse what does not.
	huge := uint64(64 << 40)
	if gap, _ := largestGap(t); gap < huge+(1<<30) { // no room to spare: 32 TiB instead
		if gap < huge {
			_, err := s.MemAddressReserve(huge, 0, 0, 0)
			require.ErrorIs(t, err, driver.ErrorOutOfMemory, "64 TiB where the largest gap is %d GiB", gap>>30)
		}
		huge = 32 << 40
	}
	p, err := s.MemAddressReserve(huge, 0, 0, 0)
	gap, at := largestGap(t)
	require.NoError(t, err, "%d TiB; the largest free gap of this process's address space: %d GiB at %#x", huge>>40, gap>>30, at)
	require.NotZero(t, p)
	require.NoError(t, s.MemAddressFree(p, huge))
	_, err = s.MemAddressReserve(1<<50, 0, 0, 0) // measured: 1 PiB OUT_OF_MEMORY
	require.ErrorIs(t, err, driver.ErrorOutOfMemory)
	_, err = s.MemAddressReserve(^uint64(0)&^(2*mib-1), 0, 0, 0)
	require.ErrorIs(t, err, driver.ErrorOutOfMemory)
}

func TestInPlaceExtension(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	// A reservation of 64 MiB (the driver extends those in place; see TestSmallReservationNotExtended)
	// whose last 4 MiB hold two chunks; only they are touched.
	const resSize = 64 * mib
	base, err := s.MemAddressReserve(resSize, 0, 0, 0)
	require.NoError(t, err)
	end := base + driver.DevicePtr(resSize)
	a := &buffer{base: end - 4*driver.DevicePtr(mib), size: 4 * mib}
	for i := range 2 {
		h, err := s.MemCreate(2*mib, deviceProp(0, 0), 0)
		require.NoError(t, err)
		va := a.base + driver.DevicePtr(uint64(i)*2*mib)
		require.NoError(t, s.MemMap(va, 2*mib, 0, h, 0))
		a.chunks = append(a.chunks, chunk{h, va, 2 * mib})
	}
	require.NoError(t, s.MemSetAccess(a.base, a.size, []driver.AccessDesc{rw(0)}))

	// Reserve with hint = end of the existing reservation: granted at the hint (measured).
	ext, err := s.MemAddressReserve(4*mib, 0, end, 0)
	require.NoError(t, err)
	require.Equal(t, end, ext)
	h, err := s.MemCreate(4*mib, deviceProp(0, 0), 0)
	require.NoError(t, err)
	require.NoError(t, s.MemMap(ext, 4*mib, 0, h, 0))
	require.NoError(t, s.MemSetAccess(ext, 4*mib, []driver.AccessDesc{rw(0)}))

	// One copy over the whole grown buffer crosses chunks and reservations.
	total := a.size + 4*mib
	src := pattern(int(total), 9)
	require.NoError(t, s.MemcpyHtoD(a.base, ptr(src), total))
	dst := make([]byte, total)
	require.NoError(t, s.MemcpyDtoH(ptr(dst), a.base, total))
	require.Equal(t, src, dst)
	// Access and unmap may span both reservations too.
	require.NoError(t, s.MemSetAccess(a.base, total, []driver.AccessDesc{rw(0)}))

	// A hint on taken space is only a hint: the range goes elsewhere.
	other, err := s.MemAddressReserve(2*mib, 0, base, 0)
	require.NoError(t, err)
	require.NotEqual(t, base, other)
	require.NoError(t, s.MemAddressFree(other, 2*mib))

	// A mapping may not straddle two reservations, even adjacent ones.
	h2, err := s.MemCreate(4*mib, deviceProp(0, 0), 0)
	require.NoError(t, err)
	require.NoError(t, s.MemUnmap(a.base, total))
	require.ErrorIs(t, s.MemMap(end-2*driver.DevicePtr(mib), 4*mib, 0, h2, 0), driver.ErrorInvalidValue)
	require.NoError(t, s.MemRelease(h2))

	require.NoError(t, s.MemRelease(h))
	require.NoError(t, s.MemAddressFree(ext, 4*mib))
	for _, c := range a.chunks {
		require.NoError(t, s.MemRelease(c.h))
	}
	require.ErrorIs(t, s.MemAddressFree(base, resSize+4*mib), driver.ErrorInvalidValue, "not one reservation")
	require.NoError(t, s.MemAddressFree(base, resSize))
}

// With RefuseUngrantedHints a hint on taken space is refused (out of memory), and nothing is kept
// reserved; a hint on free space is granted there, and no hint is placed anywhere.
func TestRefuseUngrantedHints(t *testing.T) {
	s := start(t, RefuseUngrantedHints())
	bind(t, s, 0)
	base, err := s.MemAddressReserve(64*mib, 0, 0, 0)
	require.NoError(t, err)
	_, err = s.MemAddressReserve(2*mib, 0, base, 0)
	require.ErrorIs(t, err, driver.ErrorOutOfMemory)
	require.Equal(t, 1, s.Live().Reservations, "the misplaced range is not kept")
	end := base + driver.DevicePtr(64*mib)
	ext, err := s.MemAddressReserve(64*mib, 0, end, 0)
	require.NoError(t, err)
	require.Equal(t, end, ext)
	require.NoError(t, s.MemAddressFree(ext, 64*mib))
	require.NoError(t, s.MemAddressFree(base, 64*mib))
}

// The driver does not extend a reservation under 32 MiB in place (docs/driver-facts.md, section 5): a
// hint at its end is not taken, and cuMemAddressReserve succeeds elsewhere.
func TestSmallReservationNotExtended(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	for _, size := range []uint64{2 * mib, 4 * mib, 30 * mib} {
		p, err := s.MemAddressReserve(size, 0, 0, 0)
		require.NoError(t, err)
		end := p + driver.DevicePtr(size)
		for _, ext := range []uint64{2 * mib, size, 64 * mib} {
			q, err := s.MemAddressReserve(ext, 0, end, 0)
			require.NoError(t, err, "after %d MiB, %d MiB: placed elsewhere, not refused", size/mib, ext/mib)
			require.NotEqual(t, end, q, "after %d MiB, %d MiB at its end", size/mib, ext/mib)
			require.True(t, q+driver.DevicePtr(ext) <= p || q >= end, "elsewhere, not over the reservation")
			require.NoError(t, s.MemAddressFree(q, ext))
		}
		// The range at the end is free all the same: a hint inside it, not at the end, is taken.
		q, err := s.MemAddressReserve(2*mib, 0, end+2*driver.DevicePtr(mib), 0)
		require.NoError(t, err)
		require.Equal(t, end+2*driver.DevicePtr(mib), q)
		require.NoError(t, s.MemAddressFree(q, 2*mib))
		require.NoError(t, s.MemAddressFree(p, size))
	}

	// 32 MiB and more extend in place (64 MiB and more: measured), by any size; but a small extension
	// is itself a small reservation, and its end is not extended.
	for _, size := range []uint64{32 * mib, 64 * mib} {
		p, err := s.MemAddressReserve(size, 0, 0, 0)
		require.NoError(t, err)
		end := p + driver.DevicePtr(size)
		q, err := s.MemAddressReserve(2*mib, 0, end, 0)
		require.NoError(t, err)
		require.Equal(t, end, q, "after %d MiB", size/mib)
		r, err := s.MemAddressReserve(2*mib, 0, end+2*driver.DevicePtr(mib), 0)
		require.NoError(t, err)
		require.NotEqual(t, end+2*driver.DevicePtr(mib), r, "at the end of a 2 MiB extension")
		require.NoError(t, s.MemAddressFree(r, 2*mib))
		require.NoError(t, s.MemAddressFree(q, 2*mib))
		require.NoError(t, s.MemAddressFree(p, size))
	}
}

func TestAddressFree(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	p, err := s.MemAddressReserve(8*mib, 0, 0, 0)
	require.NoError(t, err)
	require.ErrorIs(t, s.MemAddressFree(p, 4*mib), driver.ErrorInvalidValue, "part of a reservation")
	require.ErrorIs(t, s.MemAddressFree(p+2*driver.DevicePtr(mib), 6*mib), driver.ErrorInvalidValue)
	h, err := s.MemCreate(2*mib, deviceProp(0, 0), 0)
	require.NoError(t, err)
	require.NoError(t, s.MemMap(p, 2*mib, 0, h, 0))
	require.ErrorIs(t, s.MemAddressFree(p, 8*mib), driver.ErrorInvalidValue, "still mapped")
	require.NoError(t, s.MemUnmap(p, 2*mib))
	require.NoError(t, s.MemRelease(h))
	require.NoError(t, s.MemAddressFree(p, 8*mib))
	require.ErrorIs(t, s.MemAddressFree(p, 8*mib), driver.ErrorInvalidValue, "twice (measured)")
}

func TestMapRules(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	res, err := s.MemAddressReserve(16*mib, 0, 0, 0)
	require.NoError(t, err)
	h, err := s.MemCreate(4*mib, deviceProp(0, 0), 0)
	require.NoError(t, err)
	M := driver.DevicePtr(mib)

	require.ErrorIs(t, s.MemMap(res, 4*mib, 2*mib, h, 0), driver.ErrorNotSupported, "offset != 0 (measured)")
	require.ErrorIs(t, s.MemMap(res, 2*mib, 0, h, 0), driver.ErrorNotSupported, "part of an allocation (measured)")
	require.ErrorIs(t, s.MemMap(res, 6*mib, 0, h, 0), driver.ErrorInvalidValue, "more than the allocation")
	require.ErrorIs(t, s.MemMap(res+4096, 4*mib, 0, h, 0), driver.ErrorInvalidValue, "unaligned address")
	require.ErrorIs(t, s.MemMap(res+14*M, 4*mib, 0, h, 0), driver.ErrorInvalidValue, "past the reservation")
	require.ErrorIs(t, s.MemMap(0x200000, 4*mib, 0, h, 0), driver.ErrorInvalidValue, "not reserved")
	require.ErrorIs(t, s.MemMap(res, 4*mib, 0, h, 1), driver.ErrorInvalidValue, "flags")
	require.ErrorIs(t, s.MemMap(res, 4*mib, 0, 77, 0), driver.ErrorInvalidValue, "unknown handle")

	require.NoError(t, s.MemMap(res, 4*mib, 0, h, 0))
	require.ErrorIs(t, s.MemMap(res, 4*mib, 0, h, 0), driver.ErrorAlreadyMapped)
	require.ErrorIs(t, s.MemMap(res+2*M, 4*mib, 0, h, 0), driver.ErrorAlreadyMapped)
	require.NoError(t, s.MemMap(res+4*M, 4*mib, 0, h, 0), "the same allocation at a second address")
	require.Equal(t, 2, s.Live().Mappings)

	// A new mapping has no access for anyone.
	f, err := s.MemGetAccess(driver.DeviceLocation(0), res)
	require.NoError(t, err)
	require.Equal(t, driver.AccessNone, f)
	var b [8]byte
	require.ErrorIs(t, s.MemcpyDtoH(unsafe.Pointer(&b[0]), res, 8), driver.ErrorInvalidValue)

	require.NoError(t, s.MemUnmap(res, 8*mib))
	require.NoError(t, s.MemRelease(h))
	require.NoError(t, s.MemAddressFree(res, 16*mib))
}

func TestUnmapRules(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	b := makeBuffer(t, s, deviceProp(0, 0), 3, 4*mib, rw(0))
	M := driver.DevicePtr(mib)
	require.ErrorIs(t, s.MemUnmap(b.base, 2*mib), driver.ErrorInvalidValue, "part of a mapping (measured)")
	require.ErrorIs(t, s.MemUnmap(b.base+2*M, 4*mib), driver.ErrorInvalidValue, "halves of two mappings")
	require.ErrorIs(t, s.MemUnmap(b.base, 6*mib), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemUnmap(b.base, 0), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemUnmap(b.base+4096, 4*mib), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemUnmap(0x200000, 2*mib), driver.ErrorInvalidValue, "not reserved")
	require.Equal(t, 3, s.Live().Mappings)

	require.NoError(t, s.MemUnmap(b.base+4*M, 8*mib), "two whole adjacent mappings in one call (measured)")
	require.Equal(t, 1, s.Live().Mappings)
	require.NoError(t, s.MemUnmap(b.base+4*M, 8*mib), "already unmapped: SUCCESS (measured)")

	// Re-mapping starts with no access.
	require.NoError(t, s.MemMap(b.base+4*M, 4*mib, 0, b.chunks[1].h, 0))
	f, err := s.MemGetAccess(driver.DeviceLocation(0), b.base+4*M)
	require.NoError(t, err)
	require.Equal(t, driver.AccessNone, f)
	f, err = s.MemGetAccess(driver.DeviceLocation(0), b.base)
	require.NoError(t, err)
	require.Equal(t, driver.AccessReadWrite, f)
	b.free(t, s)
}

func TestSetAccessRules(t *testing.T) {
	s := start(t, Devices(2))
	bind(t, s, 0)
	b := makeBuffer(t, s, deviceProp(0, 0), 3, 4*mib)
	M := driver.DevicePtr(mib)
	acc := []driver.AccessDesc{rw(0)}
	require.ErrorIs(t, s.MemSetAccess(b.base, 2*mib, acc), driver.ErrorInvalidValue, "half a mapping (measured)")
	require.ErrorIs(t, s.MemSetAccess(b.base+2*M, 4*mib, acc), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemSetAccess(b.base, 14*mib, acc), driver.ErrorInvalidValue, "not fully mapped (measured)")
	require.ErrorIs(t, s.MemSetAccess(b.base, 12*mib, nil), driver.ErrorInvalidValue, "no descriptors")
	require.ErrorIs(t, s.MemSetAccess(b.base, 12*mib, []driver.AccessDesc{{Location: driver.DeviceLocation(0), Flags: 2}}),
		driver.ErrorInvalidValue, "flags")
	require.ErrorIs(t, s.MemSetAccess(b.base, 12*mib, []driver.AccessDesc{rw(2)}), driver.ErrorInvalidDevice)
	require.ErrorIs(t, s.MemSetAccess(b.base, 12*mib, []driver.AccessDesc{hostAccess(driver.AccessReadWrite)}),
		driver.ErrorInvalidValue, "host access to device memory")
	// A failing call changes nothing, even for its valid descriptors.
	require.ErrorIs(t, s.MemSetAccess(b.base, 12*mib, []driver.AccessDesc{rw(0), rw(7)}), driver.ErrorInvalidDevice)
	f, _ := s.MemGetAccess(driver.DeviceLocation(0), b.base)
	require.Equal(t, driver.AccessNone, f)

	require.NoError(t, s.MemSetAccess(b.base, 4*mib, acc), "one whole mapping")
	require.NoError(t, s.MemSetAccess(b.base+4*M, 8*mib, []driver.AccessDesc{rw(0), ro(1)}), "several whole mappings")
	for i, want := range [][2]driver.AccessFlags{
		{driver.AccessReadWrite, driver.AccessNone},
		{driver.AccessReadWrite, driver.AccessRead}, // measured: PROT_READ for a peer is supported
		{driver.AccessReadWrite, driver.AccessRead},
	} {
		for dev := range 2 {
			f, err := s.MemGetAccess(driver.DeviceLocation(driver.Device(dev)), b.chunks[i].va+12345)
			require.NoError(t, err)
			require.Equal(t, want[dev], f, "chunk %d device %d", i, dev)
		}
	}
	f, err := s.MemGetAccess(driver.HostLocation(), b.base)
	require.NoError(t, err)
	require.Equal(t, driver.AccessNone, f)
	_, err = s.MemGetAccess(driver.DeviceLocation(5), b.base)
	require.ErrorIs(t, err, driver.ErrorInvalidDevice)
	_, err = s.MemGetAccess(driver.DeviceLocation(0), b.base+12*M)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "not mapped")
	b.free(t, s)
}

func TestPeerAccessUnsupported(t *testing.T) {
	s := start(t, Devices(2), PeerAccess(0, 1, false))
	bind(t, s, 0)
	b := makeBuffer(t, s, deviceProp(0, 0), 1, 2*mib, rw(0))
	err := s.MemSetAccess(b.base, b.size, []driver.AccessDesc{ro(1)})
	require.ErrorIs(t, err, driver.ErrorPeerAccessUnsupported)
	require.ErrorIs(t, err, driver.ErrNotSupported)
	require.NoError(t, s.MemSetAccess(b.base, b.size, []driver.AccessDesc{{Location: driver.DeviceLocation(1)}}),
		"granting nothing is fine")
	b.free(t, s)

	// Host-NUMA memory may be granted to any device.
	n := makeBuffer(t, s, hostNUMAProp(0), 1, 2*mib, rw(0), rw(1))
	n.free(t, s)
}

func TestHostNUMACPUAccess(t *testing.T) {
	s := start(t, Devices(2))
	bind(t, s, 0)
	b := makeBuffer(t, s, hostNUMAProp(driver.HandleTypePosixFD), 2, 2*mib)
	require.True(t, faults(b.base), "no host access yet")

	require.NoError(t, s.MemSetAccess(b.base, b.size, []driver.AccessDesc{rw(0), hostAccess(driver.AccessReadWrite)}))
	// The CPU writes through the virtual address, across the two chunks...
	cpu := unsafe.Slice((*byte)(at(b.base)), b.size)
	copy(cpu, pattern(int(b.size), 1))
	// ... and the device sees it.
	got := make([]byte, b.size)
	require.NoError(t, s.MemcpyDtoH(ptr(got), b.base, b.size))
	require.Equal(t, pattern(int(b.size), 1), got)
	// Device writes are visible to the CPU (measured).
	require.NoError(t, s.MemsetD32(b.base+8, 0xdeadbeef, 1))
	require.Equal(t, uint32(0xdeadbeef), *(*uint32)(at(b.base + 8)))

	// HOST_NUMA node 0 is the host too; read-only host access.
	require.NoError(t, s.MemSetAccess(b.base, b.size, []driver.AccessDesc{{Location: driver.HostNUMALocation(0), Flags: driver.AccessRead}}))
	f, err := s.MemGetAccess(driver.HostNUMALocation(0), b.base)
	require.NoError(t, err)
	require.Equal(t, driver.AccessRead, f)
	require.Equal(t, uint32(0xdeadbeef), *(*uint32)(at(b.base + 8)))
	require.ErrorIs(t, s.MemSetAccess(b.base, b.size, []driver.AccessDesc{{Location: driver.HostNUMALocation(1), Flags: driver.AccessRead}}),
		driver.ErrorInvalidValue)

	// Revoking restores PROT_NONE; the data stays.
	require.NoError(t, s.MemSetAccess(b.base, b.size, []driver.AccessDesc{hostAccess(driver.AccessNone)}))
	require.True(t, faults(b.base))
	require.NoError(t, s.MemSetAccess(b.base, b.size, []driver.AccessDesc{hostAccess(driver.AccessReadWrite)}))
	require.Equal(t, uint32(0xdeadbeef), *(*uint32)(at(b.base + 8)))

	// Unmapping drops host access too; the reservation stays inaccessible.
	require.NoError(t, s.MemUnmap(b.chunks[1].va, 2*mib))
	require.True(t, faults(b.chunks[1].va))
	require.False(t, faults(b.base))
	require.NoError(t, s.MemMap(b.chunks[1].va, 2*mib, 0, b.chunks[1].h, 0))
	require.True(t, faults(b.chunks[1].va), "re-mapped: no access")
	b.free(t, s)

	// Device memory is never CPU-accessible.
	d := makeBuffer(t, s, deviceProp(0, 0), 1, 2*mib, rw(0))
	require.True(t, faults(d.base))
	d.free(t, s)
}

func TestPageTableAccounting(t *testing.T) {
	s := start(t, Devices(2))
	c1, err := s.DevicePrimaryCtxRetain(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.DevicePrimaryCtxRelease(1)) }()
	c0 := bind(t, s, 0)
	free := func(ctx driver.Context) uint64 {
		t.Helper()
		require.NoError(t, s.CtxSetCurrent(ctx))
		f, _, err := s.MemGetInfo()
		require.NoError(t, err)
		return f
	}
	base0, base1 := free(c0), free(c1)

	// 1 GiB of host-NUMA memory granted to device 1 only: 2 MiB of page tables on device 1.
	b := makeBuffer(t, s, hostNUMAProp(0), 4, 256*mib, rw(1))
	require.Equal(t, base0, free(c0))
	require.Equal(t, base1-2*mib, free(c1))
	// Granted to the host only: free.
	require.NoError(t, s.MemSetAccess(b.base, b.size, []driver.AccessDesc{{Location: driver.DeviceLocation(1)}, hostAccess(driver.AccessReadWrite)}))
	require.Equal(t, base1, free(c1))
	// Read access counts like read-write; the cost goes with the unmap.
	require.NoError(t, s.MemSetAccess(b.base, b.size, []driver.AccessDesc{ro(0), ro(1)}))
	require.Equal(t, base0-2*mib, free(c0))
	require.Equal(t, base1-2*mib, free(c1))
	b.free(t, s)
	require.Equal(t, base0, free(c0))
	require.Equal(t, base1, free(c1))

	// Device memory costs its size on its own device only.
	d := makeBuffer(t, s, deviceProp(1, 0), 1, 64*mib, rw(0), rw(1))
	require.Equal(t, base0, free(c0))
	require.Equal(t, base1-64*mib, free(c1))
	d.free(t, s)

	// Registered and cuMemHostAlloc'ed memory costs every device.
	region, err := mmap(0, uintptr(gib), 3, reserveFlags, -1, 0) // PROT_READ|PROT_WRITE, untouched
	require.NoError(t, err)
	defer munmap(region, gib)
	require.NoError(t, s.MemHostRegister(addrPtr(region), gib, 0))
	hp, err := s.MemHostAlloc(512*mib, 0)
	require.NoError(t, err)
	require.Equal(t, base0-3*mib, free(c0))
	require.Equal(t, base1-3*mib, free(c1))
	require.NoError(t, s.MemHostUnregister(addrPtr(region)))
	require.NoError(t, s.MemFreeHost(hp))
	require.Equal(t, base0, free(c0))
	require.Equal(t, base1, free(c1))
	require.NoError(t, s.CtxSetCurrent(c0))
}

// largestGap is the largest unmapped range below 128 TiB in /proc/self/maps and where it starts.
func largestGap(t *testing.T) (size, at uint64) {
	b, err := os.ReadFile("/proc/self/maps")
	require.NoError(t, err)
	var prev uint64
	for _, line := range strings.Split(string(b), "\n") {
		var lo, hi uint64
		if _, err := fmt.Sscanf(line, "%x-%x", &lo, &hi); err != nil || lo >= 1<<47 {
			continue
		}
		if lo > prev && lo-prev > size {
			size, at = lo-prev, prev
		}
		prev = max(prev, hi)
	}
	if prev < 1<<47 && 1<<47-prev > size {
		size, at = 1<<47-prev, prev
	}
	return size, at
}
