package stripe_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/stripe"
	"github.com/cuvmm/cuvmm/vmm"
)

const mib = 1 << 20

func devices(t *testing.T, b *testutil.Backend, ordinals ...int) []*vmm.Device {
	t.Helper()
	out := make([]*vmm.Device, len(ordinals))
	for i, o := range ordinals {
		out[i] = b.Device(t, o)
	}
	return out
}

// fillAndVerify has each holder write the pattern into its own segments (pattern offset = the
// segment's offset in the range) and every device in readers verify the whole range.
func fillAndVerify(t *testing.T, r *stripe.Range, readers []*vmm.Device, seed uint64) {
	t.Helper()
	for _, d := range r.Devices() {
		for _, s := range r.Segments(d) {
			require.NoError(t, d.Fill(r.Ptr()+driver.DevicePtr(s.Offset), s.Size, s.Offset, seed))
		}
	}
	for _, d := range readers {
		bad, err := d.Verify(r.Ptr(), r.Size(), 0, seed)
		require.NoError(t, err)
		require.Zero(t, bad, "device %d reads the whole range", d.Ordinal())
	}
}

// checkShape checks Owner, Segments and Chunks against want: the holder index of each granule.
func checkShape(t *testing.T, r *stripe.Range, devs []*vmm.Device, want []int) {
	t.Helper()
	g := r.Granularity()
	require.Equal(t, uint64(len(want))*g, r.Size())
	require.Equal(t, r.Size(), r.Len())
	for i, h := range want {
		for _, off := range []uint64{uint64(i) * g, uint64(i)*g + g/2, uint64(i+1)*g - 1} {
			d, err := r.Owner(off)
			require.NoError(t, err)
			require.Same(t, devs[h], d, "owner of offset %#x", off)
		}
	}
	_, err := r.Owner(r.Size())
	require.ErrorIs(t, err, vmm.ErrInvalidValue)

	// Segments: the merged runs of each device, which together tile the range.
	var covered uint64
	for hi, d := range devs {
		var wantSegs []stripe.Segment
		for i, h := range want {
			if h != hi {
				continue
			}
			off := uint64(i) * g
			if n := len(wantSegs); n > 0 && wantSegs[n-1].End() == off {
				wantSegs[n-1].Size += g
			} else {
				wantSegs = append(wantSegs, stripe.Segment{Offset: off, Size: g})
			}
		}
		require.Equal(t, wantSegs, r.Segments(d), "segments of device %d", d.Ordinal())
		for _, s := range wantSegs {
			covered += s.Size
		}
	}
	require.Equal(t, r.Size(), covered)

	// Chunks are back to back, each on the device that owns its first byte.
	var pos uint64
	for _, c := range r.Chunks() {
		require.Equal(t, pos, c.Offset)
		owner, err := r.Owner(c.Offset)
		require.NoError(t, err)
		require.Same(t, owner, c.Allocation.Device())
		pos += c.Allocation.Size()
	}
	require.Equal(t, r.Size(), pos)
}

func TestLayouts(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		devs := devices(t, b, 0, 1)
		cases := []struct {
			layout stripe.Layout
			size   uint64
			want   []int // holder of each 2 MiB granule
		}{
			{stripe.Blocked{}, 8 * mib, []int{0, 0, 1, 1}},
			{stripe.Blocked{}, 9 * mib, []int{0, 0, 0, 1, 1}}, // rounds to 10 MiB; the last device holds less
			{stripe.Interleaved{Stripe: 2 * mib}, 12 * mib, []int{0, 1, 0, 1, 0, 1}},
			{stripe.Interleaved{Stripe: 4 * mib}, 11 * mib, []int{0, 0, 1, 1, 0, 0}},    // rounds to 12 MiB
			{stripe.Interleaved{Stripe: 4 * mib}, 13 * mib, []int{0, 0, 1, 1, 0, 0, 1}}, // a short last stripe
		}
		for i, c := range cases {
			t.Run(fmt.Sprintf("%d-%s", i, c.layout), func(t *testing.T) {
				r, err := stripe.New(devs, c.size, c.layout, stripe.Options{})
				require.NoError(t, err)
				require.GreaterOrEqual(t, r.Size(), c.size)
				checkShape(t, r, devs, c.want)
				fillAndVerify(t, r, devs, uint64(i+1))
				require.NoError(t, r.Close())
				require.NoError(t, r.Close(), "Close is idempotent")
				_, err = r.Owner(0)
				require.ErrorIs(t, err, vmm.ErrClosed)
				require.Nil(t, r.Segments(devs[0]))
				require.Nil(t, r.Chunks())
			})
		}
		var nilRange *stripe.Range
		require.NoError(t, nilRange.Close())
	}, testutil.Devices(2))
}

