package pinned_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// regionCase makes one region of each way, with what closing it needs afterwards.
type regionCase struct {
	name string
	make func(t *testing.T, d *vmm.Device, size uint64) (*pinned.Region, func())
}

var regionCases = []regionCase{
	{"host-numa", func(t *testing.T, d *vmm.Device, size uint64) (*pinned.Region, func()) {
		if !pinned.SupportsHostNUMA(d) {
			t.Skip("the device reports no host-NUMA VMM support")
		}
		r, err := pinned.New(d, size, pinned.Options{Kind: pinned.HostNUMA})
		require.NoError(t, err)
		return r, func() {}
	}},
	{"shared-memory", func(t *testing.T, d *vmm.Device, size uint64) (*pinned.Region, func()) {
		r, err := pinned.New(d, size, pinned.Options{Kind: pinned.SharedMemory, Name: "pinned-test"})
		require.NoError(t, err)
		return r, func() {}
	}},
	{"registered", func(t *testing.T, d *vmm.Device, size uint64) (*pinned.Region, func()) {
		mem, err := pinned.MapAnonymous(size)
		require.NoError(t, err)
		r, err := pinned.Register(d, mem, pinned.RegisterOptions{HugePages: true})
		require.NoError(t, err)
		return r, func() { require.NoError(t, pinned.Unmap(mem)) }
	}},
}

// Every kind: the CPU view and the device address are the same bytes, and copies work both ways.
func TestRegionKinds(t *testing.T) {
	for _, rc := range regionCases {
		t.Run(rc.name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				d := b.Device(t, 0)
				const size = 4 * mib
				r, done := rc.make(t, d, size)
				defer done()
				require.Equal(t, uint64(size), r.Len())
				require.Len(t, r.Bytes(), size)
				require.True(t, r.VisibleTo(d))
				require.Contains(t, r.String(), r.Kind().String())

				// CPU writes, the GPU reads through the device address.
				fillCPU(r.Bytes(), 0, 1)
				bad, err := d.Verify(r.Ptr(), size, 0, 1)
				require.NoError(t, err)
				require.Zero(t, bad, "the GPU sees what the CPU wrote")

				// The GPU writes, the CPU reads.
				require.NoError(t, d.Fill(r.Ptr()+mib, mib, mib, 2))
				require.Zero(t, badWords(r.Bytes()[mib:2*mib], mib, 2))
				require.Zero(t, badWords(r.Bytes()[:mib], 0, 1), "the rest is untouched")

				// Asynchronous copies both ways through a device buffer.
				dev, free := deviceBuffer(t, d, 2*mib)
				defer free()
				s, err := d.NewStream(true)
				require.NoError(t, err)
				defer func() { require.NoError(t, s.Close()) }()
				require.NoError(t, r.CopyToDevice(s, dev, 0, 2*mib))
				require.NoError(t, s.Synchronize())
				bad, err = d.Verify(dev, mib, 0, 1)
				require.NoError(t, err)
				require.Zero(t, bad)
				require.NoError(t, d.Fill(dev, 2*mib, 0, 3))
				require.NoError(t, r.CopyFromDevice(s, dev, 2*mib, 2*mib))
				require.NoError(t, s.Synchronize())
				require.Zero(t, badWords(r.Bytes()[2*mib:], 0, 3))

				require.ErrorIs(t, r.CopyToDevice(s, dev, 3*mib, 2*mib), pinned.ErrInvalidValue, "past the end")
				require.ErrorIs(t, r.CopyToDevice(nil, dev, 0, mib), pinned.ErrInvalidValue)
				require.NoError(t, r.Close())
				require.NoError(t, r.Close(), "Close is idempotent")
				require.ErrorIs(t, r.CopyFromDevice(s, dev, 0, mib), pinned.ErrClosed)
			})
		})
	}
	var nilRegion *pinned.Region
	require.NoError(t, nilRegion.Close())
}

