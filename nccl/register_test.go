package nccl_test

import (
	"context"
	"errors"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/nccl"
	"github.com/cuvmm/cuvmm/nccl/ncclsim"
	"github.com/cuvmm/cuvmm/vmm"
)

// TestRegisterEveryChunk registers multi-chunk buffers on both ranks (one registration per chunk),
// moves the data chunk by chunk, and checks the errors of registering twice and of closing or
// shrinking a registered buffer; the communicator's Close deregisters what is left.
func TestRegisterEveryChunk(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		const size = 6 * mib
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		// The buffers are made first so that the communicators close (deregistering) before them.
		src, dst := buffer(t, d0, size, 2*mib), buffer(t, d1, size, 2*mib)
		s0, s1 := stream(t, d0), stream(t, d1)
		comms := ranks(t, b, lib, 2)
		ctx := deadline(t, time.Minute)

		reg0, err := comms[0].Register(ctx, src)
		require.NoError(t, err)
		require.Equal(t, 3, reg0.Chunks(), "every chunk registered")
		reg1, err := comms[1].Register(ctx, dst)
		require.NoError(t, err)
		require.Equal(t, 3, reg1.Chunks())

		_, err = comms[0].Register(ctx, src)
		require.ErrorIs(t, err, nccl.ErrAlreadyRegistered)

		err = src.Shrink(2 * mib)
		require.ErrorIs(t, err, vmm.ErrInUse, "shrinking a registered buffer must fail")
		require.Equal(t, uint64(size), src.Cap(), "nothing was unmapped")
		require.NoError(t, src.Resize(size), "a failed Shrink leaves Len where it asked; grow it back")

		require.NoError(t, d0.Fill(src.Ptr(), size, 0, 3))
		noErrors(t, parallel(2, func(r int) error {
			g := comms[r].Group()
			s := []*vmm.Stream{s0, s1}[r]
			if r == 0 {
				g.SendChunks(src, 1, s)
			} else {
				g.RecvChunks(dst, 0, s)
			}
			if err := g.Run(ctx); err != nil {
				return err
			}
			return comms[r].Wait(ctx, s)
		}))
		bad, err := d1.Verify(dst.Ptr(), size, 0, 3)
		require.NoError(t, err)
		require.Zero(t, bad)

		require.NoError(t, reg0.Close())
		require.NoError(t, reg0.Close(), "Close is idempotent")
		require.NoError(t, src.Shrink(2*mib), "deregistered: the buffer may shrink again")
		// reg1 stays registered: closing dst now must fail, and the communicator's Close (at the
		// end of the test) deregisters it, after which the buffer's Close succeeds.
		other, err := growbuf.New(d1, growbuf.Options{Chunk: growbuf.FixedChunks(2 * mib), MaxSize: 1 << 30})
		require.NoError(t, err)
		require.NoError(t, other.Grow(4*mib))
		reg, err := comms[1].Register(ctx, other)
		require.NoError(t, err)
		err = other.Close()
		require.ErrorIs(t, err, vmm.ErrInUse, "closing a registered buffer must fail")
		require.NoError(t, reg.Close())
		require.NoError(t, other.Close())
	}, testutil.Devices(2))
}

// TestRegisterWindows registers every chunk as an NCCL window (2.27+) on both ranks, and a stand-in
// older than 2.27 refuses windows with the minimum version in the error.
func TestRegisterWindows(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		if lib.Version() < nccl.VersionWindow {
			t.Skipf("NCCL %s has no windows", nccl.FormatVersion(lib.Version()))
		}
		comms := ranks(t, b, lib, 2)
		bufs := []*growbuf.Buffer{buffer(t, b.Device(t, 0), 4*mib, 2*mib), buffer(t, b.Device(t, 1), 4*mib, 2*mib)}
		regs := make([]*nccl.Registration, 2)
		noErrors(t, parallel(2, func(r int) error {
			var err error
			regs[r], err = comms[r].Register(deadline(t, time.Minute), bufs[r], nccl.RegisterOptions{Window: true})
			return err
		}))
		require.Equal(t, 2, regs[0].Chunks())
		require.True(t, regs[0].Window())
		noErrors(t, parallel(2, func(r int) error { return regs[r].Close() }))
	}, testutil.Devices(2))

	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := ncclsim.New(b.Sim, ncclsim.Version(22600))
		comms := ranks(t, b, lib, 1)
		buf := buffer(t, b.Device(t, 0), 2*mib, 2*mib)
		_, err := comms[0].Register(context.Background(), buf, nccl.RegisterOptions{Window: true})
		require.ErrorIs(t, err, nccl.ErrNotSupported)
		require.ErrorContains(t, err, "2.27.0")
		reg, err := comms[0].Register(context.Background(), buf)
		require.NoError(t, err, "plain registration exists in 2.26")
		require.NoError(t, reg.Close())
	}, testutil.SimOnly())
}

