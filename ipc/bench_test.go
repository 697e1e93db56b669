package ipc_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// benchSystem opens the simulator or the real driver for a benchmark.
func benchSystem(b *testing.B, backend string) *vmm.System {
	b.Helper()
	if backend == "sim" {
		s := sim.New(sim.Devices(1))
		sys, err := vmm.Open(s)
		require.NoError(b, err)
		b.Cleanup(func() {
			require.NoError(b, sys.Close())
			require.NoError(b, s.Close())
		})
		return sys
	}
	api, err := driver.Open()
	var sys *vmm.System
	if err == nil {
		sys, err = vmm.Open(api)
	}
	if err == nil && sys.DeviceCount() == 0 {
		err = driver.ErrNoDevice
	}
	if err != nil {
		if testutil.RequireGPU() {
			b.Fatalf("CUVMM_REQUIRE_GPU=1 but the real driver is not usable: %v", err)
		}
		b.Skipf("real driver not usable here: %v", err)
	}
	b.Cleanup(func() { require.NoError(b, sys.Close()) })
	return sys
}

// BenchmarkShare1GiB8Chunks measures sharing a 1 GiB buffer of 8 chunks end to end: export, send
// over a Unix socket, receive, import, reserve, map and set access (in one process over a socket
// pair; vmmdemo share measures the two-process version). us/share is that time; us/raw is the raw
// driver sequence for the same chunks without the socket and the checks (export, import, reserve,
// map, one set access); x-raw is their ratio. Target on the H200 host: us/share <= 2000.
func BenchmarkShare1GiB8Chunks(b *testing.B) {
	for _, backend := range []string{"sim", "cuda"} {
		for _, where := range []string{"device", "host"} {
			b.Run(backend+"/"+where, func(b *testing.B) { benchShare(b, backend, where == "host") })
		}
	}
}

func benchShare(b *testing.B, backend string, host bool) {
	const chunks, chunkSize = 8, 128 << 20
	sys := benchSystem(b, backend)
	dev, err := sys.Device(0)
	require.NoError(b, err)
	loc := driver.Location{}
	if host {
		if dev.HostNUMAID() < 0 || !dev.Supports(driver.AttrHostNUMAVirtualMemoryManagementSupported) {
			b.Skip("device reports no host-NUMA VMM support")
		}
		loc = driver.HostNUMALocation(dev.HostNUMAID())
	}
	src := newBuffer(b, dev, chunks, chunkSize, loc, 0)
	a, c := testutil.SocketPair(b)
	access := vmm.ReadWrite(dev)

	var share, raw time.Duration
	n := 0
	for b.Loop() {
		t0 := time.Now()
		e, err := ipc.Export(src)
		require.NoError(b, err)
		require.NoError(b, ipc.Send(a, e))
		r, err := ipc.Receive(c)
		require.NoError(b, err)
		buf, err := ipc.Open(dev, r, access)
		require.NoError(b, err)
		share += time.Since(t0)
		require.NoError(b, e.Close())
		require.NoError(b, r.Close())
		require.NoError(b, buf.Close())

		raw += rawShare(b, dev, src, access)
		n++
	}
	perShare := float64(share.Microseconds()) / float64(n)
	perRaw := float64(raw.Microseconds()) / float64(n)
	b.ReportMetric(perShare, "us/share")
	b.ReportMetric(perRaw, "us/raw")
	if perRaw > 0 {
		b.ReportMetric(perShare/perRaw, "x-raw")
	}
}

// rawShare times the bare driver sequence for src's chunks and undoes it (untimed).
func rawShare(b *testing.B, dev *vmm.Device, src vmm.Chunked, access vmm.Access) time.Duration {
	chunks := src.Chunks()
	var el time.Duration
	err := dev.Raw(func(api driver.API) error {
		t0 := time.Now()
		handles := make([]driver.MemHandle, len(chunks))
		fds := make([]int, 0, len(chunks))
		defer func() {
			for _, fd := range fds {
				unix.Close(fd)
			}
		}()
		for i, ch := range chunks {
			fd, err := api.MemExportToShareableHandle(ch.Allocation.Handle(), driver.HandleTypePosixFD, 0)
			if err != nil {
				return err
			}
			fds = append(fds, fd)
			if handles[i], err = api.MemImportFromShareableHandle(fd, driver.HandleTypePosixFD); err != nil {
				return err
			}
		}
		ptr, err := api.MemAddressReserve(src.Len(), 0, 0, 0)
		if err != nil {
			return err
		}
		for i, ch := range chunks {
			if err := api.MemMap(ptr+driver.DevicePtr(ch.Offset), ch.Allocation.Size(), 0, handles[i], 0); err != nil {
				return err
			}
		}
		if err := api.MemSetAccess(ptr, src.Len(), []driver.AccessDesc{{Location: access.Location, Flags: access.Flags}}); err != nil {
			return err
		}
		el = time.Since(t0)
		if err := api.MemUnmap(ptr, src.Len()); err != nil {
			return err
		}
		for _, h := range handles {
			if err := api.MemRelease(h); err != nil {
				return err
			}
		}
		return api.MemAddressFree(ptr, src.Len())
	})
	require.NoError(b, err)
	return el
}