// The estimated page-table cost per device is what cuMemGetInfo shows: registrations cost every
// device, host-NUMA regions only the granted ones, CPU-only regions nothing.
func TestPageTableCost(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		// On the simulator the figures are exact; the GPU keeps page tables in blocks, so a large
		// region and a tolerance are used there.
		size, slack := uint64(64*mib), int64(0)
		if !b.IsSim() {
			size, slack = 1<<30, 4*mib
		}
		check := func(name string, r *pinned.Region, before []uint64, want []uint64) {
			t.Helper()
			require.Equal(t, want, r.PageTableCost(), name)
			got := used(before, freeMemory(t, b.Sys))
			t.Logf("%s: estimated %v, measured %v", name, want, got)
			for i := range want {
				require.InDelta(t, float64(want[i]), float64(got[i]), float64(slack), "%s: device %d", name, i)
			}
		}
		cost := pinned.PageTableCost(size)
		require.Equal(t, size/512, cost, "2 MiB per GiB")
		// vec is the expected cost per device of the system: devices 0 and 1, then every other one.
		vec := func(c0, c1, rest uint64) []uint64 {
			v := make([]uint64, b.Sys.DeviceCount())
			for i := range v {
				v[i] = rest
			}
			v[0], v[1] = c0, c1
			return v
		}

		if pinned.SupportsHostNUMA(d0) {
			before := freeMemory(t, b.Sys)
			r, err := pinned.New(d0, size, pinned.Options{Kind: pinned.HostNUMA})
			require.NoError(t, err)
			check("host-numa granted to device 0", r, before, vec(cost, 0, 0))
			require.Equal(t, []int{0}, r.Devices())
			require.False(t, r.VisibleTo(d1))
			require.NoError(t, r.Grant(d1))
			check("host-numa granted to both", r, before, vec(cost, cost, 0))
			require.Equal(t, 2*cost, r.TotalPageTableCost())
			require.NoError(t, r.Revoke(d0))
			check("host-numa granted to device 1", r, before, vec(0, cost, 0))
			require.NoError(t, r.Close())

			before = freeMemory(t, b.Sys)
			r, err = pinned.New(d0, size, pinned.Options{Kind: pinned.HostNUMA, CPUOnly: true})
			require.NoError(t, err)
			check("host-numa for the CPU only", r, before, vec(0, 0, 0))
			require.Empty(t, r.Devices())
			fillCPU(r.Bytes()[:mib], 0, 4)
			require.Zero(t, badWords(r.Bytes()[:mib], 0, 4), "the CPU view works without any device")
			require.NoError(t, r.Close())
		}

		before := freeMemory(t, b.Sys)
		r, err := pinned.New(d0, size, pinned.Options{Kind: pinned.SharedMemory})
		require.NoError(t, err)
		check("shared memory registered", r, before, vec(cost, cost, cost))
		all := make([]int, b.Sys.DeviceCount())
		for i := range all {
			all[i] = i
		}
		require.Equal(t, all, r.Devices(), "a registration is visible to every device")
		require.ErrorIs(t, r.Grant(d1), pinned.ErrNotSupported, "a registration is visible to every device already")
		require.NoError(t, r.Close())

		before = freeMemory(t, b.Sys)
		r, err = pinned.New(d0, size, pinned.Options{Kind: pinned.SharedMemory, CPUOnly: true})
		require.NoError(t, err)
		check("shared memory not registered", r, before, vec(0, 0, 0))
		require.NoError(t, r.Close())

		mem, err := pinned.MapAnonymous(size)
		require.NoError(t, err)
		defer func() { require.NoError(t, pinned.Unmap(mem)) }()
		before = freeMemory(t, b.Sys)
		r, err = pinned.Register(d1, mem, pinned.RegisterOptions{ReadOnly: true})
		require.NoError(t, err)
		check("registered read-only", r, before, vec(cost, cost, cost))
		require.True(t, r.ReadOnly())
		require.NoError(t, r.Close())
		require.InDelta(t, 0, float64(used(before, freeMemory(t, b.Sys))[0]), float64(slack), "closing gives the page tables back")
	}, testutil.Devices(2))
}