// TestBadArguments: each refused before anything is issued, with a clear error.
func TestBadArguments(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		comms := ranks(t, b, lib, 2)
		c := comms[0]
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		mine, theirs := buffer(t, d0, 2*mib, 2*mib), buffer(t, d1, 2*mib, 2*mib)
		s0, s1 := stream(t, d0), stream(t, d1)
		ctx := deadline(t, 10*time.Second)

		err := c.Send(ctx, mine.Ptr(), math.MaxUint64/2, nccl.Float32, 1, s0)
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		require.ErrorContains(t, err, "overflow")
		err = c.AllGather(ctx, mine.Ptr(), mine.Ptr(), math.MaxUint64/3, nccl.Uint8, s0)
		require.ErrorIs(t, err, nccl.ErrInvalidValue, "nranks × count overflows")
		err = c.Send(ctx, mine.Ptr(), 16, nccl.Uint8, 2, s0)
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		require.ErrorContains(t, err, "rank 2")
		err = c.Send(ctx, 0, 16, nccl.Uint8, 1, s0)
		require.ErrorContains(t, err, "null")
		err = c.Send(ctx, mine.Ptr(), 16, nccl.DataType(99), 1, s0)
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		err = c.Group().AllReduceBuffer(mine, mine, nccl.DataType(99), nccl.Sum, s0).Run(ctx)
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		require.ErrorContains(t, err, "unknown data type 99")
		err = c.AllReduce(ctx, mine.Ptr(), mine.Ptr(), 16, nccl.Float32, nccl.RedOp(9), s0)
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		require.ErrorContains(t, err, "unknown reduction 9")
		err = c.Send(ctx, mine.Ptr(), 16, nccl.Uint8, 1, s1)
		require.ErrorIs(t, err, nccl.ErrInvalidValue, "a stream of another device")

		err = c.Group().SendBuffer(theirs, 1, s0).Run(ctx)
		require.ErrorIs(t, err, nccl.ErrWrongDevice)
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		_, err = c.Register(ctx, theirs)
		require.ErrorIs(t, err, nccl.ErrWrongDevice)

		closed, err := growbuf.New(d0, growbuf.Options{})
		require.NoError(t, err)
		require.NoError(t, closed.Close())
		err = c.Group().SendBuffer(closed, 1, s0).Run(ctx)
		require.ErrorIs(t, err, nccl.ErrInvalidValue)

		// Nothing was issued: the communicator still works.
		require.NoError(t, d0.Fill(mine.Ptr(), 2*mib, 0, 1))
		noErrors(t, parallel(2, func(r int) error {
			g := comms[r].Group()
			s := []*vmm.Stream{s0, s1}[r]
			if r == 0 {
				g.SendBuffer(mine, 1, s)
			} else {
				g.RecvBuffer(theirs, 0, s)
			}
			if err := g.Run(ctx); err != nil {
				return err
			}
			return comms[r].Wait(ctx, s)
		}))
	}, testutil.Devices(2))
}

