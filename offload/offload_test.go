package offload_test

import (
	"encoding/binary"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/stripe"
	"github.com/cuvmm/cuvmm/vmm"
)

// TestSleepWakeKeep is the promise: the memory goes back to the driver, and after the wake a kernel
// launched with the pointer saved before the sleep, and a graph captured before it, read the
// restored bytes.
func TestSleepWakeKeep(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		const size = 24 * mib
		buf := newBuf(t, d, size, 8*mib, 11, nil)
		ptr := buf.Ptr()

		// A graph that verifies the buffer into a counter, captured while it is awake.
		st, err := d.CreateStream(vmm.StreamOptions{NonBlocking: true})
		require.NoError(t, err)
		defer func() { require.NoError(t, st.Close()) }()
		counter, err := d.AllocPlain(8)
		require.NoError(t, err)
		defer func() { require.NoError(t, counter.Close()) }()
		require.NoError(t, st.BeginCapture())
		require.NoError(t, d.LaunchVerify(ptr, size, 0, 11, counter.Ptr(), st))
		g, err := st.EndCapture()
		require.NoError(t, err)
		exec, err := g.Instantiate()
		require.NoError(t, err)
		require.NoError(t, g.Close())
		defer func() { require.NoError(t, exec.Close()) }()

		set := newSet(t, b, offload.Options{})
		require.NoError(t, set.Add("weights", buf, offload.Keep, offload.EntryOptions{}))
		before := free(t, d)
		require.NoError(t, set.Sleep(bg))
		require.True(t, set.Asleep("weights"))
		freed := free(t, d) - before
		if b.IsSim() {
			require.GreaterOrEqual(t, freed, uint64(size)*99/100, "free memory rises by the bytes slept")
		} else {
			require.GreaterOrEqual(t, freed+4*mib, uint64(size), "free memory rises by the bytes slept (4 MiB for page tables)")
		}
		require.NoError(t, set.Sleep(bg), "Sleep of a sleeping set is a no-op")

		require.NoError(t, set.Wake(bg))
		require.False(t, set.Asleep("weights"))
		require.Equal(t, ptr, buf.Ptr(), "Ptr unchanged")
		requirePattern(t, d, ptr, size, 11)
		require.NoError(t, set.Wake(bg), "Wake of an awake set is a no-op")

		require.NoError(t, d.Memset(counter.Ptr(), 0, 8))
		require.NoError(t, exec.Launch(st))
		require.NoError(t, st.Synchronize())
		var c [8]byte
		require.NoError(t, d.CopyDtoH(c[:], counter.Ptr()))
		require.Zero(t, binary.LittleEndian.Uint64(c[:]), "the graph captured before the sleep reads the restored bytes")

		// Warm: the pool already holds the slots.
		pooled := set.BackupBytes()
		require.GreaterOrEqual(t, pooled, uint64(size))
		require.NoError(t, d.Fill(ptr, size, 0, 12))
		require.NoError(t, set.Sleep(bg, "weights"))
		require.Equal(t, pooled, set.BackupBytes(), "a warm sleep pins nothing new")
		require.NoError(t, set.Wake(bg, "weights"))
		requirePattern(t, d, ptr, size, 12)
		require.NoError(t, buf.Grow(size+8*mib), "the buffer keeps working after the wake")
	})
}

func TestDiscardAndFile(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		kv := newBuf(t, d, 8*mib, 4*mib, 3, nil)
		scratch := newBuf(t, d, 4*mib, 2*mib, 4, nil)
		ckpt := newBuf(t, d, 12*mib, 4*mib, 5, nil)
		f, err := os.CreateTemp(t.TempDir(), "offload")
		require.NoError(t, err)
		defer f.Close()
		var prog []uint64
		set := newSet(t, b, offload.Options{SlotSize: 2 * mib, Progress: func(done, total uint64) { prog = append(prog, done) }})
		require.NoError(t, set.Add("kv", kv, offload.Discard, offload.EntryOptions{}))
		require.NoError(t, set.Add("scratch", scratch, offload.Discard, offload.EntryOptions{NoZero: true}))
		require.NoError(t, set.Add("ckpt", ckpt, offload.File, offload.EntryOptions{File: f, FileOffset: 4096}))
		require.NoError(t, set.Sleep(bg))
		st, err := f.Stat()
		require.NoError(t, err)
		require.Equal(t, int64(4096+12*mib), st.Size())
		require.NotEmpty(t, prog)
		require.Equal(t, uint64(12*mib), prog[len(prog)-1], "progress ends at the bytes written")

		// The file holds the pattern: wake it into a buffer that lost it.
		require.NoError(t, set.Wake(bg, "ckpt"))
		requirePattern(t, d, ckpt.Ptr(), 12*mib, 5)
		require.True(t, set.Asleep("kv"))
		require.NoError(t, set.Wake(bg))
		requireZero(t, d, kv.Ptr(), 8*mib)
		require.NoError(t, d.Fill(scratch.Ptr(), 4*mib, 0, 9), "an uninitialized discard buffer is usable")
	})
}

// TestFileIOWorkers sleeps and wakes a File buffer with 1, 3 and 16 I/O goroutines (more goroutines
// than parts included): the file and the woken buffer hold the same bytes.
func TestFileIOWorkers(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		for i, workers := range []int{1, 3, 16} {
			buf := newBuf(t, d, 12*mib, 4*mib, uint64(40+i), nil)
			f, err := os.CreateTemp(t.TempDir(), "io")
			require.NoError(t, err)
			set := newSet(t, b, offload.Options{SlotSize: 8 * mib, IOWorkers: workers})
			require.NoError(t, set.Add("f", buf, offload.File, offload.EntryOptions{File: f}))
			require.NoError(t, set.Sleep(bg))
			require.NoError(t, set.Wake(bg))
			requirePattern(t, d, buf.Ptr(), 12*mib, uint64(40+i))
			require.NoError(t, f.Close())
		}
	})
}

