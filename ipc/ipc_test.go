package ipc_test

import (
	"encoding/binary"
	"io"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// exportSendReceive exports buf, sends it over a socket pair and receives it.
func exportSendReceive(t *testing.T, buf vmm.Chunked) *ipc.Received {
	t.Helper()
	a, b := testutil.SocketPair(t)
	e, err := ipc.Export(buf)
	require.NoError(t, err)
	require.NoError(t, ipc.Send(a, e))
	require.NoError(t, e.Close())
	require.NoError(t, e.Close(), "Close is idempotent")
	r, err := ipc.Receive(b)
	require.NoError(t, err)
	t.Cleanup(func() { r.Close() })
	return r
}

func TestShareDeviceMemory(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		src := newBuffer(t, dev, 4, 2*mib, driver.Location{}, 11, 1) // a hole after chunk 1
		r := exportSendReceive(t, src)
		require.Equal(t, uint64(10*mib), r.Desc.Size)
		require.Len(t, r.Desc.Chunks, 4)
		require.Len(t, r.Files, 4)
		for i, c := range r.Desc.Chunks {
			require.Equal(t, src.Chunks()[i].Offset, c.Offset)
			require.Equal(t, uint64(2*mib), c.Size)
			require.Equal(t, dev.Location(), c.Location)
			require.Equal(t, driver.HandleTypePosixFD, c.HandleType)
			require.True(t, isCloexec(t, r.Files[i]))
		}

		buf, err := ipc.Open(dev, r)
		require.NoError(t, err)
		require.NoError(t, r.Close(), "the files are not needed once the buffer is open")
		require.Equal(t, uint64(10*mib), buf.Len())
		require.NotEqual(t, src.Ptr(), buf.Ptr(), "the receiver has its own range")
		require.Len(t, buf.Chunks(), 4)
		verifyChunks(t, dev, buf, 11)

		// The receiver writes; the exporter sees it: the same physical memory.
		fillChunks(t, dev, buf, 12)
		verifyChunks(t, dev, src, 12)

		// Read-only access is the receiver's choice too.
		require.NoError(t, buf.SetAccess(vmm.ReadOnly(dev)))
		m := buf.Reservation().Mappings()[0]
		flags, err := m.Access(dev.Location())
		require.NoError(t, err)
		require.Equal(t, driver.AccessRead, flags)

		// Lifetime: the exporter closes its buffer; the importer's mapping stays valid.
		src.Close(t)
		verifyChunks(t, dev, buf, 12)

		// A received buffer cannot be exported again: imported memory reports no handle types (on
		// the driver, measured, and in the simulator, even for an import in the exporting process).
		_, err = ipc.Export(buf)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.ErrorContains(t, err, "handle types none")
		require.NoError(t, buf.Close())
		require.NoError(t, buf.Close(), "Close is idempotent")
		require.ErrorIs(t, buf.SetAccess(vmm.ReadWrite(dev)), vmm.ErrClosed)
		require.Empty(t, buf.Chunks(), "a closed buffer lists no allocations")
		var nilBuf *ipc.Buffer
		require.NoError(t, nilBuf.Close())
	})
}

func TestShareHostMemory(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		node := dev.HostNUMAID()
		if node < 0 || !dev.Supports(driver.AttrHostNUMAVirtualMemoryManagementSupported) {
			t.Skipf("device reports no host-NUMA VMM support (host NUMA id %d)", node)
		}
		loc := driver.HostNUMALocation(node)
		src := newBuffer(t, dev, 3, 2*mib, loc, 21)
		r := exportSendReceive(t, src)
		for _, c := range r.Desc.Chunks {
			require.Equal(t, loc, c.Location)
		}
		// The receiver grants its device and the CPU.
		buf, err := ipc.Open(dev, r, vmm.ReadWrite(dev), vmm.HostReadWrite())
		require.NoError(t, err)
		require.NoError(t, r.Close())
		verifyChunks(t, dev, buf, 21)
		for _, w := range []uint64{0, 1, (6*mib)/8 - 1} {
			require.Equal(t, expectWord(w, 21), hostWord(buf.Ptr()+driver.DevicePtr(8*w)), "word %d through the CPU", w)
		}
		// The exporter's CPU sees what the receiver's device writes.
		fillChunks(t, dev, buf, 22)
		require.Equal(t, expectWord(5, 22), hostWord(src.Ptr()+40))
		require.NoError(t, buf.Close())
	})
}