func TestFourDevices(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		devs := devices(t, b, 0, 1, 2, 3)
		cases := []struct {
			layout stripe.Layout
			size   uint64
			want   []int
		}{
			{stripe.Blocked{}, 16 * mib, []int{0, 0, 1, 1, 2, 2, 3, 3}},
			{stripe.Blocked{}, 14 * mib, []int{0, 0, 1, 1, 2, 2, 3}},
			{stripe.Blocked{}, 4 * mib, []int{0, 1}}, // devices 2 and 3 hold nothing but still read it
			{stripe.Interleaved{Stripe: 2 * mib}, 20 * mib, []int{0, 1, 2, 3, 0, 1, 2, 3, 0, 1}},
			{stripe.Interleaved{Stripe: 4 * mib}, 18 * mib, []int{0, 0, 1, 1, 2, 2, 3, 3, 0}},
		}
		for i, c := range cases {
			t.Run(fmt.Sprintf("%d-%s", i, c.layout), func(t *testing.T) {
				r, err := stripe.New(devs, c.size, c.layout, stripe.Options{})
				require.NoError(t, err)
				checkShape(t, r, devs, c.want)
				fillAndVerify(t, r, devs, 40+uint64(i))
				require.NoError(t, r.Close())
			})
		}
	}, testutil.SimOnly(), testutil.Devices(4))
}

func TestOneDeviceIsAPlainRange(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		for _, l := range []stripe.Layout{stripe.Blocked{}, stripe.Interleaved{Stripe: 2 * mib}} {
			r, err := stripe.New([]*vmm.Device{d}, 5*mib, l, stripe.Options{})
			require.NoError(t, err, l)
			require.Equal(t, uint64(6*mib), r.Size())
			require.Equal(t, []stripe.Segment{{Offset: 0, Size: 6 * mib}}, r.Segments(d), "adjacent stripes merge")
			require.Equal(t, uint64(6*mib), r.LocalBytes(d))
			fillAndVerify(t, r, []*vmm.Device{d}, 3)
			require.NoError(t, r.Close())
		}
	})
}

func TestReadOnlyPeers(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		devs := devices(t, b, 0, 1)
		r, err := stripe.New(devs, 8*mib, stripe.Interleaved{Stripe: 2 * mib}, stripe.Options{ReadOnlyPeers: true})
		require.NoError(t, err)
		defer func() { require.NoError(t, r.Close()) }()
		require.True(t, r.ReadOnlyPeers())
		fillAndVerify(t, r, devs, 5) // owners write their own stripes, everyone reads everything
		for _, d := range devs {
			for _, other := range devs {
				seg := r.Segments(other)[0]
				err := d.Memset(r.Ptr()+driver.DevicePtr(seg.Offset), 0, 4096)
				if d == other {
					require.NoError(t, err, "device %d writes its own stripe", d.Ordinal())
					require.NoError(t, d.Fill(r.Ptr()+driver.DevicePtr(seg.Offset), seg.Size, seg.Offset, 5))
				} else {
					require.Error(t, err, "device %d must not write device %d's stripe", d.Ordinal(), other.Ordinal())
				}
			}
		}
		bad, err := devs[1].Verify(r.Ptr(), r.Size(), 0, 5)
		require.NoError(t, err)
		require.Zero(t, bad, "the refused writes changed nothing")
	}, testutil.Devices(2))
}

func TestAccessOnlyDevice(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		r, err := stripe.New([]*vmm.Device{d0}, 6*mib, stripe.Blocked{}, stripe.Options{AccessOnly: []*vmm.Device{d1}})
		require.NoError(t, err)
		require.Equal(t, []*vmm.Device{d1}, r.AccessOnly())
		require.Empty(t, r.Segments(d1))
		require.Zero(t, r.LocalBytes(d1))
		for off := uint64(0); off < r.Size(); off += mib {
			o, err := r.Owner(off)
			require.NoError(t, err)
			require.Same(t, d0, o)
		}
		fillAndVerify(t, r, []*vmm.Device{d0, d1}, 6)
		// Read-write by default: the access-only device writes too.
		require.NoError(t, d1.Fill(r.Ptr(), r.Size(), 0, 7))
		bad, err := d0.Verify(r.Ptr(), r.Size(), 0, 7)
		require.NoError(t, err)
		require.Zero(t, bad)
		require.NoError(t, r.Close())

		// With ReadOnlyPeers the access-only device reads but cannot write.
		r, err = stripe.New([]*vmm.Device{d0}, 2*mib, stripe.Blocked{}, stripe.Options{AccessOnly: []*vmm.Device{d1}, ReadOnlyPeers: true})
		require.NoError(t, err)
		fillAndVerify(t, r, []*vmm.Device{d1}, 8)
		require.Error(t, d1.Memset(r.Ptr(), 0, 4096))
		require.NoError(t, r.Close())
	}, testutil.Devices(2))
}

