package pinned_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pinned"
)

// failingWriter accepts limit bytes, then fails.
type failingWriter struct {
	limit, n int
	err      error
	short    bool // write short instead of failing
}

var errDiskFull = errors.New("disk full")

func (w *failingWriter) Write(p []byte) (int, error) {
	if w.n+len(p) <= w.limit {
		w.n += len(p)
		return len(p), nil
	}
	k := w.limit - w.n
	w.n = w.limit
	if w.short {
		return k, nil
	}
	return k, w.err
}

// failingReader gives limit bytes of r, then fails with err (io.EOF: a short reader).
type failingReader struct {
	r     io.Reader
	limit int
	err   error
}

func (f *failingReader) Read(p []byte) (int, error) {
	if f.limit == 0 {
		return 0, f.err
	}
	p = p[:min(len(p), f.limit)]
	n, err := f.r.Read(p)
	f.limit -= n
	return n, err
}

func TestStagingRoundTrip(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		const size = 6 * mib
		src, freeSrc := deviceBuffer(t, d, size)
		defer freeSrc()
		dst, freeDst := deviceBuffer(t, d, size)
		defer freeDst()
		require.NoError(t, d.Fill(src, size, 0, 11))

		st, err := pinned.NewStager(d, pinned.StagerOptions{Buffers: 3, BufferSize: mib})
		require.NoError(t, err)
		defer func() { require.NoError(t, st.Close()) }()
		require.Equal(t, uint64(mib), st.ChunkSize())
		require.NotNil(t, st.Stream())

		// Device → writer, a size that is not a whole number of chunks.
		n := uint64(5*mib + 24)
		var out bytes.Buffer
		w, err := st.DeviceToWriter(t.Context(), &out, src, n)
		require.NoError(t, err)
		require.Equal(t, int64(n), w)
		require.Equal(t, int(n), out.Len())
		require.Zero(t, badWords(out.Bytes(), 0, 11), "the writer got the device's bytes in order")

		// Reader → device, then the device holds the same pattern.
		r, err := st.ReaderToDevice(t.Context(), dst, bytes.NewReader(out.Bytes()), n)
		require.NoError(t, err)
		require.Equal(t, int64(n), r)
		bad, err := d.Verify(dst, 5*mib+24, 0, 11)
		require.NoError(t, err)
		require.Zero(t, bad)

		// Nothing to do.
		w, err = st.DeviceToWriter(t.Context(), &out, src, 0)
		require.NoError(t, err)
		require.Zero(t, w)
		require.Zero(t, st.Pool().Stats().InUse, "every buffer went back")
	})
}

func TestStagingFailures(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		const size = 4 * mib
		src, freeSrc := deviceBuffer(t, d, size)
		defer freeSrc()
		require.NoError(t, d.Fill(src, size, 0, 12))
		pool, err := pinned.CreatePool(d, 512*kib, 3, pinned.Options{})
		require.NoError(t, err)
		defer func() { require.NoError(t, pool.Close()) }()
		st, err := pinned.NewStager(d, pinned.StagerOptions{Pool: pool})
		require.NoError(t, err)
		defer func() { require.NoError(t, st.Close()) }()
		ctx := t.Context()

		// A writer that fails mid-stream: the error comes back with the bytes written, and the
		// stager is left clean (stream drained, buffers back in the pool).
		fw := &failingWriter{limit: 1*mib + 100, err: errDiskFull}
		w, err := st.DeviceToWriter(ctx, fw, src, size)
		require.ErrorIs(t, err, errDiskFull)
		require.ErrorContains(t, err, "chunk 2 of 8")
		require.Equal(t, int64(1*mib+100), w)
		require.Zero(t, pool.Stats().InUse)

		// A writer that writes short is io.ErrShortWrite.
		_, err = st.DeviceToWriter(ctx, &failingWriter{limit: 100, short: true}, src, size)
		require.ErrorIs(t, err, io.ErrShortWrite)

		// A cancelled context stops the transfer.
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		_, err = st.DeviceToWriter(cctx, io.Discard, src, size)
		require.ErrorIs(t, err, context.Canceled)
		_, err = st.ReaderToDevice(cctx, src, bytes.NewReader(make([]byte, size)), size)
		require.ErrorIs(t, err, context.Canceled)

		// A short reader: io.ErrUnexpectedEOF, and the bytes it gave are on the device.
		data := make([]byte, size)
		fillCPU(data, 0, 13)
		r, err := st.ReaderToDevice(ctx, src, bytes.NewReader(data[:3*mib/2]), size)
		require.ErrorIs(t, err, io.ErrUnexpectedEOF)
		require.ErrorContains(t, err, "ended after 1572864 of 4194304 bytes")
		require.Equal(t, int64(3*mib/2), r)
		bad, err := d.Verify(src, 3*mib/2, 0, 13)
		require.NoError(t, err)
		require.Zero(t, bad)
		// An empty reader is short too.
		_, err = st.ReaderToDevice(ctx, src, bytes.NewReader(nil), size)
		require.ErrorIs(t, err, io.ErrUnexpectedEOF)
		// A reader that fails.
		_, err = st.ReaderToDevice(ctx, src, &failingReader{r: bytes.NewReader(data), limit: mib, err: errDiskFull}, size)
		require.ErrorIs(t, err, errDiskFull)
		require.Zero(t, pool.Stats().InUse)

		if b.IsSim() {
			// A copy the driver refuses (an address nobody mapped) ends the transfer with the
			// driver's error, drained and clean. (Not tried on a GPU, where a bad address may
			// poison the context for the rest of the test binary.)
			_, err = st.DeviceToWriter(ctx, io.Discard, 0x1000, size)
			require.Error(t, err)
			require.Zero(t, pool.Stats().InUse)
		}

		// Bad arguments.
		_, err = st.DeviceToWriter(ctx, nil, src, size)
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		_, err = st.ReaderToDevice(ctx, src, nil, size)
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		_, err = pinned.NewStager(d, pinned.StagerOptions{Buffers: 1})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		_, err = pinned.NewStager(d, pinned.StagerOptions{Pool: pool, Buffers: 4})
		require.ErrorIs(t, err, pinned.ErrInvalidValue, "the pool has only 3 buffers")
		_, err = pinned.NewStager(nil, pinned.StagerOptions{})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		_, err = pinned.NewStager(d, pinned.StagerOptions{Region: pinned.Options{CPUOnly: true}})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)

		// The pool is shared: while the stager runs nobody else may close it.
		buf, ok := pool.TryGet()
		require.True(t, ok)
		_, err = st.DeviceToWriter(ctx, io.Discard, src, mib) // needs 2 of the 2 buffers left
		require.NoError(t, err)
		tctx, cancel2 := context.WithCancel(ctx)
		cancel2()
		b2, _ := pool.TryGet()
		_, err = st.DeviceToWriter(tctx, io.Discard, src, mib) // only 1 left: waits, then gives up
		require.ErrorIs(t, err, context.Canceled)
		require.NoError(t, b2.Release())
		require.NoError(t, buf.Release())

		require.NoError(t, st.Close())
		_, err = st.DeviceToWriter(ctx, io.Discard, src, size)
		require.ErrorIs(t, err, pinned.ErrClosed)
	})
}

