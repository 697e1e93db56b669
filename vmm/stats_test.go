package vmm_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/vmm"
)

// statsDelta is the change of a few per-device figures between two snapshots.
type statsDelta struct {
	reserved, created, mapped, plain, visible, pageTables int64
	byKind                                                map[string]int64
}

func deltaOf(before, after vmm.Stats, ordinal int) statsDelta {
	b, a := before.Devices[ordinal], after.Devices[ordinal]
	d := statsDelta{
		reserved:   int64(a.ReservedBytes) - int64(b.ReservedBytes),
		created:    int64(a.CreatedBytes) - int64(b.CreatedBytes),
		mapped:     int64(a.MappedBytes) - int64(b.MappedBytes),
		plain:      int64(a.PlainBytes) - int64(b.PlainBytes),
		visible:    int64(a.HostVisibleBytes) - int64(b.HostVisibleBytes),
		pageTables: int64(a.PageTableBytes) - int64(b.PageTableBytes),
		byKind:     map[string]int64{},
	}
	for k, v := range a.MappedByKind {
		if n := int64(v) - int64(b.MappedByKind[k]); n != 0 {
			d.byKind[k] = n
		}
	}
	for k, v := range b.MappedByKind {
		if _, ok := a.MappedByKind[k]; !ok {
			d.byKind[k] = -int64(v)
		}
	}
	return d
}

func calls(st vmm.Stats, ordinal int, op vmm.Op) uint64 { return st.Devices[ordinal].Ops[op].Calls }

func TestStatsDeviceMemory(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		before := b.Sys.Stats()
		require.Len(t, before.Devices, b.Sys.DeviceCount())
		require.True(t, before.Devices[1].Opened)

		r, err := b.Sys.Reserve(16*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		m0, err := r.MapNew(0, 4*mib, d0, vmm.AllocOptions{}, vmm.ReadWrite(d0))
		require.NoError(t, err)
		a1, err := d1.Allocate(2*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		m1, err := r.MapAccess(4*mib, a1, vmm.ReadWrite(d1))
		require.NoError(t, err)
		plain, err := d1.AllocPlain(3 * mib)
		require.NoError(t, err)
		s, err := d0.NewStream(true)
		require.NoError(t, err)

		mid := b.Sys.Stats()
		reserver := 0 // the system reserves through its lowest open device
		require.Equal(t, int64(16*mib), deltaOf(before, mid, reserver).reserved)
		require.Equal(t, statsDelta{created: 4 * mib, mapped: 4 * mib, byKind: map[string]int64{vmm.KindVMM: 4 * mib}},
			withoutReserved(deltaOf(before, mid, 0)))
		require.Equal(t, statsDelta{created: 2 * mib, mapped: 2 * mib, plain: 3 * mib, byKind: map[string]int64{vmm.KindVMM: 2 * mib}},
			withoutReserved(deltaOf(before, mid, 1)))
		require.Equal(t, before.Devices[0].Live.Streams+1, mid.Devices[0].Live.Streams)
		require.Equal(t, before.Devices[1].Live.PlainBuffers+1, mid.Devices[1].Live.PlainBuffers)
		require.Equal(t, before.Devices[0].LiveOwners+3, mid.Devices[0].LiveOwners, "the reservation, the allocation MapNew made, the stream")
		require.Equal(t, before.Devices[1].LiveOwners+2, mid.Devices[1].LiveOwners, "the allocation and the plain buffer")
		require.Equal(t, before.Devices[0].LiveOwnersByKind["stream"]+1, mid.Devices[0].LiveOwnersByKind["stream"])
		require.Equal(t, before.Devices[1].LiveOwnersByKind["plain buffer"]+1, mid.Devices[1].LiveOwnersByKind["plain buffer"])
		require.Equal(t, calls(before, 0, vmm.OpCreate)+1, calls(mid, 0, vmm.OpCreate))
		require.Equal(t, calls(before, 1, vmm.OpCreate)+1, calls(mid, 1, vmm.OpCreate))
		require.Equal(t, calls(before, 1, vmm.OpMap)+1, calls(mid, 1, vmm.OpMap), "a mapping is counted on the device of its allocation")
		require.Equal(t, before.Devices[1].Ops[vmm.OpCreate].Bytes+2*mib, mid.Devices[1].Ops[vmm.OpCreate].Bytes)

		// Marking the reservation moves its mappings to the new kind.
		r.SetKind("growbuf")
		marked := b.Sys.Stats()
		require.Equal(t, map[string]int64{"growbuf": 4 * mib, vmm.KindVMM: -4 * mib}, deltaOf(mid, marked, 0).byKind)
		require.Equal(t, map[string]int64{"growbuf": 2 * mib, vmm.KindVMM: -2 * mib}, deltaOf(mid, marked, 1).byKind)

		require.NoError(t, s.Close())
		require.NoError(t, plain.Close())
		require.NoError(t, m1.Close())
		require.NoError(t, a1.Close())
		require.NoError(t, m0.Close())
		require.NoError(t, r.Close())
		after := b.Sys.Stats()
		for o := range 2 {
			require.Equal(t, statsDelta{byKind: map[string]int64{}}, deltaOf(before, after, o), "device %d back to where it started", o)
			require.Equal(t, before.Devices[o].LiveOwners, after.Devices[o].LiveOwners)
			require.Equal(t, before.Devices[o].Live, after.Devices[o].Live)
		}
		require.Equal(t, calls(mid, 0, vmm.OpUnmap)+2, calls(after, 0, vmm.OpUnmap), "both unmaps go through the reservation's device")
	}, testutil.Devices(2))
}

