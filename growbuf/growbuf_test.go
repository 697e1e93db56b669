package growbuf_test

import (
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/pattern"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/vmm"
)

const mib = 1 << 20

// fill writes the pattern over [from, to) of buf, as one continuous pattern from offset 0.
func fill(t *testing.T, d *vmm.Device, buf *growbuf.Buffer, from, to, seed uint64) {
	t.Helper()
	require.NoError(t, d.Fill(buf.Ptr()+driver.DevicePtr(from), to-from, from, seed))
}

// verify checks [0, n) of buf against the pattern with the verify kernel of d.
func verify(t *testing.T, d *vmm.Device, buf *growbuf.Buffer, n, seed uint64) {
	t.Helper()
	bad, err := d.Verify(buf.Ptr(), n, 0, seed)
	require.NoError(t, err)
	require.Zero(t, bad, "words of [0, %d) that lost their content", n)
}

// state is everything a failed call must leave as it was.
type state struct {
	Ptr                driver.DevicePtr
	Len, Cap, Reserved uint64
	Reservations       int
	Chunks             []vmm.Chunk
}

func stateOf(buf *growbuf.Buffer) state {
	return state{buf.Ptr(), buf.Len(), buf.Cap(), buf.Reserved(), buf.Reservations(), buf.Chunks()}
}

func chunkSizes(buf *growbuf.Buffer) []uint64 {
	var out []uint64
	for _, c := range buf.Chunks() {
		out = append(out, c.Allocation.Size()/mib)
	}
	return out
}

func closeBuf(t *testing.T, buf *growbuf.Buffer) {
	t.Helper()
	require.NoError(t, buf.Close())
	require.NoError(t, buf.Close(), "Close is idempotent")
}

func TestGrowShrinkResize(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 64 * mib, Chunk: growbuf.FixedChunks(4 * mib)})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		ptr := buf.Ptr()
		require.NotZero(t, ptr, "the address exists before any memory")
		require.Zero(t, buf.Len())
		require.Zero(t, buf.Cap())
		require.Equal(t, uint64(64*mib), buf.Reserved())
		require.Empty(t, buf.Chunks())

		require.NoError(t, buf.Grow(5*mib))
		require.Equal(t, uint64(5*mib), buf.Len(), "Len is what was asked for")
		require.Equal(t, uint64(8*mib), buf.Cap(), "Cap is what is mapped: two 4 MiB chunks")
		fill(t, d, buf, 0, 5*mib, 1)

		creates := 0
		if b.IsSim() {
			creates = b.Sim.Calls("cuMemCreate")
		}
		require.NoError(t, buf.Grow(7*mib), "within Cap")
		require.NoError(t, buf.Grow(3*mib), "smaller than Len: nothing to do")
		require.Equal(t, uint64(7*mib), buf.Len())
		require.Equal(t, uint64(8*mib), buf.Cap())
		if b.IsSim() {
			require.Equal(t, creates, b.Sim.Calls("cuMemCreate"), "growing within Cap makes no driver call")
		}
		fill(t, d, buf, 5*mib, 7*mib, 1)

		require.NoError(t, buf.Grow(20*mib))
		require.Equal(t, ptr, buf.Ptr(), "the address is stable")
		require.Equal(t, uint64(20*mib), buf.Cap())
		require.Equal(t, []uint64{4, 4, 4, 4, 4}, chunkSizes(buf))
		for i, c := range buf.Chunks() {
			require.Equal(t, uint64(i)*4*mib, c.Offset)
			require.Equal(t, d.Location(), c.Allocation.Location())
		}
		verify(t, d, buf, 7*mib, 1)
		fill(t, d, buf, 7*mib, 20*mib, 1)
		verify(t, d, buf, 20*mib, 1)

		// Shrink releases the chunks that lie wholly past n: those at 12 and 16 MiB.
		require.NoError(t, buf.Shrink(9*mib))
		require.Equal(t, uint64(9*mib), buf.Len())
		require.Equal(t, uint64(12*mib), buf.Cap())
		require.Equal(t, uint64(64*mib), buf.Reserved(), "the addresses stay reserved")
		verify(t, d, buf, 9*mib, 1)
		require.NoError(t, buf.Shrink(9*mib), "shrinking to Len")

		require.NoError(t, buf.Resize(30*mib))
		require.Equal(t, uint64(30*mib), buf.Len())
		require.Equal(t, uint64(32*mib), buf.Cap())
		require.Equal(t, ptr, buf.Ptr())
		verify(t, d, buf, 9*mib, 1)
		require.NoError(t, buf.Resize(4*mib))
		require.Equal(t, uint64(4*mib), buf.Cap(), "the chunk at 4 MiB lies wholly past 4 MiB")
		verify(t, d, buf, 4*mib, 1)
		require.NoError(t, buf.Resize(0))
		require.Zero(t, buf.Len())
		require.Zero(t, buf.Cap())
		require.Empty(t, buf.Chunks())
		require.NoError(t, buf.Grow(2*mib))
		require.Equal(t, ptr, buf.Ptr(), "growing again after shrinking to 0 reuses the range")
	})
}

