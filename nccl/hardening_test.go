package nccl_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/nccl"
	"github.com/cuvmm/cuvmm/nccl/ncclsim"
	"github.com/cuvmm/cuvmm/vmm"
)

// blockingPoll is the simulated NCCL whose ncclCommGetAsyncError waits for gate while block is set,
// so that a call keeps the communicator busy.
type blockingPoll struct {
	*ncclsim.Lib
	block atomic.Bool
	gate  chan struct{}
}

func (l *blockingPoll) CommGetAsyncError(h nccl.CommHandle) error {
	if l.block.Load() {
		<-l.gate
	}
	return l.Lib.CommGetAsyncError(h)
}

// TestRegisterHoldsBeforeWaitingForTheComm: a Register that waits for the communicator (another
// call is using it) already holds the buffer's chunks, so a Shrink meanwhile fails with ErrInUse;
// should the Shrink come first, Register refuses the freed chunk. Never both succeed.
func TestRegisterHoldsBeforeWaitingForTheComm(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := &blockingPoll{Lib: library(t, b).(*ncclsim.Lib), gate: make(chan struct{})}
		dev := b.Device(t, 0)
		c := soloComm(t, b, lib)
		defer func() { require.NoError(t, c.Close()) }()
		buf := buffer(t, dev, 4*mib, 2*mib)
		scratch := buffer(t, dev, 2*mib, 2*mib)

		lib.block.Store(true)
		ran := make(chan error, 1)
		go func() { // holds the communicator while its group is polled
			ran <- c.AllReduce(context.Background(), scratch.Ptr(), scratch.Ptr(), 16, nccl.Float32, nccl.Sum, nil)
		}()
		time.Sleep(20 * time.Millisecond)
		type result struct {
			reg *nccl.Registration
			err error
		}
		registered := make(chan result, 1)
		go func() {
			reg, err := c.Register(context.Background(), buf)
			registered <- result{reg, err}
		}()
		time.Sleep(20 * time.Millisecond) // Register waits for the communicator
		shrinkErr := buf.Shrink(2 * mib)
		lib.block.Store(false)
		close(lib.gate)
		require.NoError(t, <-ran)
		r := <-registered
		if shrinkErr != nil {
			require.ErrorIs(t, shrinkErr, vmm.ErrInUse)
			require.NoError(t, r.err)
			require.NoError(t, r.reg.Close())
			return
		}
		require.ErrorIs(t, r.err, nccl.ErrInvalidValue, "Register of a chunk freed meanwhile")
	}, testutil.SimOnly())
}

// TestStreamOfAnotherDeviceWrapsErrWrongDevice: as the package documents for streams and buffers.
func TestStreamOfAnotherDeviceWrapsErrWrongDevice(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		c := soloComm(t, b, library(t, b))
		defer func() { require.NoError(t, c.Close()) }()
		buf := buffer(t, b.Device(t, 0), 2*mib, 2*mib)
		err := c.AllReduce(deadline(t, 10*time.Second), buf.Ptr(), buf.Ptr(), 16, nccl.Float32, nccl.Sum, stream(t, b.Device(t, 1)))
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		require.ErrorIs(t, err, nccl.ErrWrongDevice)
	}, testutil.SimOnly(), testutil.Devices(2))
}

// soloWithStream makes a one-rank communicator (closed at the end of the test), a buffer of 2 MiB and
// a non-blocking stream, which is the test's to close, on device 0.
func soloWithStream(t *testing.T, b *testutil.Backend) (*nccl.Comm, *growbuf.Buffer, *vmm.Stream) {
	dev := b.Device(t, 0)
	c := soloComm(t, b, library(t, b))
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	s, err := dev.CreateStream(vmm.StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	return c, buffer(t, dev, 2*mib, 2*mib), s
}

// closedStreamIsRefused runs an all-reduce on a stream that run closes (before the call, or after
// queuing it in a group): it is an argument error, not an abort, and the communicator stays usable.
func closedStreamIsRefused(t *testing.T, run func(t *testing.T, c *nccl.Comm, buf driver.DevicePtr, s *vmm.Stream) error) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		c, buf, s := soloWithStream(t, b)
		err := run(t, c, buf.Ptr(), s)
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		require.ErrorContains(t, err, "the stream is closed")
		require.ErrorIs(t, err, vmm.ErrClosed, "the stream's own error is kept")
		require.NotErrorIs(t, err, nccl.ErrAborted)
		require.NoError(t, c.AllReduce(deadline(t, 10*time.Second), buf.Ptr(), buf.Ptr(), 16, nccl.Float32, nccl.Sum, nil))
	}, testutil.SimOnly())
}