func withoutReserved(d statsDelta) statsDelta {
	d.reserved = 0
	return d
}

func TestStatsExportImportCopies(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, m := mapFilled(t, d, 4*mib, 3)
		before := b.Sys.Stats()
		f, err := m.Allocation().Export(driver.HandleTypePosixFD)
		require.NoError(t, err)
		imp, err := d.Import(f, m.Size(), driver.HandleTypePosixFD)
		require.NoError(t, err)
		require.NoError(t, f.Close())
		r2, err := b.Sys.Reserve(imp.Size(), vmm.ReserveOptions{})
		require.NoError(t, err)
		m2, err := r2.MapAccess(0, imp, vmm.ReadWrite(d))
		require.NoError(t, err)
		out := make([]byte, mib)
		require.NoError(t, d.CopyDtoH(out, m2.Ptr()))
		require.NoError(t, d.Copy(m.Ptr(), m2.Ptr(), 2*mib))

		mid := b.Sys.Stats()
		dl := deltaOf(before, mid, 0)
		require.Equal(t, map[string]int64{vmm.KindImported: 4 * mib}, dl.byKind)
		require.Zero(t, dl.created, "an import is no new memory")
		require.Equal(t, calls(before, 0, vmm.OpExport)+1, calls(mid, 0, vmm.OpExport))
		require.Equal(t, calls(before, 0, vmm.OpImport)+1, calls(mid, 0, vmm.OpImport))
		require.Equal(t, calls(before, 0, vmm.OpCopy)+2, calls(mid, 0, vmm.OpCopy))
		require.Equal(t, before.Devices[0].Ops[vmm.OpCopy].Bytes+3*mib, mid.Devices[0].Ops[vmm.OpCopy].Bytes)
		require.Greater(t, mid.Devices[0].Ops[vmm.OpCopy].Time, before.Devices[0].Ops[vmm.OpCopy].Time)

		require.NoError(t, m2.Close())
		require.NoError(t, imp.Close())
		require.NoError(t, r2.Close())
		require.NoError(t, m.Close())
		require.NoError(t, r.Close())
		require.Equal(t, statsDelta{created: -4 * mib, mapped: -4 * mib, reserved: -4 * mib, byKind: map[string]int64{vmm.KindVMM: -4 * mib}},
			deltaOf(before, b.Sys.Stats(), 0))
	})
}

// Pinned host memory and the page tables it costs: registrations and cuMemHostAlloc buffers are
// visible to every opened device, a host-NUMA mapping only to the devices granted access. The
// simulator has two devices; on a GPU host the second device's part runs when there is one.
func TestStatsPinnedAndPageTables(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0 := b.Device(t, 0)
		var d1 *vmm.Device
		if b.Sys.DeviceCount() > 1 {
			d1 = b.Device(t, 1)
		}
		free := freeMemory(t, b)
		before := b.Sys.Stats()

		mem, err := unix.Mmap(-1, 0, 64*mib, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		defer unix.Munmap(mem)
		reg, err := d0.HostRegister(mem, 0)
		require.NoError(t, err)
		host, err := d0.HostAlloc(32*mib, driver.HostAllocPortable)
		require.NoError(t, err)
		numa, r, m := mapHostNUMA(t, b, d0, 16*mib)

		mid := b.Sys.Stats()
		require.Equal(t, before.Host.RegisteredBytes+64*mib, mid.Host.RegisteredBytes)
		require.Equal(t, before.Host.HostAllocBytes+32*mib, mid.Host.HostAllocBytes)
		require.Equal(t, before.Host.NUMACreatedBytes+numa, mid.Host.NUMACreatedBytes)
		require.Equal(t, before.Host.NUMAMappedBytes+numa, mid.Host.NUMAMappedBytes)
		require.Equal(t, before.Host.PinnedBytes+96*mib+numa, mid.Host.PinnedBytes)
		require.Equal(t, int64(96*mib+numa), deltaOf(before, mid, 0).visible)
		require.Equal(t, int64((96*mib+numa)/512), deltaOf(before, mid, 0).pageTables, "2 MiB per GiB")
		if d1 != nil {
			require.Equal(t, int64(96*mib), deltaOf(before, mid, 1).visible, "the host-NUMA mapping is not granted to device 1")
			require.Equal(t, int64(96*mib/512), deltaOf(before, mid, 1).pageTables)
		}
		if b.IsSim() {
			// The simulator charges the same page tables in cuMemGetInfo.
			now := freeMemory(t, b)
			for o := range now {
				require.Equal(t, int64(mid.Devices[o].PageTableBytes-before.Devices[o].PageTableBytes), int64(free[o])-int64(now[o]), "device %d", o)
			}
		}

		if m != nil && d1 != nil {
			require.NoError(t, m.SetAccess(vmm.ReadWrite(d1)))
			require.Equal(t, int64(96*mib+numa), deltaOf(before, b.Sys.Stats(), 1).visible, "granted to device 1 now")
		}
		if m != nil {
			require.NoError(t, m.Close())
			require.NoError(t, r.Close())
		}
		require.NoError(t, host.Close())
		require.NoError(t, reg.Close())
		after := b.Sys.Stats()
		require.Equal(t, before.Host, after.Host)
		require.Zero(t, deltaOf(before, after, 0).pageTables)
	}, testutil.SimOptions(sim.Devices(2)))
}