// A stager over a host-NUMA region that its device was not granted is refused up front.
func TestStagerNeedsVisibleRegion(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		if !pinned.SupportsHostNUMA(d0) {
			t.Skip("the device reports no host-NUMA VMM support")
		}
		pool, err := pinned.CreatePool(d0, mib, 2, pinned.Options{Kind: pinned.HostNUMA})
		require.NoError(t, err)
		defer func() { require.NoError(t, pool.Close()) }()
		_, err = pinned.NewStager(d1, pinned.StagerOptions{Pool: pool})
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		require.ErrorContains(t, err, "not visible")
		require.NoError(t, pool.Region().Grant(d1))
		st, err := pinned.NewStager(d1, pinned.StagerOptions{Pool: pool})
		require.NoError(t, err)
		require.NoError(t, st.Close())
	}, testutil.Devices(2))
}

// Stagers sharing a pool that holds buffers for only one transfer at a time take turns instead of
// each holding half of what the other waits for.
func TestStagersShareAPool(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		src, free := deviceBuffer(t, d, 2*mib)
		defer free()
		require.NoError(t, d.Fill(src, 2*mib, 0, 14))
		pool, err := pinned.CreatePool(d, 256*kib, 3, pinned.Options{})
		require.NoError(t, err)
		defer func() { require.NoError(t, pool.Close()) }()
		var stagers []*pinned.Stager
		for i := 0; i < 4; i++ {
			st, err := pinned.NewStager(d, pinned.StagerOptions{Pool: pool, Buffers: 2})
			require.NoError(t, err)
			defer func() { require.NoError(t, st.Close()) }()
			stagers = append(stagers, st)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		defer cancel()
		errs := make(chan error, len(stagers))
		for _, st := range stagers {
			go func() {
				for i := 0; i < 5; i++ {
					var out bytes.Buffer
					if _, err := st.DeviceToWriter(ctx, &out, src, 2*mib); err != nil {
						errs <- err
						return
					}
					if badWords(out.Bytes(), 0, 14) != 0 {
						errs <- errors.New("wrong bytes")
						return
					}
				}
				errs <- nil
			}()
		}
		for range stagers {
			require.NoError(t, <-errs)
		}
		require.Zero(t, pool.Stats().InUse)
	})
}

// A stager waits on events that sleep by default and on events that spin with SpinWait; either
// way it moves the same bytes both ways.
func TestStagerWaitKinds(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		const n = 3*mib + 40
		src, freeSrc := deviceBuffer(t, d, 4*mib)
		defer freeSrc()
		dst, freeDst := deviceBuffer(t, d, 4*mib)
		defer freeDst()
		require.NoError(t, d.Fill(src, 4*mib, 0, 13))
		// events counts the events made so far that sleep and that spin (the simulator only).
		events := func() [2]int {
			if b.Sim == nil {
				return [2]int{}
			}
			c := b.Sim.EventsCreated
			return [2]int{c(driver.EventBlockingSync | driver.EventDisableTiming), c(driver.EventDisableTiming)}
		}
		for _, spin := range []bool{false, true} {
			before := events()
			st, err := pinned.NewStager(d, pinned.StagerOptions{Buffers: 3, BufferSize: mib, SpinWait: spin})
			require.NoError(t, err)
			var out bytes.Buffer
			_, err = st.DeviceToWriter(t.Context(), &out, src, n)
			require.NoError(t, err)
			require.Zero(t, badWords(out.Bytes(), 0, 13), "spin %v: the writer got the device's bytes", spin)
			_, err = st.ReaderToDevice(t.Context(), dst, bytes.NewReader(out.Bytes()), n)
			require.NoError(t, err)
			bad, err := d.Verify(dst, n, 0, 13)
			require.NoError(t, err)
			require.Zero(t, bad, "spin %v: the device got the reader's bytes", spin)
			require.NoError(t, st.Close())
			want := before
			if spin {
				want[1] += 3
			} else {
				want[0] += 3
			}
			if b.Sim != nil {
				require.Equal(t, want, events(), "spin %v: events made (blocking, spinning)", spin)
			}
		}
	})
}
