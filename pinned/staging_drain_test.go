package pinned_test

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// takeAll takes every free buffer of p and fills it with 0x5a, as another user of the pool would.
func takeAll(p *pinned.Pool) []*pinned.Buffer {
	var got []*pinned.Buffer
	for {
		buf, ok := p.TryGet()
		if !ok {
			return got
		}
		for i := range buf.Bytes() {
			buf.Bytes()[i] = 0x5a
		}
		got = append(got, buf)
	}
}

// overwritten releases bufs and lists those whose 0x5a fill something else overwrote.
func overwritten(t *testing.T, bufs []*pinned.Buffer) []int {
	var out []int
	for _, buf := range bufs {
		if !bytes.Equal(buf.Bytes(), bytes.Repeat([]byte{0x5a}, len(buf.Bytes()))) {
			out = append(out, buf.Index())
		}
		require.NoError(t, buf.Release())
	}
	return out
}

// stagerOnPool makes a pool of two 1 MiB buffers and a stager on it, both closed at the end.
func stagerOnPool(t *testing.T, b *testutil.Backend) (*pinned.Pool, *pinned.Stager) {
	d := b.Device(t, 0)
	pool, err := pinned.CreatePool(d, mib, 2, pinned.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pool.Close()) })
	st, err := pinned.NewStager(d, pinned.StagerOptions{Pool: pool})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, st.Close()) })
	return pool, st
}

// A drain whose first cuStreamSynchronize fails is retried: the buffers go back to the pool only
// once the copy still queued into one of them has landed, so the next user's bytes stay its own.
func TestStagerFailedDrainRetriesBeforeReturningBuffers(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		src, freeSrc := deviceBuffer(t, d, 2*mib)
		defer freeSrc()
		require.NoError(t, d.Fill(src, 2*mib, 0, 7))
		pool, st := stagerOnPool(t, b)
		b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown)
		_, err := st.DeviceToWriter(t.Context(), &failingWriter{limit: 0, err: errDiskFull}, src, 2*mib)
		require.ErrorIs(t, err, errDiskFull)
		require.ErrorIs(t, err, driver.ErrorUnknown, "the failed synchronization is reported")
		got := takeAll(pool)
		require.Len(t, got, 2, "a retried drain gives every buffer back")
		require.NoError(t, d.Synchronize())
		require.Empty(t, overwritten(t, got), "buffers owned by another user were overwritten by the stager's queued copy")
	}, testutil.SimOnly())
}

// A stream that cannot be drained keeps the stager's buffers out of the pool (ErrStreamNotDrained);
// they come back, untouched by later users, at the next transfer that drains it, or at Close.
func TestStagerUndrainedStreamHoldsBuffersUntilDrained(t *testing.T) {
	for _, how := range []string{"next transfer", "close"} {
		t.Run(how, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				d := b.Device(t, 0)
				src, freeSrc := deviceBuffer(t, d, 2*mib)
				defer freeSrc()
				require.NoError(t, d.Fill(src, 2*mib, 0, 7))
				pool, st := stagerOnPool(t, b)
				for range vmm.DrainAttempts {
					b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown)
				}
				_, err := st.DeviceToWriter(t.Context(), &failingWriter{limit: 0, err: errDiskFull}, src, 2*mib)
				require.ErrorIs(t, err, errDiskFull)
				require.ErrorIs(t, err, pinned.ErrStreamNotDrained)
				require.Empty(t, takeAll(pool), "buffers a queued copy may still target went back to the pool")
				require.ErrorIs(t, pool.Close(), pinned.ErrInUse)
				if how == "close" {
					require.NoError(t, st.Close())
				} else {
					n, err := st.DeviceToWriter(t.Context(), &failingWriter{limit: 2 * mib}, src, 2*mib)
					require.NoError(t, err)
					require.EqualValues(t, 2*mib, n)
				}
				got := takeAll(pool)
				require.Len(t, got, 2, "the held buffers are back once the stream drained")
				require.NoError(t, d.Synchronize())
				require.Empty(t, overwritten(t, got))
			}, testutil.SimOnly())
		})
	}
}

// A transfer from a reader whose drain fails for good also keeps the buffers: the queued copy to the
// device still reads from one of them.
func TestStagerReaderUndrainedStreamHoldsBuffers(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		dst, freeDst := deviceBuffer(t, d, 2*mib)
		defer freeDst()
		pool, st := stagerOnPool(t, b)
		data := bytes.Repeat([]byte{0x33}, 2*mib)
		for range vmm.DrainAttempts {
			b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown)
		}
		_, err := st.ReaderToDevice(t.Context(), dst, bytes.NewReader(data), 2*mib)
		require.ErrorIs(t, err, pinned.ErrStreamNotDrained)
		require.Empty(t, takeAll(pool))
		require.NoError(t, st.Close())
		got := takeAll(pool)
		require.Len(t, got, 2)
		out := make([]byte, 2*mib)
		require.NoError(t, d.CopyDtoH(out, dst))
		require.Equal(t, data, out, "the device got what the reader gave, not what later users wrote")
		require.Empty(t, overwritten(t, got))
	}, testutil.SimOnly())
}