func TestDefaultPolicyIsGeometric(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, err := growbuf.New(d, growbuf.Options{})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		g := buf.Granularity()
		require.Equal(t, uint64(2*mib), g)
		require.Equal(t, growbuf.ChunkPolicy{Size: g, Max: growbuf.DefaultMaxChunk}, buf.Policy())
		want := (d.TotalMemory() + g - 1) / g * g
		require.Equal(t, want, buf.Reserved(), "the default reservation is the device's memory, rounded up")

		require.NoError(t, buf.Grow(3*mib))
		require.Equal(t, []uint64{2, 2}, chunkSizes(buf))
		require.NoError(t, buf.Grow(9*mib))
		require.Equal(t, []uint64{2, 2, 4, 8}, chunkSizes(buf), "each chunk doubles the capacity")
		require.NoError(t, buf.Grow(600*mib))
		require.Equal(t, []uint64{2, 2, 4, 8, 16, 32, 64, 128, 256, 256}, chunkSizes(buf), "up to the 256 MiB cap")
		require.Equal(t, uint64(768*mib), buf.Cap())
		fill(t, d, buf, 0, 600*mib, 4)
		verify(t, d, buf, 600*mib, 4)

		// A geometric policy of one's own.
		buf2, err := growbuf.New(d, growbuf.Options{MaxSize: 64 * mib, Chunk: growbuf.GeometricChunks(4*mib, 8*mib)})
		require.NoError(t, err)
		defer closeBuf(t, buf2)
		require.NoError(t, buf2.Grow(30*mib))
		require.Equal(t, []uint64{4, 4, 8, 8, 8}, chunkSizes(buf2))
	})
}

func TestLimit(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, err := growbuf.New(d, growbuf.Options{Limit: 10 * mib, Chunk: growbuf.FixedChunks(4 * mib)})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		require.Equal(t, uint64(10*mib), buf.Reserved(), "the default reservation stops at the limit")
		require.NoError(t, buf.Grow(9*mib))
		require.Equal(t, []uint64{4, 4, 2}, chunkSizes(buf), "the last chunk is cut at the limit")
		fill(t, d, buf, 0, 9*mib, 2)
		before := stateOf(buf)
		err = buf.Grow(10*mib + 1)
		require.ErrorIs(t, err, growbuf.ErrTooLarge)
		require.ErrorContains(t, err, "10485761")
		require.ErrorContains(t, err, "limit of 10 MiB")
		require.Equal(t, before, stateOf(buf))
		require.NoError(t, buf.Grow(10*mib))
		verify(t, d, buf, 9*mib, 2)
	})
}