// Bad input on the receiving side: a clear error, every descriptor closed, nothing mapped.
func TestReceiveBadInput(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		src := newBuffer(t, dev, 2, 2*mib, driver.Location{}, 0)
		desc := ipc.Descriptor{Size: 4 * mib, Chunks: []ipc.ChunkDesc{
			{Offset: 0, Size: 2 * mib, Location: dev.Location(), HandleType: driver.HandleTypePosixFD},
			{Offset: 2 * mib, Size: 2 * mib, Location: dev.Location(), HandleType: driver.HandleTypePosixFD},
		}}
		payload, err := desc.MarshalBinary()
		require.NoError(t, err)
		e, err := ipc.Export(src)
		require.NoError(t, err)
		defer e.Close()

		t.Run("chunk table disagrees with the descriptors", func(t *testing.T) {
			for _, n := range []int{1, 3} {
				a, c := testutil.SocketPair(t)
				files := []*os.File{e.Files[0], e.Files[1], e.Files[0]}[:n]
				require.NoError(t, ipc.WriteMessage(a, ipc.KindBuffer, payload, files))
				_, err := ipc.Receive(c)
				require.ErrorIs(t, err, ipc.ErrProtocol, "%d descriptors", n)
				if n == 1 {
					require.ErrorContains(t, err, "chunk table disagrees")
				} else {
					require.ErrorContains(t, err, "nobody asked for")
				}
			}
		})
		t.Run("wrong kind", func(t *testing.T) {
			a, c := testutil.SocketPair(t)
			require.NoError(t, ipc.WriteMessage(a, ipc.KindUser, payload, e.Files))
			_, err := ipc.Receive(c)
			require.ErrorIs(t, err, ipc.ErrProtocol)
			require.ErrorContains(t, err, "unexpected message kind")
		})
		t.Run("bad descriptor", func(t *testing.T) {
			a, c := testutil.SocketPair(t)
			bad := append([]byte(nil), payload...)
			bad[0] = 'X'
			require.NoError(t, ipc.WriteMessage(a, ipc.KindBuffer, bad, e.Files))
			_, err := ipc.Receive(c)
			require.ErrorIs(t, err, ipc.ErrProtocol)
			require.ErrorContains(t, err, "magic")
		})
		t.Run("error reply with descriptors", func(t *testing.T) {
			a, c := testutil.SocketPair(t)
			require.NoError(t, ipc.WriteMessage(a, ipc.KindError, []byte{1, 0, 'x'}, e.Files[:1]))
			_, err := ipc.Receive(c)
			require.ErrorIs(t, err, ipc.ErrProtocol)
			require.ErrorContains(t, err, "nobody asked for")
		})
		t.Run("peer closes mid-message", func(t *testing.T) {
			a, c := testutil.SocketPair(t)
			msg := append(ipc.EncodeHeader(ipc.KindBuffer, uint32(len(payload)), 2), payload[:10]...)
			rawSend(t, a, msg, int(e.Files[0].Fd()), int(e.Files[1].Fd()))
			require.NoError(t, a.Close())
			_, err := ipc.Receive(c)
			require.ErrorIs(t, err, io.ErrUnexpectedEOF)
			require.ErrorContains(t, err, "peer closed the connection")
		})
		t.Run("a descriptor that is not a CUDA handle", func(t *testing.T) {
			pr, _ := pipe(t)
			a, c := testutil.SocketPair(t)
			require.NoError(t, ipc.WriteMessage(a, ipc.KindBuffer, payload, []*os.File{e.Files[0], pr}))
			r, err := ipc.Receive(c)
			require.NoError(t, err, "the transport cannot tell; the driver does")
			_, err = ipc.Open(dev, r)
			require.Error(t, err)
			require.ErrorContains(t, err, "chunk 1 of 2")
			require.ErrorContains(t, err, "import")
			require.NoError(t, r.Close())
			if b.IsSim() {
				live := b.Sim.Live()
				require.Equal(t, 1, live.Reservations, "only the exporter's reservation: %s", live)
				require.Equal(t, 2, live.Mappings, "only the exporter's mappings: %s", live)
			}
		})
		t.Run("sizes that lie", func(t *testing.T) {
			lie := desc
			lie.Chunks = []ipc.ChunkDesc{desc.Chunks[0], {Offset: 2 * mib, Size: 4 * mib, Location: dev.Location(), HandleType: driver.HandleTypePosixFD}}
			lie.Size = 6 * mib
			_, err := ipc.Open(dev, &ipc.Received{Desc: lie, Files: e.Files})
			require.Error(t, err)
			require.ErrorContains(t, err, "chunk 1 of 2")
			if b.IsSim() {
				require.Equal(t, 2, b.Sim.Live().Mappings)
			}
		})
		t.Run("files and chunks disagree", func(t *testing.T) {
			_, err := ipc.Open(dev, &ipc.Received{Desc: desc, Files: e.Files[:1]})
			require.ErrorIs(t, err, ipc.ErrProtocol)
			_, err = ipc.Open(nil, &ipc.Received{Desc: desc, Files: e.Files})
			require.ErrorIs(t, err, vmm.ErrInvalidValue)
		})
		t.Run("export of memory without a posix-fd handle type", func(t *testing.T) {
			res, err := b.Sys.Reserve(4*mib, vmm.ReserveOptions{})
			require.NoError(t, err)
			m1, err := res.MapNew(0, 2*mib, dev, vmm.AllocOptions{HandleTypes: driver.HandleTypePosixFD}, vmm.ReadWrite(dev))
			require.NoError(t, err)
			m2, err := res.MapNew(2*mib, 2*mib, dev, vmm.AllocOptions{}, vmm.ReadWrite(dev))
			require.NoError(t, err)
			_, err = ipc.Export(ipc.FromReservation(res))
			require.ErrorIs(t, err, vmm.ErrInvalidValue)
			require.ErrorContains(t, err, "export chunk 1 of 2")
			require.NoError(t, m1.Close())
			require.NoError(t, m2.Close())
			_, err = ipc.Export(ipc.FromReservation(res))
			require.ErrorIs(t, err, vmm.ErrInvalidValue)
			require.ErrorContains(t, err, "no chunks")
			require.NoError(t, res.Close())
		})
	})
}