func TestAccessOnlyWithThreeDevices(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		devs := devices(t, b, 0, 1, 2)
		r, err := stripe.New(devs[:2], 8*mib, stripe.Interleaved{Stripe: 2 * mib}, stripe.Options{AccessOnly: devs[2:]})
		require.NoError(t, err)
		checkShape(t, r, devs[:2], []int{0, 1, 0, 1})
		require.Empty(t, r.Segments(devs[2]))
		fillAndVerify(t, r, devs, 9)
		require.NoError(t, r.Close())
	}, testutil.SimOnly(), testutil.Devices(3))
}

// requireNothingLeft checks, on the simulator, that no allocation, mapping or reservation is live.
func requireNothingLeft(t *testing.T, b *testutil.Backend, what string) {
	t.Helper()
	if !b.IsSim() {
		return
	}
	live := b.Sim.Live()
	require.Zero(t, live.Allocations, "%s: %s", what, live)
	require.Zero(t, live.Mappings, "%s: %s", what, live)
	require.Zero(t, live.Reservations, "%s: %s", what, live)
}

func TestBadInput(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		two := []*vmm.Device{d0, d1}
		il := stripe.Interleaved{Stripe: 2 * mib}
		cases := []struct {
			name    string
			devs    []*vmm.Device
			size    uint64
			layout  stripe.Layout
			opts    stripe.Options
			target  error
			message string
		}{
			{"no devices", nil, 4 * mib, il, stripe.Options{}, vmm.ErrInvalidValue, "no devices"},
			{"nil device", []*vmm.Device{d0, nil}, 4 * mib, il, stripe.Options{}, vmm.ErrInvalidValue, "devices[1] is a nil device"},
			{"listed twice", []*vmm.Device{d0, d1, d0}, 4 * mib, il, stripe.Options{}, vmm.ErrInvalidValue, "device 0 is listed twice"},
			{"holder also access-only", two, 4 * mib, il, stripe.Options{AccessOnly: []*vmm.Device{d1}}, vmm.ErrInvalidValue, "device 1 is listed twice"},
			{"nil access-only", two, 4 * mib, il, stripe.Options{AccessOnly: []*vmm.Device{nil}}, vmm.ErrInvalidValue, "AccessOnly[0] is a nil device"},
			{"nil layout", two, 4 * mib, nil, stripe.Options{}, vmm.ErrInvalidValue, "nil layout"},
			{"nil *Interleaved", two, 4 * mib, (*stripe.Interleaved)(nil), stripe.Options{}, vmm.ErrInvalidValue, "nil layout"},
			{"nil *Blocked", two, 4 * mib, (*stripe.Blocked)(nil), stripe.Options{}, vmm.ErrInvalidValue, "nil layout"},
			{"size 0", two, 0, il, stripe.Options{}, vmm.ErrInvalidValue, "size 0"},
			{"overflow", two, ^uint64(0), il, stripe.Options{}, vmm.ErrInvalidValue, "overflows"},
			{"more than the devices have", two, 1 << 62, il, stripe.Options{}, driver.ErrOutOfMemory, "more than"},
			{"stripe not a multiple", two, 8 * mib, stripe.Interleaved{Stripe: 3 * mib}, stripe.Options{}, vmm.ErrInvalidValue, "not a non-zero multiple of the granularity"},
			{"stripe 1 byte", two, 8 * mib, stripe.Interleaved{Stripe: 1}, stripe.Options{}, vmm.ErrInvalidValue, "granularity"},
			{"stripe 0", two, 8 * mib, stripe.Interleaved{}, stripe.Options{}, vmm.ErrInvalidValue, "stripe size 0"},
			{"unknown handle bits", two, 8 * mib, il, stripe.Options{HandleTypes: driver.HandleTypePosixFD | 0x40}, vmm.ErrInvalidValue, "handle types posix-fd|0x40: unknown bits 0x40"},
		}
		for _, c := range cases {
			r, err := stripe.New(c.devs, c.size, c.layout, c.opts)
			require.Nil(t, r, c.name)
			require.ErrorIs(t, err, c.target, c.name)
			require.ErrorContains(t, err, c.message, c.name)
			requireNothingLeft(t, b, c.name)
		}
	}, testutil.Devices(2))
}