// TestNewCommArguments: bad ranks, and a library too old for non-blocking communicators.
func TestNewCommArguments(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := ncclsim.New(b.Sim)
		id, err := lib.GetUniqueID()
		require.NoError(t, err)
		ctx := deadline(t, 5*time.Second)
		_, err = nccl.NewComm(ctx, lib, id, 2, 2, b.Device(t, 0))
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		_, err = nccl.NewComm(ctx, nil, id, 0, 1, b.Device(t, 0))
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		_, err = nccl.NewComm(ctx, lib, nccl.UniqueID{1, 2, 3}, 0, 1, b.Device(t, 0))
		require.ErrorIs(t, err, nccl.ErrInvalidValue, "an ID that is not the library's")

		old := ncclsim.New(b.Sim, ncclsim.Version(21200))
		_, err = nccl.NewComm(ctx, old, id, 0, 1, b.Device(t, 0))
		require.ErrorIs(t, err, nccl.ErrNotSupported)
		require.ErrorContains(t, err, "2.14.0")
		var ve *nccl.VersionError
		require.True(t, errors.As(err, &ve))
		require.Equal(t, 21200, ve.Have)
		require.True(t, lib.Live().Zero(), "%s", lib.Live())
	}, testutil.SimOnly())
}

// failingDeregister is a stand-in whose ncclCommDeregister deregisters and answers ncclInProgress,
// after which the communicator reports ncclRemoteError (a peer died meanwhile) or, when stuck, stays
// in progress forever.
type failingDeregister struct {
	*ncclsim.Lib
	stuck  bool
	called atomic.Bool
}

func (l *failingDeregister) CommDeregister(h nccl.CommHandle, rh nccl.RegHandle) error {
	if err := l.Lib.CommDeregister(h, rh); err != nil {
		return err
	}
	l.called.Store(true)
	return nccl.InProgress
}

func (l *failingDeregister) CommGetAsyncError(h nccl.CommHandle) error {
	switch {
	case !l.called.Load():
		return l.Lib.CommGetAsyncError(h)
	case l.stuck:
		return nccl.InProgress
	}
	return nccl.RemoteError
}

// soloComm makes a one-rank communicator over lib on device 0.
func soloComm(t *testing.T, b *testutil.Backend, lib nccl.API, opts ...nccl.Options) *nccl.Comm {
	t.Helper()
	id, err := lib.GetUniqueID()
	require.NoError(t, err)
	c, err := nccl.NewComm(deadline(t, 10*time.Second), lib, id, 0, 1, b.Device(t, 0), opts...)
	require.NoError(t, err)
	return c
}

// TestRegistrationCloseWhenDeregistrationAborts: the wait for a chunk's deregistration fails and
// aborts the communicator, which forgets its registrations while Close still walks the chunks. Close
// reports the abort, releases every hold (the buffer closes) and leaves nothing registered.
func TestRegistrationCloseWhenDeregistrationAborts(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := &failingDeregister{Lib: library(t, b).(*ncclsim.Lib)}
		buf := buffer(t, b.Device(t, 0), 6*mib, 2*mib)
		c := soloComm(t, b, lib)
		reg, err := c.Register(deadline(t, 10*time.Second), buf)
		require.NoError(t, err)
		require.Equal(t, 3, reg.Chunks())
		require.NotPanics(t, func() { err = reg.Close() })
		require.ErrorIs(t, err, nccl.ErrAborted)
		require.ErrorIs(t, err, nccl.ErrRemote)
		require.Zero(t, reg.Chunks())
		require.NoError(t, reg.Close(), "closed once")
		require.NoError(t, c.Close(), "aborted: Close only marks it closed")
		require.NoError(t, buf.Close(), "every hold was released")
	}, testutil.SimOnly())
}

// TestCommCloseWhenDeregistrationAborts: the communicator's Close deregisters two buffers; the first
// deregistration's wait fails and aborts the communicator. Close reports it without finalizing the
// aborted communicator, and both buffers' holds are released.
func TestCommCloseWhenDeregistrationAborts(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := &failingDeregister{Lib: library(t, b).(*ncclsim.Lib)}
		bufs := []*growbuf.Buffer{buffer(t, b.Device(t, 0), 6*mib, 2*mib), buffer(t, b.Device(t, 0), 4*mib, 2*mib)}
		c := soloComm(t, b, lib)
		regs := make([]*nccl.Registration, len(bufs))
		for i, buf := range bufs {
			var err error
			regs[i], err = c.Register(deadline(t, 10*time.Second), buf)
			require.NoError(t, err)
		}
		var err error
		require.NotPanics(t, func() { err = c.Close() })
		require.ErrorIs(t, err, nccl.ErrAborted)
		require.NotContains(t, err.Error(), "ncclCommFinalize", "an aborted communicator is not finalized")
		for i, buf := range bufs {
			require.Zero(t, regs[i].Chunks())
			require.NoError(t, regs[i].Close())
			require.NoError(t, buf.Close(), "buffer %d: every hold was released", i)
		}
		require.NoError(t, c.Close())
	}, testutil.SimOnly())
}