func TestExtendInPlace(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		// A reservation of 64 MiB and 40 MiB chunks: the second chunk is cut at the reservation's end.
		// The extension asks for just what is needed (80 MiB, not less than the 64 MiB reserved), so it
		// holds exactly the new chunks. (A reservation under 32 MiB is never extended in place: the
		// driver keeps it in a 32 MiB block of its address heap, and the simulator does the same.)
		{
			buf, err := growbuf.New(d, growbuf.Options{MaxSize: 64 * mib, Chunk: growbuf.FixedChunks(40 * mib)})
			require.NoError(t, err)
			ptr := buf.Ptr()
			require.NoError(t, buf.Grow(64*mib))
			require.Equal(t, []uint64{40, 24}, chunkSizes(buf))
			require.Equal(t, 1, buf.Reservations())
			fill(t, d, buf, 0, 64*mib, 3)
			require.NoError(t, buf.Grow(105*mib))
			require.Equal(t, ptr, buf.Ptr(), "extended in place: same address")
			require.Equal(t, 2, buf.Reservations())
			require.Equal(t, uint64(144*mib), buf.Cap(), "40 MiB chunks from 64 MiB on")
			require.Equal(t, uint64(144*mib), buf.Reserved(), "the extension holds exactly the new chunks")
			require.Equal(t, []uint64{40, 24, 40, 40}, chunkSizes(buf))
			fill(t, d, buf, 64*mib, 105*mib, 3)
			verify(t, d, buf, 105*mib, 3) // one kernel across both reservations
			require.NoError(t, buf.Shrink(50*mib), "a shrink across two reservations")
			require.Equal(t, uint64(64*mib), buf.Cap())
			verify(t, d, buf, 50*mib, 3)
			closeBuf(t, buf)
		}

		// 64 MiB of addresses and 24 MiB chunks (24, 24, 16 up to the end of the reservation).
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 64 * mib, Chunk: growbuf.FixedChunks(24 * mib)})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		ptr := buf.Ptr()
		require.NoError(t, buf.Grow(64*mib))
		require.Equal(t, []uint64{24, 24, 16}, chunkSizes(buf))
		fill(t, d, buf, 0, 64*mib, 3)

		// The extension asks for as much again as is reserved: 64 MiB.
		require.NoError(t, buf.Grow(100*mib))
		require.Equal(t, ptr, buf.Ptr(), "extended in place: same address")
		require.Equal(t, 2, buf.Reservations())
		require.Equal(t, uint64(128*mib), buf.Reserved())
		require.Equal(t, []uint64{24, 24, 16, 24, 24}, chunkSizes(buf))
		fill(t, d, buf, 64*mib, 100*mib, 3)
		verify(t, d, buf, 100*mib, 3) // one kernel across both reservations

		// A second extension: 128 MiB (or, if that range is not free, the 72 MiB needed).
		require.NoError(t, buf.Grow(200*mib))
		require.Equal(t, 3, buf.Reservations())
		require.Equal(t, ptr, buf.Ptr())
		require.GreaterOrEqual(t, buf.Reserved(), uint64(200*mib))
		require.Equal(t, []uint64{24, 24, 16, 24, 24, 16, 24, 24, 24}, chunkSizes(buf), "cut at each reservation's end")
		fill(t, d, buf, 100*mib, 200*mib, 3)
		verify(t, d, buf, 200*mib, 3)

		require.NoError(t, buf.Shrink(30*mib), "a shrink across three reservations")
		require.Equal(t, uint64(48*mib), buf.Cap())
		require.Equal(t, 3, buf.Reservations(), "the addresses stay reserved")
		verify(t, d, buf, 30*mib, 3)
		require.NoError(t, buf.Grow(150*mib))
		require.Equal(t, 3, buf.Reservations(), "growing back uses the reservations kept")
		verify(t, d, buf, 30*mib, 3)
	})
}