// TestClosedStreamIsRefusedUpFront: a closed stream is an argument error; the communicator stays
// usable.
func TestClosedStreamIsRefusedUpFront(t *testing.T) {
	closedStreamIsRefused(t, func(t *testing.T, c *nccl.Comm, buf driver.DevicePtr, s *vmm.Stream) error {
		require.NoError(t, s.Close())
		return c.AllReduce(deadline(t, 10*time.Second), buf, buf, 16, nccl.Float32, nccl.Sum, s)
	})
}

// TestFailedAbortIsRunAgainByClose: an Abort whose device binding fails says so, and Close runs
// ncclCommAbort again, so nothing of the communicator is left.
func TestFailedAbortIsRunAgainByClose(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := ncclsim.New(b.Sim)
		c := soloComm(t, b, lib)
		b.Sim.FailNth("cuCtxSetCurrent", 1, driver.ErrorUnknown)
		require.ErrorContains(t, c.Abort(), "Close retries it")
		require.NoError(t, c.Close())
		require.True(t, lib.Live().Zero(), "the simulated NCCL still holds: %s", lib.Live())
	}, testutil.SimOnly())
}

// TestNewCommCancelledWhoseAbortFailsIsKept: a NewComm whose context ends and whose abort cannot
// bind the device hands the communicator to the System, whose retry aborts it.
func TestNewCommCancelledWhoseAbortFailsIsKept(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := ncclsim.New(b.Sim)
		id, err := lib.GetUniqueID()
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		b.Sim.FailNth("cuCtxSetCurrent", 2, driver.ErrorUnknown)   // 1: the init's binding, 2: the abort's
		c, err := nccl.NewComm(ctx, lib, id, 0, 2, b.Device(t, 0)) // rank 1 never joins
		require.ErrorIs(t, err, nccl.ErrAborted)
		require.ErrorContains(t, err, "kept by the System")
		require.Nil(t, c)
		require.NoError(t, b.Sys.RetryOrphans())
		require.True(t, lib.Live().Zero(), "the simulated NCCL still holds: %s", lib.Live())
	}, testutil.SimOnly())
}

// TestBroadcastNullSendOnNonRoot: NCCL reads a broadcast's send buffer on the root only, so other
// ranks may pass none.
func TestBroadcastNullSendOnNonRoot(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		comms := ranks(t, b, library(t, b), 2)
		bufs := []vmm.Chunked{buffer(t, b.Device(t, 0), 2*mib, 2*mib), buffer(t, b.Device(t, 1), 2*mib, 2*mib)}
		ctx := deadline(t, 10*time.Second)
		errs := parallel(2, func(r int) error {
			send := bufs[r].Ptr()
			if r != 0 {
				send = 0
			}
			return comms[r].Broadcast(ctx, send, bufs[r].Ptr(), 16, nccl.Float32, 0, nil)
		})
		noErrors(t, errs)
	}, testutil.SimOnly(), testutil.Devices(2))
}

// TestSystemCloseWaitsForComm: an open communicator is something on its device, so System.Close
// refuses (ErrInUse) until the communicator is closed, instead of leaving it no way to be destroyed.
func TestSystemCloseWaitsForComm(t *testing.T) {
	s := sim.New(sim.Devices(1))
	defer func() { require.NoError(t, s.Close()) }()
	sys, err := vmm.Open(s)
	require.NoError(t, err)
	dev, err := sys.Device(0)
	require.NoError(t, err)
	lib := ncclsim.New(s)
	id, err := lib.GetUniqueID()
	require.NoError(t, err)
	c, err := nccl.NewComm(deadline(t, 10*time.Second), lib, id, 0, 1, dev)
	require.NoError(t, err)
	err = sys.Close()
	require.ErrorIs(t, err, vmm.ErrInUse)
	require.ErrorContains(t, err, "nccl communicator")
	require.NoError(t, c.Close())
	require.True(t, lib.Live().Zero(), "the simulated NCCL still holds: %s", lib.Live())
	require.NoError(t, sys.Close())
}