// Read-only registration: devices read, and may not write.
func TestRegisterReadOnly(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		mem, err := pinned.MapAnonymous(2 * mib)
		require.NoError(t, err)
		defer func() { require.NoError(t, pinned.Unmap(mem)) }()
		fillCPU(mem, 0, 9)
		r, err := pinned.Register(d, mem, pinned.RegisterOptions{ReadOnly: true, Progress: func(done, total uint64) {}})
		require.NoError(t, err)
		defer func() { require.NoError(t, r.Close()) }()
		bad, err := d.Verify(r.Ptr(), 2*mib, 0, 9)
		require.NoError(t, err)
		require.Zero(t, bad)
		dev, free := deviceBuffer(t, d, 2*mib)
		defer free()
		require.NoError(t, d.Copy(dev, r.Ptr(), 2*mib), "host to device reads the registered memory")
		if b.IsSim() {
			// The real driver reports a device write to read-only memory asynchronously and may
			// leave the context unusable, so only the simulator checks the refusal.
			require.Error(t, d.Copy(r.Ptr(), dev, 2*mib), "device to host would write read-only memory")
		}
		// A stager refuses a read-only region for device-to-host transfers.
		pool, err := pinned.NewPool(r, mib, 2)
		require.NoError(t, err)
		st, err := pinned.NewStager(d, pinned.StagerOptions{Pool: pool})
		require.NoError(t, err)
		_, err = st.DeviceToWriter(t.Context(), discard{}, dev, mib)
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		require.NoError(t, st.Close())
		require.NoError(t, pool.Close())
	})
}

// Memory mapped read-only, registered for writing: Register's populate must not write to the
// pages (which would crash the process), and the driver (the simulator too) refuses it.
func TestRegisterWritableOfReadOnlyMemory(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		mem, err := unix.Mmap(-1, 0, 4*mib, unix.PROT_READ, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		defer func() { require.NoError(t, unix.Munmap(mem)) }()
		_, err = pinned.Register(d, mem, pinned.RegisterOptions{HugePages: true})
		require.Error(t, err, "the driver refuses read-only memory registered writable")
	})
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// A host-NUMA region of several chunks is one contiguous range for the CPU and the GPU, and reports
// its chunks for export.
func TestHostNUMAChunks(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		if !pinned.SupportsHostNUMA(d) {
			t.Skip("the device reports no host-NUMA VMM support")
		}
		var steps []uint64
		r, err := pinned.New(d, 7*mib, pinned.Options{ChunkSize: 2 * mib, Progress: func(done, total uint64) {
			require.Equal(t, uint64(8*mib), total)
			steps = append(steps, done)
		}})
		require.NoError(t, err)
		defer func() { require.NoError(t, r.Close()) }()
		require.Equal(t, pinned.HostNUMA, r.Kind(), "Auto picks host-NUMA where supported")
		require.Equal(t, uint64(8*mib), r.Len(), "rounded up to the 2 MiB granularity")
		require.Equal(t, []uint64{0, 2 * mib, 4 * mib, 6 * mib, 8 * mib}, steps)
		chunks := r.Chunks()
		require.Len(t, chunks, 4)
		for i, c := range chunks {
			require.Equal(t, uint64(i)*2*mib, c.Offset)
			require.Equal(t, driver.LocationHostNUMA, c.Allocation.Location().Type)
		}
		require.NoError(t, d.Fill(r.Ptr(), r.Len(), 0, 5))
		require.Zero(t, badWords(r.Bytes(), 0, 5), "one pattern across every chunk")
		_, err = pinned.New(d, 7*mib, pinned.Options{ChunkSize: 3 * mib})
		require.ErrorIs(t, err, pinned.ErrInvalidValue, "chunk size not a multiple of the granularity")
	})
}

// Without host-NUMA support Auto falls back to shared memory, and HostNUMA says why it cannot.
func TestHostNUMAFallback(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		require.False(t, pinned.SupportsHostNUMA(d))
		r, err := pinned.New(d, mib, pinned.Options{})
		require.NoError(t, err)
		require.Equal(t, pinned.SharedMemory, r.Kind())
		require.Equal(t, uint64(mib), r.Len())
		require.NoError(t, r.Close())
		_, err = pinned.New(d, mib, pinned.Options{Kind: pinned.HostNUMA})
		require.ErrorIs(t, err, pinned.ErrNotSupported)
		require.ErrorContains(t, err, "host-NUMA")
	}, testutil.SimOnly(), testutil.SimOptions(sim.Attribute(0, driver.AttrHostNUMAVirtualMemoryManagementSupported, 0)))
}