// blockAfter reserves the range right after buf's reservations, so that it cannot extend in place
// by up to size bytes. A hint there may be refused all the same: at the end of a reservation under
// 32 MiB by the driver and the simulator alike (such reservations sit in 32 MiB blocks of the driver's
// address heap), and by the real driver elsewhere for reasons of its own. Then it tries one granule,
// and if that is refused too, the range is unavailable to any extension already and blockAfter
// returns nil.
func blockAfter(t *testing.T, b *testutil.Backend, buf *growbuf.Buffer, size uint64) *vmm.Reservation {
	t.Helper()
	return blockAfterIn(t, b.Sys, b.IsSim(), buf, size)
}

// blockAfterIn is blockAfter on sys, a simulator's System when isSim.
func blockAfterIn(t testing.TB, sys *vmm.System, isSim bool, buf *growbuf.Buffer, size uint64) *vmm.Reservation {
	t.Helper()
	hint := buf.Ptr() + driver.DevicePtr(buf.Reserved())
	r, err := sys.Reserve(size, vmm.ReserveOptions{Hint: hint, RequireHint: true})
	if err != nil && errors.Is(err, vmm.ErrHintNotGranted) {
		if isSim {
			// The simulator refuses a free hint only at the end of a small reservation.
			require.Equal(t, 1, buf.Reservations(), "refused at the end of the buffer: %v", err)
			require.Less(t, buf.Reserved(), uint64(32*mib), "refused at the end of the buffer: %v", err)
		}
		t.Logf("%d MiB at the end of the buffer refused: %v", size/mib, err)
		r, err = sys.Reserve(buf.Granularity(), vmm.ReserveOptions{Hint: hint, RequireHint: true})
		if errors.Is(err, vmm.ErrHintNotGranted) {
			t.Logf("and one granule: the range is not available to an extension: %v", err)
			return nil
		}
	}
	require.NoError(t, err, "reserving the range right after the buffer")
	return r
}

func TestReservationFull(t *testing.T) { testutil.Run(t, reservationFull) }

// Where the driver refuses the range after the buffer outright (out of memory) instead of placing
// it elsewhere, as it does on some machines, the grow fails the same way.
func TestReservationFullWhereTheDriverRefusesTheHint(t *testing.T) {
	testutil.Run(t, reservationFull, testutil.SimOnly(), testutil.SimOptions(sim.RefuseUngrantedHints()))
}

func reservationFull(t *testing.T, b *testutil.Backend) {
	d := b.Device(t, 0)
	buf, err := growbuf.New(d, growbuf.Options{MaxSize: 64 * mib, Chunk: growbuf.FixedChunks(16 * mib)})
	require.NoError(t, err)
	defer closeBuf(t, buf)
	// Growing to 128 MiB needs exactly 64 MiB more: the extension asks for that alone.
	blocker := blockAfter(t, b, buf, 64*mib)
	defer func() { require.NoError(t, blocker.Close()) }()
	require.NoError(t, buf.Grow(64*mib))
	fill(t, d, buf, 0, 64*mib, 5)
	before := stateOf(buf)
	var live any
	if b.IsSim() {
		live = b.Sim.Live()
	}

	err = buf.Grow(128 * mib)
	require.ErrorIs(t, err, growbuf.ErrReservationFull)
	require.ErrorIs(t, err, vmm.ErrHintNotGranted)
	require.ErrorContains(t, err, "134217728 bytes")
	require.ErrorContains(t, err, "reservation of 64 MiB")
	require.Equal(t, before, stateOf(buf), "a failed grow leaves the buffer as it was")
	if b.IsSim() {
		require.Equal(t, live, b.Sim.Live(), "nothing kept from the failed grow")
	}
	verify(t, d, buf, 64*mib, 5)
	require.NoError(t, buf.Grow(64*mib), "growing within the reservation still works")
}