// A failure at any step of Open, for the first chunk or a later one, leaves nothing behind.
func TestOpenFaultInjection(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		// Five chunks, with a hole after chunk 2: two runs, so two cuMemSetAccess calls.
		src := newBuffer(t, dev, 5, 2*mib, driver.Location{}, 5, 2)
		r := exportSendReceive(t, src)
		base := b.Sim.Live()
		for _, f := range []struct {
			fn string
			n  int
		}{
			{"cuMemAddressReserve", 1},
			{"cuMemImportFromShareableHandle", 1},
			{"cuMemImportFromShareableHandle", 4},
			{"cuMemGetAllocationPropertiesFromHandle", 3},
			{"cuMemMap", 1},
			{"cuMemMap", 5},
			{"cuMemSetAccess", 1},
			{"cuMemSetAccess", 2},
		} {
			b.Sim.FailNth(f.fn, f.n, driver.ErrorOutOfMemory)
			buf, err := ipc.Open(dev, r)
			require.Nil(t, buf)
			require.ErrorIs(t, err, driver.ErrOutOfMemory, "%s #%d", f.fn, f.n)
			if f.fn != "cuMemAddressReserve" {
				require.ErrorContains(t, err, f.fn)
				require.ErrorContains(t, err, "chunk ")
			}
			require.Equal(t, base, b.Sim.Live(), "after %s failed on call %d", f.fn, f.n)
		}
		buf, err := ipc.Open(dev, r)
		require.NoError(t, err)
		verifyChunks(t, dev, buf, 5)
		require.NoError(t, buf.Close())
		require.Equal(t, base, b.Sim.Live())

		// Export fails on the third chunk: the two files made are closed.
		fds := testutil.OpenFDs(t)
		b.Sim.FailNth("cuMemExportToShareableHandle", 3, driver.ErrorOutOfMemory)
		_, err = ipc.Export(src)
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.ErrorContains(t, err, "export chunk 2 of 5")
		require.Equal(t, fds, testutil.OpenFDs(t))
	}, testutil.SimOnly())
}

