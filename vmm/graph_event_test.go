package vmm_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/vmm"
)

// A verify kernel captured into a graph counts mismatches each time the graph is launched; events
// order two streams.
func TestGraphAndEvents(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, m := mapFilled(t, d, 2*mib, 8)
		defer func() { require.NoError(t, r.Close()) }()
		defer func() { require.NoError(t, m.Close()) }()
		counter, err := d.AllocPlain(8)
		require.NoError(t, err)
		defer func() { require.NoError(t, counter.Close()) }()
		s, err := d.CreateStream(vmm.StreamOptions{NonBlocking: true})
		require.NoError(t, err)
		defer func() { require.NoError(t, s.Close()) }()

		require.NoError(t, s.BeginCapture())
		require.NoError(t, d.LaunchVerify(m.Ptr(), 2*mib, 0, 9, counter.Ptr(), s))
		g, err := s.EndCapture()
		require.NoError(t, err)
		require.NotZero(t, g.Handle())
		exec, err := g.Instantiate()
		require.NoError(t, err)
		require.NoError(t, g.Close())
		require.NoError(t, g.Close())
		for i := 1; i <= 2; i++ {
			require.NoError(t, exec.Launch(s))
			require.NoError(t, s.Synchronize())
			got := make([]byte, 8)
			require.NoError(t, d.CopyDtoH(got, counter.Ptr()))
			require.Equal(t, uint64(i)*2*mib/8, leUint64(got), "launch %d adds every word (wrong seed)", i)
		}
		require.NoError(t, exec.Close())
		require.NoError(t, exec.Close())
		require.ErrorIs(t, exec.Launch(s), vmm.ErrClosed)

		require.ErrorIs(t, (*vmm.Stream)(nil).BeginCapture(), vmm.ErrInvalidValue)
		_, err = (*vmm.Stream)(nil).EndCapture()
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.ErrorIs(t, d.LaunchVerify(m.Ptr(), 2*mib, 0, 9, 3, s), vmm.ErrInvalidValue, "unaligned counter")

		// Events: s2 waits for work recorded on s.
		s2, err := d.CreateStream(vmm.StreamOptions{NonBlocking: true})
		require.NoError(t, err)
		defer func() { require.NoError(t, s2.Close()) }()
		e, err := d.NewEvent(false)
		require.NoError(t, err)
		defer func() { require.NoError(t, e.Close()) }()
		require.NoError(t, d.Memset(counter.Ptr(), 0, 8))
		require.NoError(t, e.Record(s))
		require.NoError(t, s2.WaitEvent(e))
		require.NoError(t, s2.Synchronize())
		done, err := e.Query()
		require.NoError(t, err)
		require.True(t, done)
	})
}

func leUint64(b []byte) uint64 {
	var v uint64
	for i := 7; i >= 0; i-- {
		v = v<<8 | uint64(b[i])
	}
	return v
}

// A held allocation cannot be closed until the hold is released.
func TestHoldAndStats(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, err := b.Sys.Reserve(4*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		r.SetKind("test")
		m, err := r.MapNew(0, 2*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
		require.NoError(t, err)
		release, err := m.Allocation().Hold("a test")
		require.NoError(t, err)
		err = m.Close()
		require.ErrorIs(t, err, vmm.ErrInUse)
		require.ErrorContains(t, err, "held by a test")
		st := b.Sys.Stats()
		require.Equal(t, uint64(2*mib), st.Total(func(s vmm.DeviceStats) uint64 { return s.MappedBytes }))
		require.Contains(t, st.Devices[0].String(), "(test 2097152)")
		require.NotEmpty(t, vmm.Ops())
		for _, op := range vmm.Ops() {
			text, err := op.MarshalText()
			require.NoError(t, err)
			require.Equal(t, op.String(), string(text))
		}
		release()
		release()
		require.NoError(t, m.Close())
		require.NoError(t, r.Close())
		props, err := func() (driver.AllocationProp, error) {
			a, err := d.Allocate(2*mib, vmm.AllocOptions{})
			require.NoError(t, err)
			defer func() { require.NoError(t, a.Close()) }()
			return a.QueryProperties()
		}()
		require.NoError(t, err)
		require.Equal(t, d.Location(), props.Location)
	})
}

// A blocking event orders work like any other; on the simulator it is created with BLOCKING_SYNC
// (its Synchronize sleeps instead of spinning on the real driver) and without timing.
func TestBlockingEvent(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		blocking := driver.EventBlockingSync | driver.EventDisableTiming
		var before int
		if b.IsSim() {
			before = b.Sim.EventsCreated(blocking)
		}
		e, err := d.NewBlockingEvent()
		require.NoError(t, err)
		defer func() { require.NoError(t, e.Close()) }()
		if b.IsSim() {
			require.Equal(t, before+1, b.Sim.EventsCreated(blocking))
		}
		src, err := d.AllocPlain(2 * mib)
		require.NoError(t, err)
		defer func() { require.NoError(t, src.Close()) }()
		dst, err := d.AllocPlain(2 * mib)
		require.NoError(t, err)
		defer func() { require.NoError(t, dst.Close()) }()
		require.NoError(t, d.Fill(src.Ptr(), 2*mib, 0, 5))
		s, err := d.CreateStream(vmm.StreamOptions{NonBlocking: true})
		require.NoError(t, err)
		defer func() { require.NoError(t, s.Close()) }()
		require.NoError(t, d.CopyAsync(dst.Ptr(), src.Ptr(), 2*mib, s))
		require.NoError(t, e.Record(s))
		require.NoError(t, e.Synchronize())
		done, err := e.Query()
		require.NoError(t, err)
		require.True(t, done)
		bad, err := d.Verify(dst.Ptr(), 2*mib, 0, 5)
		require.NoError(t, err)
		require.Zero(t, bad, "the copy recorded before the event is done once it is")
		_, err = e.Elapsed(e)
		require.Error(t, err, "a blocking event has no timing")
		require.NoError(t, e.Close())
		require.ErrorIs(t, e.Synchronize(), vmm.ErrClosed)
	})
}

// Hold refuses an allocation with no memory to hold: a closed one (ErrClosed) and one asleep
// (ErrAsleep); the allocation is not held after either, and holds again once awake.
func TestHoldRefusesClosedAndAsleep(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		a, err := d.Allocate(2*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		require.NoError(t, a.Close())
		release, err := a.Hold("a test")
		require.ErrorIs(t, err, vmm.ErrClosed)
		require.Nil(t, release)

		r, m := mapFilled(t, d, 2*mib, 5)
		defer func() { require.NoError(t, r.Close()) }()
		defer func() { require.NoError(t, m.Close()) }()
		rw := []vmm.Access{vmm.ReadWrite(d)}
		require.NoError(t, m.Allocation().ReleaseAt(m.Ptr(), rw, true, nil))
		release, err = m.Allocation().Hold("a test")
		require.ErrorIs(t, err, vmm.ErrAsleep)
		require.ErrorContains(t, err, "for a test")
		require.Nil(t, release)
		require.NoError(t, m.Allocation().RecreateAt(m.Ptr(), rw), "not held: it wakes")
		release, err = m.Allocation().Hold("a test")
		require.NoError(t, err)
		require.ErrorIs(t, m.Close(), vmm.ErrInUse)
		release()
	})
}