// TestUnmatchedSelfTransferIsInvalidUsage: NCCL pairs a rank's send to itself with its receive from
// itself inside one group and reports ncclInvalidUsage for one without the other, instead of
// waiting (a receive) or keeping the bytes for a later group (a send). The communicator is aborted
// at once, long before the deadline.
func TestUnmatchedSelfTransferIsInvalidUsage(t *testing.T) {
	for _, kind := range []string{"send", "recv"} {
		t.Run(kind, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				c := soloComm(t, b, library(t, b))
				defer func() { require.NoError(t, c.Close()) }()
				buf := buffer(t, b.Device(t, 0), 2*mib, 2*mib)
				ctx := deadline(t, 10*time.Second)
				start := time.Now()
				g := c.Group()
				if kind == "send" {
					g.Send(buf.Ptr(), mib, nccl.Uint8, 0, nil)
				} else {
					g.Recv(buf.Ptr(), mib, nccl.Uint8, 0, nil)
				}
				err := g.Run(ctx)
				if err == nil {
					err = c.Wait(ctx, nil)
				}
				require.ErrorIs(t, err, nccl.ErrAborted)
				require.ErrorIs(t, err, nccl.ErrInvalidValue)
				require.Less(t, time.Since(start), abortSlack)
			}, testutil.AllowDeviceMemoryLoss(abortedBuffers))
		})
	}
}

// TestMatchedSelfTransfer: a send to itself and the matching receive in one group copy the bytes.
func TestMatchedSelfTransfer(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		c := soloComm(t, b, library(t, b))
		defer func() { require.NoError(t, c.Close()) }()
		dev := b.Device(t, 0)
		src, dst := buffer(t, dev, 2*mib, 2*mib), buffer(t, dev, 2*mib, 2*mib)
		require.NoError(t, dev.Fill(src.Ptr(), 2*mib, 0, 7))
		ctx := deadline(t, 10*time.Second)
		require.NoError(t, c.Group().Send(src.Ptr(), mib, nccl.Uint8, 0, nil).Recv(dst.Ptr(), mib, nccl.Uint8, 0, nil).Run(ctx))
		require.NoError(t, c.Wait(ctx, nil))
		bad, err := dev.Verify(dst.Ptr(), mib, 0, 7)
		require.NoError(t, err)
		require.Zero(t, bad)
	})
}

// TestCloseWhoseFinalizeAndAbortFailIsRetried: Close cannot bind the device for ncclCommFinalize
// nor for the ncclCommAbort that follows; it says so and keeps the communicator open, and the next
// Close runs ncclCommAbort again, so nothing of the communicator is left.
func TestCloseWhoseFinalizeAndAbortFailIsRetried(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := ncclsim.New(b.Sim)
		c := soloComm(t, b, lib)
		b.Sim.FailNth("cuCtxSetCurrent", 1, driver.ErrorUnknown) // the finalize's binding
		b.Sim.FailNth("cuCtxSetCurrent", 1, driver.ErrorUnknown) // the abort's, the next call
		require.ErrorContains(t, c.Close(), "a later Close retries it")
		require.ErrorIs(t, b.Sys.Close(), vmm.ErrInUse, "the communicator is still there")
		require.NoError(t, c.Close())
		require.True(t, lib.Live().Zero(), "the simulated NCCL still holds: %s", lib.Live())
	}, testutil.SimOnly())
}

// TestStreamClosedBeforeRunIsRefused: a stream closed after its operation was queued in a group,
// before Run, is refused by Run as an argument error; the communicator stays usable.
func TestStreamClosedBeforeRunIsRefused(t *testing.T) {
	closedStreamIsRefused(t, func(t *testing.T, c *nccl.Comm, buf driver.DevicePtr, s *vmm.Stream) error {
		g := c.Group().AllReduce(buf, buf, 16, nccl.Float32, nccl.Sum, s)
		require.NoError(t, s.Close())
		return g.Run(deadline(t, 10*time.Second))
	})
}