// TestDeregistrationWaitsCloseTimeout: a deregistration that stays in progress is waited for
// Options.CloseTimeout, not DefaultCloseTimeout, then the communicator is aborted.
func TestDeregistrationWaitsCloseTimeout(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := &failingDeregister{Lib: library(t, b).(*ncclsim.Lib), stuck: true}
		buf := buffer(t, b.Device(t, 0), 2*mib, 2*mib)
		c := soloComm(t, b, lib, nccl.Options{CloseTimeout: 100 * time.Millisecond})
		reg, err := c.Register(deadline(t, 10*time.Second), buf)
		require.NoError(t, err)
		start := time.Now()
		err = reg.Close()
		require.ErrorIs(t, err, nccl.ErrAborted)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Less(t, time.Since(start), 5*time.Second)
		require.NoError(t, c.Close())
	}, testutil.SimOnly())
}

// TestRegistrationChunksDuringAbort: Chunks may be called while another goroutine aborts the
// communicator (go test -race finds no race).
func TestRegistrationChunksDuringAbort(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		buf := buffer(t, b.Device(t, 0), 4*mib, 2*mib)
		c := soloComm(t, b, lib)
		reg, err := c.Register(deadline(t, 10*time.Second), buf)
		require.NoError(t, err)
		stop := make(chan struct{})
		read := make(chan int)
		go func() {
			n := 0
			for {
				select {
				case <-stop:
					read <- n
					return
				default:
					n = reg.Chunks()
				}
			}
		}()
		time.Sleep(time.Millisecond)
		require.NoError(t, c.Abort())
		time.Sleep(time.Millisecond)
		close(stop)
		<-read // the reads raced the abort (the race detector checks them); now, after it:
		require.Zero(t, reg.Chunks(), "the aborted communicator released the registration")
		require.NoError(t, reg.Close())
		require.NoError(t, c.Close())
	}, testutil.SimOnly())
}

// A buffer received from another process (ipc.Buffer) and closed lists no chunks, so Register
// refuses it as it refuses a closed growbuf.Buffer, rather than registering a freed range.
func TestRegisterClosedReceivedBuffer(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		dev := b.Device(t, 0)
		src := buffer(t, dev, 4*mib, 2*mib)
		e, err := ipc.Export(src)
		require.NoError(t, err)
		defer e.Close()
		rb, err := ipc.Open(dev, &ipc.Received{Desc: e.Desc, Files: e.Files})
		require.NoError(t, err)
		require.NoError(t, rb.Close())
		c := soloComm(t, b, lib)
		reg, err := c.Register(deadline(t, 10*time.Second), rb)
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		require.NoError(t, reg.Close())
		require.NoError(t, c.Close())
	}, testutil.SimOnly())
}

// A buffer whose chunk is asleep (vmm.Allocation.ReleaseAt, as offload does) has no memory there:
// Register refuses it with vmm.ErrAsleep and registers nothing, rather than holding memory that is
// gone. Once the chunk is awake again, the buffer registers.
func TestRegisterAsleepChunk(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		c := soloComm(t, b, library(t, b))
		defer func() { require.NoError(t, c.Close()) }()
		buf := buffer(t, dev, 4*mib, 2*mib)
		ch := buf.Chunks()[1]
		ptr := buf.Ptr() + driver.DevicePtr(ch.Offset)
		rw := []vmm.Access{vmm.ReadWrite(dev)}
		require.NoError(t, ch.Allocation.ReleaseAt(ptr, rw, true, nil))

		reg, err := c.Register(deadline(t, 10*time.Second), buf)
		require.ErrorIs(t, err, vmm.ErrAsleep)
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		require.NoError(t, reg.Close())

		require.NoError(t, ch.Allocation.RecreateAt(ptr, rw))
		reg, err = c.Register(deadline(t, 10*time.Second), buf)
		require.NoError(t, err)
		require.NoError(t, reg.Close())
	})
}
