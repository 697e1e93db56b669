package nccl_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/nccl"
	"github.com/cuvmm/cuvmm/vmm"
)

const disagreeDeadline = 3 * time.Second

// TestRanksDisagree: a receiver expecting more bytes than were sent, and a receiver waiting for
// itself instead of the peer that sends to it. Neither may hang past the deadline.
//   - count: the stand-in reports the mismatch; NCCL does not check counts, and the receive ends with
//     the bytes that were sent (seen with NCCL 2.28), so on the real NCCL only the time is checked.
//   - peer: the receiver's communicator is aborted at once by the invalid-usage report of a receive
//     from itself with no matching send (ErrInvalidValue); the sender, whose peer is gone, by the
//     deadline.
func TestRanksDisagree(t *testing.T) {
	for _, tc := range []struct {
		name  string
		count [2]uint64 // bytes rank 0 sends, rank 1 receives
		from  int       // the rank rank 1 receives from
	}{
		{"count", [2]uint64{1 * mib, 2 * mib}, 0},
		{"peer", [2]uint64{1 * mib, 1 * mib}, 1},
	} {
		opts := []testutil.Option{testutil.Devices(2)}
		if tc.name == "peer" { // both ranks are aborted with their operation in flight
			opts = append(opts, testutil.AllowDeviceMemoryLoss(abortedBuffers))
		}
		t.Run(tc.name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				lib := library(t, b)
				d0, d1 := b.Device(t, 0), b.Device(t, 1)
				bufs := []vmm.Chunked{buffer(t, d0, 2*mib, 2*mib), buffer(t, d1, 2*mib, 2*mib)}
				comms := ranks(t, b, lib, 2)
				start := time.Now()
				errs := parallel(2, func(r int) error {
					ctx := deadline(t, disagreeDeadline)
					g := comms[r].Group()
					if r == 0 {
						g.Send(bufs[0].Ptr(), tc.count[0], nccl.Uint8, 1, nil)
					} else {
						g.Recv(bufs[1].Ptr(), tc.count[1], nccl.Uint8, tc.from, nil)
					}
					if err := g.Run(ctx); err != nil {
						return err
					}
					return comms[r].Wait(ctx, nil)
				})
				took := time.Since(start)
				t.Logf("after %v: rank 0: %v; rank 1: %v", took, errs[0], errs[1])
				require.Less(t, took, disagreeDeadline+abortSlack)
				switch {
				case tc.name == "count" && b.IsSim():
					require.Error(t, errs[1], "the stand-in reports the count mismatch")
				case tc.name == "peer":
					require.ErrorIs(t, errs[1], nccl.ErrAborted)
					require.True(t, errors.Is(errs[1], context.DeadlineExceeded) || errors.Is(errs[1], nccl.ErrInvalidValue), "%v", errs[1])
					if !b.IsSim() {
						require.ErrorIs(t, errs[0], nccl.ErrAborted, "the sender waits for a receiver that is gone")
					}
				}
			}, opts...)
		})
	}
}

// abortedBuffers bounds the device memory NCCL 2.28 keeps after a communicator is aborted with an
// operation in flight: its connection buffers, seen at 320 MiB on a receiver's device and 64 MiB on
// a sender's (two H200s, NCCL's default 32 channels).
const abortedBuffers = 512 << 20

// TestInitDisagree: ranks that disagree on the communicator's size. NCCL's bootstrap root drops them
// and both wait in bootstrap until the deadline aborts them; NCCL leaves their bootstrap's listening
// sockets open (AllowListeningSockets).
func TestInitDisagree(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		id, err := lib.GetUniqueID()
		require.NoError(t, err)
		start := time.Now()
		errs := parallel(2, func(r int) error {
			ctx := deadline(t, disagreeDeadline)
			c, err := nccl.NewComm(ctx, lib, id, r, 2+r, b.Device(t, r)) // rank 1 says 3 ranks
			if err == nil {
				c.Close()
				return errors.New("joined a communicator whose ranks disagree on its size")
			}
			return err
		})
		took := time.Since(start)
		t.Logf("after %v: %v; %v", took, errs[0], errs[1])
		require.Error(t, errs[0])
		require.Error(t, errs[1])
		require.Less(t, took, disagreeDeadline+abortSlack)
	}, testutil.Devices(2), testutil.AllowListeningSockets())
}

// TestRankNeverJoins: one rank alone, the other never calls NewComm; the deadline aborts. On the
// simulator only: with NCCL, the bootstrap root that ncclGetUniqueId started (a thread of this
// process) keeps waiting for the missing rank with its socket open for the life of the process,
// which the per-test descriptor check would count as a leak.
func TestRankNeverJoins(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		id, err := lib.GetUniqueID()
		require.NoError(t, err)
		start := time.Now()
		_, err = nccl.NewComm(deadline(t, time.Second), lib, id, 0, 2, b.Device(t, 0))
		require.ErrorIs(t, err, nccl.ErrAborted)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Less(t, time.Since(start), time.Second+abortSlack)
	}, testutil.SimOnly())
}

// TestAbortFromAnotherGoroutine: a receive that nobody answers returns as soon as another goroutine
// calls Abort, long before its deadline.
func TestAbortFromAnotherGoroutine(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		d1 := b.Device(t, 1)
		buf := buffer(t, d1, 2*mib, 2*mib)
		comms := ranks(t, b, lib, 2)
		done := make(chan error, 1)
		start := time.Now()
		go func() {
			ctx := deadline(t, time.Minute)
			err := comms[1].Recv(ctx, buf.Ptr(), mib, nccl.Uint8, 0, nil)
			if err == nil {
				err = comms[1].Wait(ctx, nil)
			}
			done <- err
		}()
		time.Sleep(200 * time.Millisecond)
		require.NoError(t, comms[1].Abort())
		err := <-done
		require.ErrorIs(t, err, nccl.ErrAborted)
		require.Less(t, time.Since(start), abortSlack)
		require.NoError(t, comms[1].Abort(), "idempotent")
	}, testutil.Devices(2), testutil.AllowDeviceMemoryLoss(abortedBuffers))
}