// TestGroupWithARefusedCallRunsNothing: a call that NCCL refuses inside a group (an unknown data
// type) makes ncclGroupEnd fail with that error, and the group's other calls are not run.
func TestGroupWithARefusedCallRunsNothing(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		c := soloComm(t, b, lib)
		defer func() { require.NoError(t, c.Close()) }()
		dev := b.Device(t, 0)
		buf := buffer(t, dev, 2*mib, 2*mib)
		require.NoError(t, dev.Fill(buf.Ptr(), 2*mib, 0, 1))
		var refused, end error
		require.NoError(t, dev.Raw(func(driver.API) error {
			h := c.Handle()
			if err := lib.GroupStart(); err != nil {
				return err
			}
			refused = lib.Send(buf.Ptr(), 16, nccl.DataType(99), 0, h, 0)
			_ = lib.Send(buf.Ptr(), mib, nccl.Uint8, 0, h, 0)
			_ = lib.Recv(buf.Ptr()+mib, mib, nccl.Uint8, 0, h, 0)
			end = lib.GroupEnd()
			return nil
		}))
		require.ErrorIs(t, refused, nccl.ErrInvalidValue)
		require.ErrorIs(t, end, nccl.ErrInvalidValue)
		require.NotErrorIs(t, end, nccl.ErrInProgress)
		require.NoError(t, c.Wait(deadline(t, 10*time.Second), nil))
		bad, err := dev.Verify(buf.Ptr()+mib, mib, mib, 1)
		require.NoError(t, err)
		require.Zero(t, bad, "the group's receive ran")
	}, testutil.SimOnly())
}

// initFailsAtOnce is the simulated NCCL whose ncclCommInitRankConfig hands back a communicator
// together with an error, as NCCL does when an initialization fails before it goes to the
// background; the call leaves no context current on the thread, as a goroutine that moved to
// another thread would find.
type initFailsAtOnce struct {
	*ncclsim.Lib
	api driver.API
}

func (l initFailsAtOnce) CommInitRankConfig(nranks int, id nccl.UniqueID, rank int, dev driver.Device, cfg *nccl.Config) (nccl.CommHandle, error) {
	h, err := l.Lib.CommInitRankConfig(nranks, id, rank, dev, cfg)
	if err != nil && !errors.Is(err, nccl.ErrInProgress) {
		return h, err
	}
	if err := l.api.CtxSetCurrent(0); err != nil {
		return h, err
	}
	return h, nccl.SystemError
}

// TestNewCommFailingAtOnceAbortsOnItsDevice: a communicator whose initialization NCCL refuses at
// once is aborted with its device bound on a locked OS thread, as every NCCL call is made, and
// nothing of it is left.
func TestNewCommFailingAtOnceAbortsOnItsDevice(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := initFailsAtOnce{Lib: ncclsim.New(b.Sim), api: b.Sim}
		id, err := lib.GetUniqueID()
		require.NoError(t, err)
		c, err := nccl.NewComm(deadline(t, 10*time.Second), lib, id, 0, 1, b.Device(t, 0))
		require.ErrorIs(t, err, nccl.ErrSystem)
		require.Nil(t, c)
		require.Empty(t, lib.Unbound(), "NCCL calls made without the communicator's device current")
		require.True(t, lib.Live().Zero(), "the simulated NCCL still holds: %s", lib.Live())
	}, testutil.SimOnly())
}

// TestNewCommFailingAtOnceWhoseAbortFailsIsKept: when the abort of a communicator refused at once
// cannot bind the device, the System keeps it and its retry aborts it.
func TestNewCommFailingAtOnceWhoseAbortFailsIsKept(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := initFailsAtOnce{Lib: ncclsim.New(b.Sim), api: b.Sim}
		id, err := lib.GetUniqueID()
		require.NoError(t, err)
		// 1: the init's binding, 2: initFailsAtOnce clearing it, 3: the abort's binding
		b.Sim.FailNth("cuCtxSetCurrent", 3, driver.ErrorUnknown)
		c, err := nccl.NewComm(deadline(t, 10*time.Second), lib, id, 0, 1, b.Device(t, 0))
		require.ErrorIs(t, err, nccl.ErrSystem)
		require.ErrorContains(t, err, "kept by the System")
		require.Nil(t, c)
		require.NoError(t, b.Sys.RetryOrphans())
		require.Empty(t, lib.Unbound(), "NCCL calls made without the communicator's device current")
		require.True(t, lib.Live().Zero(), "the simulated NCCL still holds: %s", lib.Live())
	}, testutil.SimOnly())
}