func TestDevicesOfAnotherSystem(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		other := sim.New(sim.Devices(1))
		defer func() { require.NoError(t, other.Close()) }()
		sys2, err := vmm.Open(other)
		require.NoError(t, err)
		defer func() { require.NoError(t, sys2.Close()) }()
		foreign, err := sys2.Device(0)
		require.NoError(t, err)
		_, err = stripe.New([]*vmm.Device{b.Device(t, 0), foreign}, 4*mib, stripe.Blocked{}, stripe.Options{})
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.ErrorContains(t, err, "another vmm.System")
		requireNothingLeft(t, b, "foreign device")
	}, testutil.SimOnly())
}

func TestNoPeerAccess(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		devs := devices(t, b, 0, 1, 2)
		creates, reserves := b.Sim.Calls("cuMemCreate"), b.Sim.Calls("cuMemAddressReserve")
		for _, c := range []struct {
			name    string
			holders []*vmm.Device
			opts    stripe.Options
		}{
			{"holders", devs, stripe.Options{}},
			{"holder and access-only", devs[1:2], stripe.Options{AccessOnly: devs[2:]}},
			{"read-only peers", devs, stripe.Options{ReadOnlyPeers: true}},
		} {
			r, err := stripe.New(c.holders, 8*mib, stripe.Interleaved{Stripe: 2 * mib}, c.opts)
			require.Nil(t, r, c.name)
			require.ErrorIs(t, err, stripe.ErrNoPeerAccess, c.name)
			require.Regexp(t, `device [12] cannot access the memory of device [12]`, err.Error(), c.name)
		}
		require.Equal(t, creates, b.Sim.Calls("cuMemCreate"), "peer access is checked before anything is allocated")
		require.Equal(t, reserves, b.Sim.Calls("cuMemAddressReserve"))
		requireNothingLeft(t, b, "no peer access")

		// The pairs that can reach each other still work.
		r, err := stripe.New(devs[:2], 8*mib, stripe.Blocked{}, stripe.Options{})
		require.NoError(t, err)
		fillAndVerify(t, r, devs[:2], 11)
		require.NoError(t, r.Close())
	}, testutil.SimOnly(), testutil.Devices(3), testutil.SimOptions(sim.PeerAccess(1, 2, false)))
}

func TestNoPeerAccessTwoDevices(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		_, err := stripe.New(devices(t, b, 0, 1), 4*mib, stripe.Blocked{}, stripe.Options{})
		require.ErrorIs(t, err, stripe.ErrNoPeerAccess)
		require.ErrorContains(t, err, "device 0 cannot access the memory of device 1")
		requireNothingLeft(t, b, "no peer access")
	}, testutil.SimOnly(), testutil.Devices(2), testutil.SimOptions(sim.PeerAccess(0, 1, false)))
}