// A failure at any step of making a region leaves nothing behind (the leak check of testutil counts
// simulator objects and file descriptors).
func TestRegionRollback(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		for _, fn := range []string{"cuMemCreate", "cuMemMap", "cuMemSetAccess"} {
			b.Sim.FailNth(fn, 2, driver.ErrorOutOfMemory) // the second chunk fails
			_, err := pinned.New(d, 6*mib, pinned.Options{Kind: pinned.HostNUMA, ChunkSize: 2 * mib})
			require.ErrorIs(t, err, driver.ErrOutOfMemory, fn)
			if fn == "cuMemCreate" {
				require.ErrorContains(t, err, "create 2 MiB at host NUMA node 0")
				require.ErrorContains(t, err, "chunk at offset", "chunks are created on several threads")
			} else {
				require.ErrorContains(t, err, fn)
				require.ErrorContains(t, err, "chunk 1 of 3 (offset 0x200000)")
			}
			live := b.Sim.Live()
			require.True(t, live.Zero() || live == sim.Live{Contexts: 1}, "after a failed %s: %s", fn, live)
		}
		for _, fn := range []string{"cuMemHostRegister", "cuMemHostGetDevicePointer"} {
			b.Sim.FailNth(fn, 1, driver.ErrorOutOfMemory)
			_, err := pinned.New(d, mib, pinned.Options{Kind: pinned.SharedMemory})
			require.ErrorIs(t, err, driver.ErrOutOfMemory, fn)
			require.Zero(t, b.Sim.Live().HostRegistrations, fn)
		}
		b.Sim.FailNth("cuMemHostRegister", 1, driver.ErrorOutOfMemory)
		_, err := pinned.CreatePool(d, mib, 2, pinned.Options{Kind: pinned.SharedMemory})
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
	}, testutil.SimOnly())
}

