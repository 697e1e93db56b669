package nccl_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/nccl"
	"github.com/cuvmm/cuvmm/nccl/ncclsim"
	"github.com/cuvmm/cuvmm/vmm"
)

const mib = 1 << 20

// TestSendRecvBuffer moves a growable buffer of several chunks from rank 0 to rank 1, whole and then
// chunk by chunk, and checks the pattern arrived each time.
func TestSendRecvBuffer(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		comms := ranks(t, b, lib, 2)
		require.Equal(t, 1, comms[1].Rank())
		require.Equal(t, 2, comms[1].NRanks())
		const size = 7 * mib
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		src, dst := buffer(t, d0, size, 2*mib), buffer(t, d1, size, 2*mib)
		s0, s1 := stream(t, d0), stream(t, d1)
		for seed, chunked := range []bool{false, true} {
			require.NoError(t, d0.Fill(src.Ptr(), size, 0, uint64(seed)))
			require.NoError(t, d1.Memset(dst.Ptr(), 0, size))
			noErrors(t, parallel(2, func(rank int) error {
				ctx := deadline(t, 30*time.Second)
				c := comms[rank]
				g := c.Group()
				switch {
				case rank == 0 && chunked:
					g.SendChunks(src, 1, s0)
				case rank == 0:
					g.SendBuffer(src, 1, s0)
				case chunked:
					g.RecvChunks(dst, 0, s1)
				default:
					g.RecvBuffer(dst, 0, s1)
				}
				if err := g.Run(ctx); err != nil {
					return err
				}
				return c.Wait(ctx, []*vmm.Stream{s0, s1}[rank])
			}))
			bad, err := d1.Verify(dst.Ptr(), size, 0, uint64(seed))
			require.NoError(t, err)
			require.Zero(t, bad, "chunked=%v: words that differ from the pattern", chunked)
		}
		require.Len(t, nccl.Layout(src), 4)
	}, testutil.Devices(2))
}

// blockedDestroy is an NCCL whose ncclCommDestroy waits for release, as NCCL's does while a rank of
// another process has not closed its communicator.
type blockedDestroy struct {
	nccl.API
	release chan struct{}
}

func (b blockedDestroy) CommDestroy(h nccl.CommHandle) error {
	<-b.release
	return b.API.CommDestroy(h)
}

// blockedPair makes two ranks over an NCCL whose ncclCommDestroy waits until release is called (also
// at the test's end), with closeTimeout as Options.CloseTimeout.
func blockedPair(t *testing.T, b *testutil.Backend, closeTimeout time.Duration) ([]*nccl.Comm, *ncclsim.Lib, func()) {
	t.Helper()
	lib := library(t, b).(*ncclsim.Lib)
	slow := blockedDestroy{API: lib, release: make(chan struct{})}
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(slow.release) }) }
	t.Cleanup(release) // also when the test fails early
	id, err := slow.GetUniqueID()
	require.NoError(t, err)
	comms := make([]*nccl.Comm, 2)
	noErrors(t, parallel(2, func(r int) (err error) {
		comms[r], err = nccl.NewComm(deadline(t, 10*time.Second), slow, id, r, 2, b.Device(t, r), nccl.Options{CloseTimeout: closeTimeout})
		return err
	}))
	return comms, lib, release
}

// TestCloseWhilePeersStayOpen: a destroy that waits for peers makes Close return ErrInUse after
// CloseTimeout instead of hanging; the destroy ends once the peers close, releasing everything.
func TestCloseWhilePeersStayOpen(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		comms, lib, release := blockedPair(t, b, 100*time.Millisecond)
		buf := buffer(t, b.Device(t, 0), 2*mib, 2*mib)
		start := time.Now()
		err := comms[0].Close()
		require.ErrorIs(t, err, nccl.ErrInUse)
		require.Contains(t, err.Error(), "ranks of other processes")
		require.Less(t, time.Since(start), 5*time.Second)
		require.ErrorIs(t, comms[0].Group().Send(buf.Ptr(), 1, nccl.Uint8, 1, nil).Run(deadline(t, time.Second)), nccl.ErrClosed)
		require.NoError(t, comms[0].Close(), "closed once; Close is idempotent")
		release()
		require.NoError(t, comms[1].Close())
		require.Eventually(t, func() bool { return lib.Live().Zero() }, 5*time.Second, 10*time.Millisecond,
			"the destroy left in the background ends once released")
	}, testutil.Devices(2), testutil.SimOnly())
}