func TestAllowMove(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		var moves [][2]driver.DevicePtr
		var buf *growbuf.Buffer
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 64 * mib, Chunk: growbuf.FixedChunks(16 * mib), AllowMove: true,
			OnMove: func(old, new driver.DevicePtr) {
				require.Equal(t, new, buf.Ptr(), "Ptr is the new address when OnMove runs")
				moves = append(moves, [2]driver.DevicePtr{old, new})
			}})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		blocker := blockAfter(t, b, buf, 64*mib)
		defer func() { require.NoError(t, blocker.Close()) }()
		require.NoError(t, buf.Grow(64*mib))
		fill(t, d, buf, 0, 64*mib, 6)
		old := buf.Ptr()
		oldChunks := buf.Chunks()

		require.NoError(t, buf.Grow(96*mib))
		require.NotEqual(t, old, buf.Ptr(), "the buffer moved")
		require.Equal(t, [][2]driver.DevicePtr{{old, buf.Ptr()}}, moves)
		require.Equal(t, 1, buf.Reservations())
		require.Equal(t, uint64(128*mib), buf.Reserved(), "the new range is twice the old")
		require.Equal(t, uint64(96*mib), buf.Cap())
		newChunks := buf.Chunks()
		for i, c := range oldChunks {
			require.Same(t, c.Allocation, newChunks[i].Allocation, "the same physical chunk, not a copy")
			require.Equal(t, c.Offset, newChunks[i].Offset)
		}
		verify(t, d, buf, 64*mib, 6)
		fill(t, d, buf, 64*mib, 96*mib, 6)
		verify(t, d, buf, 96*mib, 6)

		if b.IsSim() {
			// The old range is free again: a reservation there is granted. (The real driver makes
			// no promise about reusing a freed address.)
			r, err := b.Sys.Reserve(64*mib, vmm.ReserveOptions{Hint: old, RequireHint: true})
			require.NoError(t, err, "the old range was freed")
			require.NoError(t, r.Close())
		}

		require.NoError(t, buf.Grow(128*mib), "growing within the new range")
		require.Len(t, moves, 1)
		require.NoError(t, buf.Shrink(2*mib))
		verify(t, d, buf, 2*mib, 6)
	})
}

func TestConcurrentGrowAndRead(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 64 * mib})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		ptr := buf.Ptr()
		var wg sync.WaitGroup
		stop := make(chan struct{})
		errs := make(chan error, 64)
		for r := 0; r < 4; r++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					p, l, c := buf.Ptr(), buf.Len(), buf.Cap()
					if p != ptr {
						errs <- errors.New("Ptr changed during growth")
						return
					}
					if c < l {
						errs <- errors.New("Cap below Len during growth")
						return
					}
					var covered uint64
					for _, ch := range buf.Chunks() {
						if ch.Offset != covered {
							errs <- errors.New("chunks not contiguous")
							return
						}
						covered += ch.Allocation.Size()
					}
				}
			}()
		}
		var growers sync.WaitGroup
		for g := 0; g < 8; g++ {
			growers.Add(1)
			go func(seed uint64) {
				defer growers.Done()
				rng := rand.New(rand.NewPCG(seed, 1))
				for i := 0; i < 20; i++ {
					if err := buf.Grow(rng.Uint64N(100*mib) + 1); err != nil {
						errs <- err
						return
					}
				}
			}(uint64(g))
		}
		growers.Wait()
		close(stop)
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		require.Equal(t, ptr, buf.Ptr())
		require.GreaterOrEqual(t, buf.Cap(), buf.Len())
		fill(t, d, buf, 0, buf.Len()&^7, 8)
		verify(t, d, buf, buf.Len()&^7, 8)
	})
}