// Every bad input gives a clear error wrapping a sentinel.
func TestBadInput(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		_, err := pinned.New(nil, mib, pinned.Options{})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		_, err = pinned.New(d, 0, pinned.Options{})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		require.ErrorContains(t, err, "size 0")
		_, err = pinned.New(d, mib, pinned.Options{Kind: pinned.Registered})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		require.ErrorContains(t, err, "Register")
		_, err = pinned.New(d, mib, pinned.Options{Kind: pinned.Kind(42)})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		_, err = pinned.New(d, mib, pinned.Options{Grant: []*vmm.Device{nil}})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)

		mem, err := unix.Mmap(-1, 0, 4*mib, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		defer func() { require.NoError(t, unix.Munmap(mem)) }()

		// Unaligned and zero-length registration.
		_, err = pinned.Register(d, mem[1:4097], pinned.RegisterOptions{})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		require.ErrorContains(t, err, "page")
		_, err = pinned.Register(d, mem[:4095], pinned.RegisterOptions{})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		_, err = pinned.Register(d, mem[:0], pinned.RegisterOptions{})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		require.ErrorContains(t, err, "zero-length")
		_, err = pinned.Register(d, nil, pinned.RegisterOptions{})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		_, err = pinned.Register(nil, mem, pinned.RegisterOptions{})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)

		// The same memory twice, whole or in part (driver 712).
		r, err := pinned.Register(d, mem[:2*mib], pinned.RegisterOptions{HugePages: true})
		require.NoError(t, err)
		_, err = pinned.Register(d, mem[:2*mib], pinned.RegisterOptions{})
		require.ErrorIs(t, err, pinned.ErrAlreadyRegistered)
		require.ErrorContains(t, err, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED")
		_, err = pinned.Register(d, mem[mib:3*mib], pinned.RegisterOptions{})
		require.ErrorIs(t, err, pinned.ErrAlreadyRegistered, "an overlapping range")

		// Unregistering memory a live region owns, and memory nobody registered (driver 713).
		require.ErrorIs(t, pinned.Unregister(d, mem[:2*mib]), pinned.ErrInUse)
		err = pinned.Unregister(d, mem[2*mib:])
		require.ErrorIs(t, err, pinned.ErrNotRegistered)
		require.ErrorContains(t, err, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED")
		require.ErrorIs(t, pinned.Unregister(d, nil), pinned.ErrInvalidValue)
		require.ErrorIs(t, pinned.Unregister(nil, mem), pinned.ErrInvalidValue)

		// Registered memory has no per-device access and no file to share.
		require.ErrorIs(t, r.Grant(d), pinned.ErrNotSupported)
		require.ErrorIs(t, r.Revoke(d), pinned.ErrNotSupported)
		require.ErrorIs(t, r.Share(nil), pinned.ErrNotSupported)
		require.Empty(t, r.Chunks())
		require.NoError(t, r.Close())
		require.ErrorIs(t, r.Grant(d), pinned.ErrClosed)

		// After Close the memory is the caller's again, and can be registered anew.
		r, err = pinned.Register(d, mem[:2*mib], pinned.RegisterOptions{})
		require.NoError(t, err)
		require.NoError(t, r.Close())
		require.ErrorIs(t, pinned.Unregister(d, mem[:2*mib]), pinned.ErrNotRegistered, "unregistering twice")

		// Pools: bad sizes, and a region that is too small.
		r, err = pinned.New(d, mib, pinned.Options{})
		require.NoError(t, err)
		_, err = pinned.NewPool(r, 0, 2)
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		_, err = pinned.NewPool(r, 4*kib, 0)
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		_, err = pinned.NewPool(r, 512*kib, 5) // 2 MiB or 1 MiB: either way too small
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		require.ErrorContains(t, err, "left")
		_, err = pinned.NewPool(nil, 4*kib, 1)
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		_, err = pinned.CreatePool(d, 1<<62, 8, pinned.Options{})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		require.NoError(t, r.Close())
		_, err = pinned.NewPool(r, 4*kib, 1)
		require.ErrorIs(t, err, pinned.ErrClosed)
		_, err = pinned.MapAnonymous(0)
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
	})
}

func TestKindString(t *testing.T) {
	for k, want := range map[pinned.Kind]string{pinned.Auto: "auto", pinned.HostNUMA: "host-numa",
		pinned.SharedMemory: "shared-memory", pinned.Registered: "registered", pinned.Kind(9): "kind(9)"} {
		require.Equal(t, want, fmt.Sprint(k))
	}
}

// Auto asks the driver which kind to make: a device that reports no host-NUMA support gets
// SharedMemory, and a query that fails is an error, not a silent fallback.
func TestAutoKindQueryFails(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		b.Sim.FailNth("cuDeviceGetAttribute", 1, driver.ErrorUnknown)
		_, err := pinned.New(d, mib, pinned.Options{})
		require.Error(t, err)
		require.NotErrorIs(t, err, pinned.ErrNotSupported)
		require.ErrorContains(t, err, "cannot tell whether")
		r, err := pinned.New(d, mib, pinned.Options{})
		require.NoError(t, err)
		require.Equal(t, pinned.HostNUMA, r.Kind())
		require.NoError(t, r.Close())
	}, testutil.SimOnly())
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, err := pinned.New(d, mib, pinned.Options{})
		require.NoError(t, err)
		require.Equal(t, pinned.SharedMemory, r.Kind())
		require.NoError(t, r.Close())
		_, err = pinned.New(d, mib, pinned.Options{Kind: pinned.HostNUMA})
		require.ErrorIs(t, err, pinned.ErrNotSupported)
		var u *vmm.UnsupportedError
		require.ErrorAs(t, err, &u)
	}, testutil.SimOnly(), testutil.SimOptions(sim.Attribute(0, driver.AttrHostNUMAVirtualMemoryManagementSupported, 0)))
}