// TestRunHoldsStreamsUntilQueued: a group stays in progress until NCCL has queued its operations on
// their streams, which for a receive waits for the peer; Run holds the streams until then, so a
// Close of one on another goroutine waits for Run instead of destroying the stream that NCCL is
// about to queue on (the group then failed with an invalid handle, or queued on a new stream
// given the same value).
func TestRunHoldsStreamsUntilQueued(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		comms := ranks(t, b, lib, 2)
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		dst, src := buffer(t, d0, 2*mib, 2*mib), buffer(t, d1, 2*mib, 2*mib)
		require.NoError(t, d1.Fill(src.Ptr(), 2*mib, 0, 5))
		first, second, s1 := stream(t, d0), stream(t, d0), stream(t, d1)
		ctx := deadline(t, 30*time.Second)
		ran := make(chan error, 1)
		go func() {
			ran <- comms[0].Group().Recv(dst.Ptr(), mib, nccl.Uint8, 1, first).
				Recv(dst.Ptr()+mib, mib, nccl.Uint8, 1, second).Run(ctx)
		}()
		time.Sleep(100 * time.Millisecond) // Run is waiting for rank 1
		closed := make(chan error, 1)
		go func() { closed <- second.Close() }()
		select {
		case err := <-closed:
			t.Errorf("Close returned (%v) while Run still queued on the stream", err)
		case <-time.After(50 * time.Millisecond):
		}
		require.NoError(t, comms[1].Group().Send(src.Ptr(), mib, nccl.Uint8, 0, s1).
			Send(src.Ptr()+mib, mib, nccl.Uint8, 0, s1).Run(ctx))
		require.NoError(t, <-ran)
		require.NoError(t, <-closed)
		require.NoError(t, comms[0].Wait(ctx, first))
		require.NoError(t, comms[1].Wait(ctx, s1))
		require.NoError(t, d0.Synchronize())
		bad, err := d0.Verify(dst.Ptr(), 2*mib, 0, 5)
		require.NoError(t, err)
		require.Zero(t, bad)
	}, testutil.Devices(2))
}

// TestRunHoldsAStreamNamedTwiceOnce: a Close of a stream that comes once Run holds it waits for the
// group, even when the group names the stream again in a later operation; before, Run took a second
// hold for that operation, which the waiting Close refused, and the group failed as if the stream had
// been closed before Run.
func TestRunHoldsAStreamNamedTwiceOnce(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		c, buf, s := soloWithStream(t, b)
		var closed <-chan error
		defer nccl.SetHoldStream(func(st *vmm.Stream) (func(), error) {
			release, err := st.Hold()
			if err == nil && closed == nil {
				closed = closeOnceWaiting(t, st)
			}
			return release, err
		})()
		ctx := deadline(t, 10*time.Second)
		err := c.Group().AllReduce(buf.Ptr(), buf.Ptr(), 16, nccl.Float32, nccl.Sum, s).
			AllReduce(buf.Ptr()+mib, buf.Ptr()+mib, 16, nccl.Float32, nccl.Sum, s).Run(ctx)
		require.NoError(t, <-closed)
		require.NoError(t, err, "the stream was open when Run held it first")
	}, testutil.SimOnly())
}

// closeOnceWaiting starts s.Close on another goroutine and returns once it waits for the calls in
// progress on s (a new hold is refused), with the channel its result comes on.
func closeOnceWaiting(t *testing.T, s *vmm.Stream) <-chan error {
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	for {
		probe, err := s.Hold()
		if err != nil {
			return closed
		}
		probe()
		time.Sleep(time.Millisecond)
	}
}

// TestRefusedGroupReleasesItsHolds: a group refused for a closed stream releases the streams it held
// already, so their Close does not wait.
func TestRefusedGroupReleasesItsHolds(t *testing.T) {
	closedStreamIsRefused(t, func(t *testing.T, c *nccl.Comm, buf driver.DevicePtr, s *vmm.Stream) error {
		open, err := s.Device().CreateStream(vmm.StreamOptions{NonBlocking: true})
		require.NoError(t, err)
		require.NoError(t, s.Close())
		err = c.Group().AllReduce(buf, buf, 16, nccl.Float32, nccl.Sum, open).
			AllReduce(buf, buf, 16, nccl.Float32, nccl.Sum, s).Run(deadline(t, 10*time.Second))
		closed := make(chan error, 1)
		go func() { closed <- open.Close() }()
		select {
		case closeErr := <-closed:
			require.NoError(t, closeErr)
		case <-time.After(5 * time.Second):
			t.Fatal("the refused group still holds the stream it held before the closed one")
		}
		return err
	})
}