func TestHostNUMA(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		node := d.HostNUMAID()
		if node < 0 || !d.Supports(driver.AttrHostNUMAVirtualMemoryManagementSupported) {
			t.Skipf("device reports no host-NUMA VMM support (host NUMA id %d)", node)
		}
		buf, err := growbuf.New(d, growbuf.Options{Location: driver.HostNUMALocation(node), MaxSize: 32 * mib,
			Chunk: growbuf.FixedChunks(2 * mib), HandleTypes: driver.HandleTypePosixFD})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		require.Equal(t, driver.HostNUMALocation(node), buf.Location())
		require.NoError(t, buf.Grow(4*mib))
		fill(t, d, buf, 0, 4*mib, 7)
		host := func(n uint64) []uint64 {
			// The CPU uses the same address as the GPU.
			return unsafe.Slice((*uint64)(unsafe.Add(nil, uintptr(buf.Ptr()))), n/8)
		}
		words := host(4 * mib)
		for _, i := range []int{0, 1, len(words) - 1} {
			require.Equal(t, pattern.Word(uint64(i), 7), words[i], "the CPU reads the GPU's writes")
		}
		require.NoError(t, buf.Grow(10*mib))
		for i, c := range buf.Chunks() {
			require.Equal(t, driver.HostNUMALocation(node), c.Allocation.Location(), "chunk %d", i)
			require.Equal(t, driver.HandleTypePosixFD, c.Allocation.HandleTypes())
		}
		words = host(10 * mib)
		require.Equal(t, pattern.Word(5, 7), words[5], "old content kept")
		for i := 4 * mib / 8; i < len(words); i++ {
			words[i] = pattern.Word(uint64(i), 7) // the CPU fills the new part
		}
		verify(t, d, buf, 10*mib, 7)
		require.NoError(t, buf.Shrink(2*mib))
		verify(t, d, buf, 2*mib, 7)
	})
}

func TestReadOnlyPeer(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		ok, err := d1.CanAccessPeer(d0)
		require.NoError(t, err)
		if !ok {
			t.Skip("device 1 cannot access device 0's memory")
		}
		buf, err := growbuf.New(d0, growbuf.Options{MaxSize: 32 * mib, Chunk: growbuf.FixedChunks(2 * mib),
			Peers: []growbuf.Peer{{Device: d1, ReadOnly: true}}})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		require.NoError(t, buf.Grow(4*mib))
		fill(t, d0, buf, 0, 4*mib, 9)
		require.NoError(t, buf.Grow(8*mib))
		fill(t, d0, buf, 4*mib, 8*mib, 9)
		verify(t, d1, buf, 8*mib, 9) // the peer reads every chunk, old and new
		for _, off := range []uint64{0, 6 * mib} {
			var f0, f1 driver.AccessFlags
			require.NoError(t, d0.Raw(func(api driver.API) error {
				var err error
				if f0, err = api.MemGetAccess(d0.Location(), buf.Ptr()+driver.DevicePtr(off)); err != nil {
					return err
				}
				f1, err = api.MemGetAccess(d1.Location(), buf.Ptr()+driver.DevicePtr(off))
				return err
			}))
			require.Equal(t, driver.AccessReadWrite, f0)
			require.Equal(t, driver.AccessRead, f1)
		}
		require.Error(t, d1.Memset(buf.Ptr()+6*mib, 0, 4096), "the read-only peer cannot write")
		verify(t, d0, buf, 8*mib, 9)
		require.NoError(t, buf.Shrink(2*mib))
		verify(t, d1, buf, 2*mib, 9)
	}, testutil.Devices(2))
}

func TestReadWritePeer(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		if ok, err := d1.CanAccessPeer(d0); err != nil || !ok {
			t.Skipf("device 1 cannot access device 0's memory (%v)", err)
		}
		buf, err := growbuf.New(d0, growbuf.Options{MaxSize: 16 * mib, Peers: []growbuf.Peer{{Device: d1}}})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		require.NoError(t, buf.Grow(6*mib))
		fill(t, d1, buf, 0, 6*mib, 10) // the peer writes
		verify(t, d0, buf, 6*mib, 10)
	}, testutil.Devices(2))
}