// freeMemory is cuMemGetInfo's free bytes of every device, by ordinal.
func freeMemory(t *testing.T, b *testutil.Backend) []uint64 {
	t.Helper()
	out := make([]uint64, b.Sys.DeviceCount())
	for o := range out {
		f, _, err := b.Device(t, o).MemInfo()
		require.NoError(t, err)
		out[o] = f
	}
	return out
}

// mapHostNUMA maps size bytes of host-NUMA memory granted to d and the CPU, when d supports it
// (size 0 and nil otherwise).
func mapHostNUMA(t *testing.T, b *testutil.Backend, d *vmm.Device, size uint64) (uint64, *vmm.Reservation, *vmm.Mapping) {
	t.Helper()
	node := d.HostNUMAID()
	if node < 0 || !d.Supports(driver.AttrHostNUMAVirtualMemoryManagementSupported) {
		return 0, nil, nil
	}
	r, err := b.Sys.Reserve(size, vmm.ReserveOptions{})
	require.NoError(t, err)
	m, err := r.MapNew(0, size, d, vmm.AllocOptions{Location: driver.HostNUMALocation(node)}, vmm.ReadWrite(d), vmm.HostReadWrite())
	require.NoError(t, err)
	return size, r, m
}

// Stats may be taken while other goroutines map and unmap; the figures return to where they were.
func TestStatsConcurrent(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		before := b.Sys.Stats()
		done := make(chan struct{})
		go func() {
			defer close(done)
			for range 50 {
				_ = b.Sys.Stats()
			}
		}()
		errs := make(chan error, 4)
		for range 4 {
			go func() {
				r, err := b.Sys.Reserve(8*mib, vmm.ReserveOptions{})
				if err != nil {
					errs <- err
					return
				}
				for i := range 10 {
					m, err := r.MapNew(uint64(i%4)*2*mib, 2*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
					if err == nil {
						err = m.Close()
					}
					if err != nil {
						errs <- err
						return
					}
				}
				errs <- r.Close()
			}()
		}
		for range 4 {
			require.NoError(t, <-errs)
		}
		<-done
		after := b.Sys.Stats()
		require.Equal(t, statsDelta{byKind: map[string]int64{}}, deltaOf(before, after, 0))
		require.Equal(t, calls(before, 0, vmm.OpCreate)+40, calls(after, 0, vmm.OpCreate))
		require.Equal(t, before.Devices[0].Live, after.Devices[0].Live)
	})
}

// System.Close frees the kernels' counter words and the pattern lanes' streams: Stats of the closed
// System no longer reports them.
func TestStatsAfterCloseWithKernels(t *testing.T) {
	s, sys, d := ownSim(t)
	r, err := sys.Reserve(2*mib, vmm.ReserveOptions{})
	require.NoError(t, err)
	m, err := r.MapNew(0, 2*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
	require.NoError(t, err)
	require.NoError(t, d.Fill(m.Ptr(), 2*mib, 0, 1))
	require.NoError(t, m.Close())
	require.NoError(t, r.Close())
	require.NoError(t, sys.Close())
	require.True(t, s.Live().Zero(), s.Live().String())
	ds := sys.Stats().Devices[0]
	require.Zero(t, ds.PlainBytes, "the kernels' counter words are freed")
	require.Equal(t, vmm.LiveObjects{}, ds.Live, "nothing the System made is left")
}