// More chunks than one message carries descriptors: continuation messages.
func TestShareManyChunks(t *testing.T) {
	const gran = 64 << 10
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		n := ipc.MaxFDsPerMessage + 17
		src := newBuffer(t, dev, n, gran, driver.Location{}, 0)
		fillChunks(t, dev, src, 3)
		r := exportSendReceive(t, src)
		require.Len(t, r.Files, n)
		buf, err := ipc.Open(dev, r)
		require.NoError(t, err)
		require.NoError(t, r.Close())
		verifyChunks(t, dev, buf, 3)
		require.NoError(t, buf.Close())

		// A continuation for the wrong chunk index is refused, and everything received is closed.
		e, err := ipc.Export(src)
		require.NoError(t, err)
		defer e.Close()
		payload, err := e.Desc.MarshalBinary()
		require.NoError(t, err)
		a, c := testutil.SocketPair(t)
		fds := testutil.OpenFDs(t)
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = ipc.WriteMessage(a, ipc.KindBuffer, payload, e.Files[:ipc.MaxFDsPerMessage])
			var idx [4]byte
			binary.LittleEndian.PutUint32(idx[:], 7)
			_ = ipc.WriteMessage(a, ipc.KindFDs, idx[:], e.Files[:ipc.MaxFDsPerMessage])
		}()
		_, err = ipc.Receive(c)
		<-done
		require.ErrorIs(t, err, ipc.ErrProtocol)
		require.ErrorContains(t, err, "continuation for the wrong chunk")
		require.Equal(t, fds, testutil.OpenFDs(t))
	}, testutil.SimOnly(), testutil.SimOptions(sim.Granularity(gran)))
}

func TestFabricFallback(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		typ, err := ipc.HandleTypes(dev, driver.Location{})
		require.NoError(t, err)
		require.NotZero(t, typ&driver.HandleTypePosixFD, "posix-fd is always requested")
		a, err := ipc.Allocate(dev, 3*mib, driver.Location{})
		require.NoError(t, err)
		require.Equal(t, typ, a.HandleTypes(), "Allocate and HandleTypes agree")
		require.Equal(t, uint64(4*mib), a.Size())
		f, err := a.Export(driver.HandleTypePosixFD)
		require.NoError(t, err)
		require.NoError(t, f.Close())
		require.NoError(t, a.Close())
		if b.IsSim() {
			// The simulator, like the H200 host, reports fabric support and refuses it at create.
			require.Equal(t, driver.HandleTypePosixFD, typ)
			require.True(t, b.Sim.Live().Zero() || b.Sim.Live().Allocations == 0, "the refused probe left nothing: %s", b.Sim.Live())
		}
		t.Logf("%s: shareable memory gets handle types %s", b.Name, typ)
	})
}

func TestFabricGrantedAndRefused(t *testing.T) {
	t.Run("granted", func(t *testing.T) {
		testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
			dev := b.Device(t, 0)
			want := driver.HandleTypeFabric | driver.HandleTypePosixFD
			typ, err := ipc.HandleTypes(dev, driver.Location{})
			require.NoError(t, err)
			require.Equal(t, want, typ)
			require.Zero(t, b.Sim.Live().Allocations, "the probe is released")
			a, err := ipc.Allocate(dev, 2*mib, driver.Location{})
			require.NoError(t, err)
			require.Equal(t, want, a.HandleTypes())
			require.NoError(t, a.Close())

			// The driver refuses this time (an IMEX channel gone): fall back, nothing leaked.
			b.Sim.FailNth("cuMemCreate", 1, driver.ErrorNotPermitted)
			a, err = ipc.Allocate(dev, 2*mib, driver.Location{})
			require.NoError(t, err)
			require.Equal(t, driver.HandleTypePosixFD, a.HandleTypes())
			require.Equal(t, 1, b.Sim.Live().Allocations)
			require.NoError(t, a.Close())
			b.Sim.FailNth("cuMemCreate", 1, driver.ErrorNotPermitted)
			typ, err = ipc.HandleTypes(dev, driver.Location{})
			require.NoError(t, err)
			require.Equal(t, driver.HandleTypePosixFD, typ)

			// Out of memory is not a refusal of FABRIC: no fallback.
			b.Sim.FailNth("cuMemCreate", 1, driver.ErrorOutOfMemory)
			_, err = ipc.Allocate(dev, 2*mib, driver.Location{})
			require.ErrorIs(t, err, driver.ErrOutOfMemory)
			require.Zero(t, b.Sim.Live().Allocations)
		}, testutil.SimOnly(), testutil.SimOptions(sim.EnableFabric()))
	})
	t.Run("not reported", func(t *testing.T) {
		testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
			dev := b.Device(t, 0)
			calls := b.Sim.Calls("cuMemCreate")
			typ, err := ipc.HandleTypes(dev, driver.Location{})
			require.NoError(t, err)
			require.Equal(t, driver.HandleTypePosixFD, typ)
			require.Equal(t, calls, b.Sim.Calls("cuMemCreate"), "no probe without the attribute")
		}, testutil.SimOnly(), testutil.SimOptions(sim.Attribute(0, driver.AttrHandleTypeFabricSupported, 0)))
	})
}