func TestStreamSynchronizedBeforeShrink(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		s, err := d.NewStream(true)
		require.NoError(t, err)
		defer func() { require.NoError(t, s.Close()) }()
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 16 * mib, Chunk: growbuf.FixedChunks(2 * mib), Stream: s})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		require.NoError(t, buf.Grow(8*mib))
		require.NoError(t, d.LaunchRead(buf.Ptr(), 8*mib, s)) // queued work on the buffer
		if b.IsSim() {
			before := b.Sim.Calls("cuStreamSynchronize")
			ctxBefore := b.Sim.Calls("cuCtxSynchronize")
			require.NoError(t, buf.Shrink(2*mib))
			require.Equal(t, before+1, b.Sim.Calls("cuStreamSynchronize"), "Shrink waits for the stream")
			require.Equal(t, ctxBefore, b.Sim.Calls("cuCtxSynchronize"), "and only for the stream")
			require.NoError(t, buf.Shrink(1*mib), "no chunk to release: no synchronization needed")
			require.Equal(t, before+1, b.Sim.Calls("cuStreamSynchronize"))
		} else {
			require.NoError(t, buf.Shrink(2*mib))
		}
	})
}

func TestBadInput(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		bad := []struct {
			name string
			dev  *vmm.Device
			opts growbuf.Options
			want string
		}{
			{"nil device", nil, growbuf.Options{}, "nil device"},
			{"another device's location", d, growbuf.Options{Location: driver.DeviceLocation(7)}, "another device"},
			{"host location", d, growbuf.Options{Location: driver.HostLocation()}, "want the device or a host NUMA node"},
			{"negative NUMA node", d, growbuf.Options{Location: driver.HostNUMALocation(-1)}, "node -1"},
			{"unknown handle bits", d, growbuf.Options{HandleTypes: 0x40}, "unknown bits"},
			{"fixed size 0", d, growbuf.Options{Chunk: growbuf.FixedChunks(0)}, "size 0"},
			{"fixed size not a multiple", d, growbuf.Options{Chunk: growbuf.FixedChunks(3 * mib)}, "3145728 (3 MiB) is not a multiple of the granularity 2 MiB"},
			{"fixed with Max", d, growbuf.Options{Chunk: growbuf.ChunkPolicy{Fixed: true, Size: 2 * mib, Max: 4 * mib}}, "Max is for geometric"},
			{"geometric max below min", d, growbuf.Options{Chunk: growbuf.GeometricChunks(8*mib, 4*mib)}, "largest chunk 4 MiB is smaller than the smallest 8 MiB"},
			{"geometric not a multiple", d, growbuf.Options{Chunk: growbuf.GeometricChunks(1*mib, 0)}, "not a multiple"},
			{"max size overflows", d, growbuf.Options{MaxSize: ^uint64(0)}, "overflows"},
			{"limit overflows", d, growbuf.Options{Limit: ^uint64(0)}, "overflows"},
			{"nil peer", d, growbuf.Options{Peers: []growbuf.Peer{{}}}, "nil device"},
			{"peer is the device", d, growbuf.Options{Peers: []growbuf.Peer{{Device: d}}}, "owning device"},
		}
		for _, tc := range bad {
			buf, err := growbuf.New(tc.dev, tc.opts)
			require.ErrorIs(t, err, vmm.ErrInvalidValue, tc.name)
			require.ErrorContains(t, err, tc.want, tc.name)
			require.Nil(t, buf, tc.name)
		}

		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 8 * mib, Chunk: growbuf.FixedChunks(2 * mib)})
		require.NoError(t, err)
		require.NoError(t, buf.Grow(4*mib))
		fill(t, d, buf, 0, 4*mib, 11)
		before := stateOf(buf)

		err = buf.Grow(^uint64(0) - 5)
		require.ErrorIs(t, err, growbuf.ErrTooLarge, "a size that overflows when rounded")
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.ErrorContains(t, err, "18446744073709551610")
		require.Equal(t, before, stateOf(buf))

		err = buf.Shrink(4*mib + 1)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.ErrorContains(t, err, "shrink to 4194305 bytes: larger than Len 4194304")
		require.Equal(t, before, stateOf(buf))
		verify(t, d, buf, 4*mib, 11)

		require.NoError(t, buf.Close())
		require.Zero(t, buf.Ptr())
		require.Zero(t, buf.Len())
		require.Zero(t, buf.Cap())
		require.Zero(t, buf.Reserved())
		require.Empty(t, buf.Chunks())
		require.ErrorIs(t, buf.Grow(2*mib), vmm.ErrClosed)
		require.ErrorIs(t, buf.Resize(2*mib), vmm.ErrClosed)
		require.ErrorIs(t, buf.Shrink(0), vmm.ErrClosed)
		require.NoError(t, buf.Close())

		var nilBuf *growbuf.Buffer
		require.NoError(t, nilBuf.Close())
		require.ErrorIs(t, nilBuf.Grow(1), vmm.ErrInvalidValue)
	})
}