// A failure injected into any call of any build step leaves nothing behind.
func TestFaultInjection(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		devs := devices(t, b, 0, 1)
		layouts := []stripe.Layout{stripe.Blocked{}, stripe.Interleaved{Stripe: 2 * mib}}
		opts := stripe.Options{HandleTypes: driver.HandleTypePosixFD, ReadOnlyPeers: true}
		for _, l := range layouts {
			// A clean build first, to count the calls of each step.
			steps := []string{"cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess"}
			before := map[string]int{}
			for _, fn := range steps {
				before[fn] = b.Sim.Calls(fn)
			}
			r, err := stripe.New(devs, 10*mib, l, opts)
			require.NoError(t, err)
			require.NoError(t, r.Close())
			calls := map[string]int{}
			for _, fn := range steps {
				calls[fn] = b.Sim.Calls(fn) - before[fn]
				require.Positive(t, calls[fn], fn)
			}
			for _, fn := range steps {
				for k := 1; k <= calls[fn]; k++ {
					what := fmt.Sprintf("%s: call %d of %s fails", l, k, fn)
					b.Sim.FailNth(fn, k, driver.ErrorOutOfMemory)
					r, err := stripe.New(devs, 10*mib, l, opts)
					require.Nil(t, r, what)
					require.ErrorIs(t, err, driver.ErrOutOfMemory, what)
					require.ErrorContains(t, err, fn, what)
					b.Sim.ClearFaults()
					requireNothingLeft(t, b, what)
				}
			}
		}

		// The undo's cuMemUnmap fails too: the mapping it could not unmap goes to the System, which
		// frees it when asked (and in Close).
		b.Sim.FailNth("cuMemMap", 4, driver.ErrorOutOfMemory)
		for n := 1; n <= 10; n++ {
			b.Sim.FailNth("cuMemUnmap", n, driver.ErrorUnknown) // every unmap of the undo, and its retries
		}
		r, err := stripe.New(devs, 10*mib, stripe.Interleaved{Stripe: 2 * mib}, opts)
		require.Nil(t, r)
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.ErrorContains(t, err, "chunk 3 of 5")
		require.ErrorContains(t, err, "undo")
		b.Sim.ClearFaults()
		require.NotEmpty(t, b.Sys.Orphans(), "the mappings and their reservation")
		require.NoError(t, b.Sys.RetryOrphans())
		require.Empty(t, b.Sys.Orphans())
		requireNothingLeft(t, b, "failed undo")

		// Close retries after a failed unmap.
		r, err = stripe.New(devs, 10*mib, stripe.Blocked{}, opts)
		require.NoError(t, err)
		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown)
		require.Error(t, r.Close())
		require.Len(t, r.Chunks(), 2, "a failed Close keeps the range")
		require.NoError(t, r.Close())
		requireNothingLeft(t, b, "Close retried")
	}, testutil.SimOnly(), testutil.Devices(2))
}

func TestChunkedExport(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		devs := devices(t, b, 0, 1)
		r, err := stripe.New(devs, 8*mib, stripe.Interleaved{Stripe: 4 * mib}, stripe.Options{HandleTypes: driver.HandleTypePosixFD})
		require.NoError(t, err)
		var c vmm.Chunked = r
		chunks := c.Chunks()
		require.Len(t, chunks, 2)
		for i, ch := range chunks {
			require.Equal(t, uint64(i)*4*mib, ch.Offset)
			require.Same(t, devs[i], ch.Allocation.Device())
			require.Equal(t, driver.HandleTypePosixFD, ch.Allocation.HandleTypes())
			f, err := ch.Allocation.Export(driver.HandleTypePosixFD)
			require.NoError(t, err)
			require.NoError(t, f.Close())
		}
		require.NoError(t, r.Close())
	}, testutil.Devices(2))
}

// Ptr and Len read without the range's lock while Close runs: Ptr is the range's address until it
// is 0, and a Len read after a Ptr of 0 is 0 too; nothing races (go test -race).
func TestPtrAndLenDuringClose(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		devs := devices(t, b, 0, 1)
		r, err := stripe.New(devs, 8*mib, stripe.Interleaved{Stripe: 2 * mib}, stripe.Options{})
		require.NoError(t, err)
		ptr := r.Ptr()
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				p, n := r.Ptr(), r.Len()
				switch {
				case p == 0 && n != 0:
					t.Errorf("Len %d after Ptr 0", n)
				case p != 0 && p != ptr:
					t.Errorf("Ptr %#x while closing the range at %#x", p, ptr)
				}
				if p != ptr {
					return
				}
			}
		}()
		require.NoError(t, r.Close())
		<-done
		require.Zero(t, r.Ptr())
		require.Zero(t, r.Len())
	}, testutil.Devices(2))
}

// A closed range, as a vmm.Chunked, has no chunks and so a Len of 0: the chunks always cover Len.
func TestClosedRangeHasNoLen(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		devs := devices(t, b, 0, 1)
		r, err := stripe.New(devs, 8*mib, stripe.Interleaved{Stripe: 2 * mib}, stripe.Options{})
		require.NoError(t, err)
		var c vmm.Chunked = r
		require.Equal(t, uint64(8*mib), c.Len())
		require.NoError(t, r.Close())
		require.Empty(t, c.Chunks())
		require.Zero(t, c.Len(), "no chunks cover the Len of a closed range")
		require.Equal(t, uint64(8*mib), r.Size(), "Size still tells what the range was")
		require.Zero(t, r.Ptr(), "the freed address is not handed out, as growbuf's Ptr after Close")
	}, testutil.Devices(2))
}