// TestAbortEndsACloseWaitingForPeers: Abort, called while Close waits in a destroy for the ranks of
// other processes, makes Close return ErrInUse at once rather than after CloseTimeout; the destroy
// ends in the background once the peers close.
func TestAbortEndsACloseWaitingForPeers(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		comms, lib, release := blockedPair(t, b, time.Minute)
		closed := make(chan error, 1)
		go func() { closed <- comms[0].Close() }()
		time.Sleep(100 * time.Millisecond) // Close reaches the destroy
		start := time.Now()
		require.NoError(t, comms[0].Abort())
		require.ErrorIs(t, <-closed, nccl.ErrInUse)
		require.Less(t, time.Since(start), 5*time.Second, "Abort waited for the destroy")
		release()
		require.NoError(t, comms[1].Close())
		require.Eventually(t, func() bool { return lib.Live().Zero() }, 5*time.Second, 10*time.Millisecond,
			"the destroy left in the background ends once released")
	}, testutil.Devices(2), testutil.SimOnly())
}

// TestCloseWhileAnotherCallRuns: Close does not wait for a call of another goroutine (a receive
// whose sender never comes) but returns ErrInUse at once; Abort interrupts the call, after which
// Close succeeds.
func TestCloseWhileAnotherCallRuns(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		comms := ranks(t, b, library(t, b), 2)
		buf := buffer(t, b.Device(t, 0), 2*mib, 2*mib)
		recv := make(chan error, 1)
		go func() { recv <- comms[0].Recv(context.Background(), buf.Ptr(), 16, nccl.Uint8, 1, nil) }()
		time.Sleep(100 * time.Millisecond)
		closed := make(chan error, 1)
		go func() { closed <- comms[0].Close() }()
		select {
		case err := <-closed:
			require.ErrorIs(t, err, nccl.ErrInUse)
		case <-time.After(5 * time.Second):
			_ = comms[0].Abort() // lets the test end
			<-closed
			t.Fatal("Close waited for the receive instead of returning ErrInUse")
		}
		require.NoError(t, comms[0].Abort())
		require.ErrorIs(t, <-recv, nccl.ErrAborted)
		require.NoError(t, comms[0].Close())
	}, testutil.Devices(2), testutil.SimOnly())
}

// TestWaitWithEndedContextAfterTheWork: a context that has already ended does not abort a
// communicator whose stream has nothing left to do.
func TestWaitWithEndedContextAfterTheWork(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		c := ranks(t, b, library(t, b), 1)[0]
		s := stream(t, b.Device(t, 0))
		ended, cancel := context.WithCancel(context.Background())
		cancel()
		for i := range 20 {
			require.NoError(t, c.Wait(ended, s), "wait %d", i)
			require.NoError(t, c.Wait(ended, nil), "wait %d on the whole device", i)
		}
		buf := buffer(t, b.Device(t, 0), 2*mib, 2*mib)
		ctx := deadline(t, 10*time.Second)
		require.NoError(t, c.AllReduce(ctx, buf.Ptr(), buf.Ptr(), 16, nccl.Uint8, nccl.Sum, s), "still usable")
		require.NoError(t, c.Wait(ctx, s))
	}, testutil.SimOnly())
}

// refusingSend is a stand-in whose ncclSend is refused at once, as NCCL's argument checks do.
type refusingSend struct{ *ncclsim.Lib }

func (l refusingSend) Send(driver.DevicePtr, uint64, nccl.DataType, int, nccl.CommHandle, driver.Stream) error {
	return &nccl.CallError{Call: "ncclSend", Result: nccl.InvalidUsage}
}

// TestRefusedCallAbortsTheCommunicator: a call NCCL refuses aborts the communicator, and its error
// wraps ErrAborted with NCCL's.
func TestRefusedCallAbortsTheCommunicator(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		c := ranks(t, b, refusingSend{library(t, b).(*ncclsim.Lib)}, 1)[0]
		buf := buffer(t, b.Device(t, 0), 2*mib, 2*mib)
		ctx := deadline(t, 10*time.Second)
		err := c.Send(ctx, buf.Ptr(), 16, nccl.Uint8, 0, nil)
		require.ErrorIs(t, err, nccl.ErrAborted)
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		require.ErrorIs(t, c.Send(ctx, buf.Ptr(), 16, nccl.Uint8, 0, nil), nccl.ErrAborted, "aborted by the first")
	}, testutil.SimOnly())
}