func TestPeerWithoutAccess(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		_, err := growbuf.New(d0, growbuf.Options{Peers: []growbuf.Peer{{Device: d1}}})
		require.ErrorIs(t, err, driver.ErrNotSupported)
		require.ErrorContains(t, err, "cannot access")
	}, testutil.Devices(2), testutil.SimOnly(), testutil.SimOptions(sim.PeerAccess(0, 1, false)))
}

// A stream of a device that cannot use the buffer (neither its own nor a peer, or of another
// System) would make Shrink and Close wait for the wrong work, and a closed one cannot be waited
// for at all: New refuses them before reserving anything. A peer's stream is accepted.
func TestStreamOfAnotherDevice(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1, d2 := b.Device(t, 0), b.Device(t, 1), b.Device(t, 2)
		other := sim.New(sim.Devices(1))
		defer func() { require.NoError(t, other.Close()) }()
		sys2, err := vmm.Open(other)
		require.NoError(t, err)
		defer func() { require.NoError(t, sys2.Close()) }()
		foreign, err := sys2.Device(0)
		require.NoError(t, err)
		streams := map[string]*vmm.Stream{}
		for name, d := range map[string]*vmm.Device{"d1": d1, "d2": d2, "foreign": foreign, "closed": d0} {
			s, err := d.CreateStream(vmm.StreamOptions{})
			require.NoError(t, err)
			defer func() { require.NoError(t, s.Close()) }()
			streams[name] = s
		}
		require.NoError(t, streams["closed"].Close())
		peer := []growbuf.Peer{{Device: d1}}
		reserves := b.Sim.Calls("cuMemAddressReserve")
		for _, tc := range []struct {
			name  string
			opts  growbuf.Options
			want  string
			check error
		}{
			{"another device", growbuf.Options{Stream: streams["d2"], Peers: peer}, "stream of device 2, which is neither", vmm.ErrInvalidValue},
			{"a peer's, no peer", growbuf.Options{Stream: streams["d1"]}, "stream of device 1, which is neither", vmm.ErrInvalidValue},
			{"another System", growbuf.Options{Stream: streams["foreign"]}, "another System", vmm.ErrInvalidValue},
			{"closed", growbuf.Options{Stream: streams["closed"]}, "closed stream", vmm.ErrClosed},
		} {
			buf, err := growbuf.New(d0, tc.opts)
			require.ErrorIs(t, err, tc.check, tc.name)
			require.ErrorIs(t, err, vmm.ErrInvalidValue, tc.name)
			require.ErrorContains(t, err, tc.want, tc.name)
			require.Nil(t, buf, tc.name)
		}
		require.Equal(t, reserves, b.Sim.Calls("cuMemAddressReserve"), "nothing reserved")

		buf, err := growbuf.New(d0, growbuf.Options{MaxSize: 8 * mib, Stream: streams["d1"], Peers: peer})
		require.NoError(t, err, "a peer's stream may carry the work on the buffer")
		require.NoError(t, buf.Grow(4*mib))
		before := b.Sim.Calls("cuStreamSynchronize")
		closeBuf(t, buf)
		require.Equal(t, before+1, b.Sim.Calls("cuStreamSynchronize"), "Close waits for the peer's stream")
	}, testutil.Devices(3), testutil.SimOnly())
}