// Drivers from 12.2 to 12.8 make host-NUMA allocations but do not know the attribute that says
// whether they may: Auto makes the kind every driver supports there, and an invalid-value answer
// of a newer driver is still an error.
func TestAutoKindOnADriverTooOldToAsk(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		require.NotErrorIs(t, d.Check(vmm.FeatureHostNUMA), pinned.ErrNotSupported, "the driver cannot be asked")
		r, err := pinned.New(d, mib, pinned.Options{})
		require.NoError(t, err)
		require.Equal(t, pinned.SharedMemory, r.Kind())
		require.NoError(t, r.Close())
		s, err := pinned.NewStager(d, pinned.StagerOptions{})
		require.NoError(t, err)
		require.NoError(t, s.Close())
	}, testutil.SimOnly(), testutil.SimOptions(sim.DriverVersion(12080)))
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		b.Sim.FailNth("cuDeviceGetAttribute", 1, driver.ErrorInvalidValue)
		_, err := pinned.New(b.Device(t, 0), mib, pinned.Options{})
		require.ErrorContains(t, err, "cannot tell whether")
	}, testutil.SimOnly())
}

// TestRegistrationVisibleToOpenedDevices: a registration reaches, and costs page tables on, the
// devices whose contexts the process holds, as vmm.Stats counts them; a device opened later is
// reached too.
func TestRegistrationVisibleToOpenedDevices(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0 := b.Device(t, 0) // device 1 is not opened yet
		r, err := pinned.New(d0, 64*mib, pinned.Options{Kind: pinned.SharedMemory})
		require.NoError(t, err)
		defer func() { require.NoError(t, r.Close()) }()
		cost := pinned.PageTableCost(64 * mib)
		require.Equal(t, []int{0}, r.Devices())
		require.Equal(t, []uint64{cost, 0}, r.PageTableCost())
		st := b.Sys.Stats()
		require.Equal(t, []uint64{cost, 0}, []uint64{st.Devices[0].PageTableBytes, st.Devices[1].PageTableBytes})

		d1 := b.Device(t, 1)
		require.Equal(t, []int{0, 1}, r.Devices())
		require.True(t, r.VisibleTo(d1))
		require.Equal(t, []uint64{cost, cost}, r.PageTableCost())
		st = b.Sys.Stats()
		require.Equal(t, []uint64{cost, cost}, []uint64{st.Devices[0].PageTableBytes, st.Devices[1].PageTableBytes})
	}, testutil.Devices(2), testutil.SimOnly())
}

// A Close that fails after freeing part of a HostNUMA region leaves a region nobody can use: Bytes
// is nil (its memory is partly unmapped), copies and Chunks refuse, and a later Close frees the rest.
func TestRegionCloseFailsHalfway(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, err := pinned.New(d, 6*mib, pinned.Options{Kind: pinned.HostNUMA, ChunkSize: 2 * mib})
		require.NoError(t, err)
		require.Len(t, r.Bytes(), 6*mib)
		b.Sim.FailNth("cuMemUnmap", 2, driver.ErrorUnknown) // the last chunk goes, the one before it fails
		require.ErrorIs(t, r.Close(), driver.ErrorUnknown)
		require.Nil(t, r.Bytes(), "its last chunk is unmapped: no view of it")
		require.Empty(t, r.Chunks())
		require.Empty(t, r.Devices())
		require.ErrorIs(t, r.Grant(d), pinned.ErrClosed)
		_, err = r.PrepareShare()
		require.ErrorIs(t, err, pinned.ErrClosed)
		_, err = pinned.NewPool(r, mib, 2)
		require.ErrorIs(t, err, pinned.ErrClosed)
		st, err := d.NewStream(true)
		require.NoError(t, err)
		defer func() { require.NoError(t, st.Close()) }()
		dev, err := d.AllocPlain(mib)
		require.NoError(t, err)
		defer func() { require.NoError(t, dev.Close()) }()
		require.ErrorIs(t, r.CopyToDevice(st, dev.Ptr(), 0, mib), pinned.ErrClosed)
		require.NoError(t, r.Close())
		require.NoError(t, r.Close())
	}, testutil.SimOnly())
}