// TestTwoDevicesAndHostNUMA sleeps a set mixing two devices, a striped range, a read-only peer and a
// host-NUMA buffer the CPU reads: all at once, and every access comes back.
func TestTwoDevicesAndHostNUMA(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0 := b.Device(t, 0)
		d1 := b.Device(t, 1)
		a := newBuf(t, d0, 8*mib, 4*mib, 21, readOnlyPeer(d1))
		c := newBuf(t, d1, 8*mib, 2*mib, 22, nil)
		set := newSet(t, b, offload.Options{})
		require.NoError(t, set.Add("a", a, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Add("c", c, offload.Keep, offload.EntryOptions{}))
		host := addHostBuf(t, set, d0)
		before := []uint64{free(t, d0), free(t, d1)}
		require.NoError(t, set.Sleep(bg))
		require.Greater(t, free(t, d0), before[0]+4*mib)
		require.Greater(t, free(t, d1), before[1]+4*mib)
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d0, a.Ptr(), 8*mib, 21)
		requirePattern(t, d1, c.Ptr(), 8*mib, 22)
		requirePattern(t, d1, a.Ptr(), 8*mib, 21) // the read-only peer reads again
		require.Error(t, d1.Memset(a.Ptr(), 0, 8), "and still may not write")
		if host != nil {
			require.Equal(t, "host-numa content", string(vmm.HostView(host.Ptr(), 17)), "the CPU reads through the same address")
		}
	}, testutil.Devices(2))
}

func readOnlyPeer(d *vmm.Device) *growbuf.Options {
	return &growbuf.Options{Peers: []growbuf.Peer{{Device: d, ReadOnly: true}}}
}

// writeHost writes msg at the start of host-NUMA memory the CPU may write.
// (A byte loop, not copy: go1.26's compiler crashes on a copy into memory from an integer address
// it can see through.)
func writeHost(p driver.DevicePtr, msg string) {
	b := vmm.HostView(p, uint64(len(msg)))
	for i := range len(msg) {
		b[i] = msg[i]
	}
}

// addHostBuf adds a host-NUMA buffer with a message for the CPU to the set, when the device
// supports host-NUMA memory (else it returns nil).
func addHostBuf(t *testing.T, set *offload.Set, d *vmm.Device) *growbuf.Buffer {
	if !pinnedHostNUMA(d) {
		return nil
	}
	opts := new(growbuf.Options)
	opts.Location = hostNUMA(d)
	host := newBuf(t, d, 4*mib, 2*mib, 0, opts)
	writeHost(host.Ptr(), "host-numa content")
	require.NoError(t, set.Add("host", host, offload.Keep, offload.EntryOptions{}))
	return host
}

// TestStripeAndMappings sleeps a range striped over two devices and a bare reservation's mappings.
func TestStripeAndMappings(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0 := b.Device(t, 0)
		d1 := b.Device(t, 1)
		r, err := stripe.New([]*vmm.Device{d0, d1}, 16*mib, stripe.Interleaved{Stripe: 4 * mib}, stripe.Options{})
		require.NoError(t, err)
		defer func() { require.NoError(t, r.Close()) }()
		require.NoError(t, d0.Fill(r.Ptr(), 16*mib, 0, 61))

		res, err := b.Sys.Reserve(8*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, res.Close()) }()
		for off := uint64(0); off < 8*mib; off += 4 * mib {
			m, err := res.MapNew(off, 4*mib, d1, vmm.AllocOptions{}, vmm.ReadWrite(d1))
			require.NoError(t, err)
			defer func() { require.NoError(t, m.Close()) }()
		}
		require.NoError(t, d1.Fill(res.Ptr(), 8*mib, 0, 62))

		set := newSet(t, b, offload.Options{})
		require.NoError(t, set.Add("striped", r, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Add("mappings", offload.Mappings(res), offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Sleep(bg))
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d1, r.Ptr(), 16*mib, 61) // every device reads the whole range again
		requirePattern(t, d0, r.Ptr(), 16*mib, 61)
		requirePattern(t, d1, res.Ptr(), 8*mib, 62)
	}, testutil.Devices(2))
}

// TestPrepare pins the backup ahead of time: the first Sleep pins nothing more.
func TestPrepare(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		w := newBuf(t, d, 12*mib, 4*mib, 71, nil)
		kv := newBuf(t, d, 4*mib, 4*mib, 72, nil)
		set := newSet(t, b, offload.Options{SlotSize: 8 * mib})
		require.NoError(t, set.Add("w", w, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Add("kv", kv, offload.Discard, offload.EntryOptions{}))
		require.ErrorIs(t, set.Prepare(bg, "nope"), offload.ErrInvalidValue)
		require.NoError(t, set.Prepare(bg))
		require.Equal(t, uint64(16*mib), set.BackupBytes(), "two 8 MiB slots for the Keep buffer, none for Discard")
		require.NoError(t, set.Prepare(bg), "again: nothing more")
		require.Equal(t, uint64(16*mib), set.BackupBytes())
		require.NoError(t, set.Sleep(bg))
		require.Equal(t, uint64(16*mib), set.BackupBytes(), "the sleep used the prepared slots")
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, w.Ptr(), 12*mib, 71)
		require.NoError(t, set.TrimPool())
		require.Zero(t, set.BackupBytes())
	})
}
