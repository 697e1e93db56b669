package pinned_test

import (
	"bytes"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// edgeStager makes size bytes of device memory on d and a stager of 1 MiB buffers, both freed at
// the end of the test (the stager first).
func edgeStager(t *testing.T, d *vmm.Device, size uint64) (driver.DevicePtr, *pinned.Stager) {
	t.Helper()
	dev, free := deviceBuffer(t, d, size)
	t.Cleanup(free)
	st, err := pinned.NewStager(d, pinned.StagerOptions{BufferSize: mib})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, st.Close()) })
	return dev, st
}

// A transfer whose size no int64 count can report, or whose device range wraps the address space,
// is refused instead of its chunk count overflowing into a transfer of nothing that succeeds.
func TestStagerRefusesHugeSizes(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev, st := edgeStager(t, b.Device(t, 0), 2*mib)
		ctx := t.Context()

		for _, n := range []uint64{math.MaxUint64, math.MaxUint64 - mib + 2, math.MaxInt64 + 1} {
			r, err := st.ReaderToDevice(ctx, dev, bytes.NewReader(make([]byte, 10)), n)
			require.ErrorIs(t, err, pinned.ErrInvalidValue, "reader to device of %#x bytes", n)
			require.Zero(t, r)
			w, err := st.DeviceToWriter(ctx, &bytes.Buffer{}, dev, n)
			require.ErrorIs(t, err, pinned.ErrInvalidValue, "device to writer of %#x bytes", n)
			require.Zero(t, w)
		}
		_, err := st.DeviceToWriter(ctx, &bytes.Buffer{}, driverPtr(math.MaxUint64-mib+1), 2*mib)
		require.ErrorIs(t, err, pinned.ErrInvalidValue, "a range that wraps the address space")
		require.Zero(t, st.Pool().Stats().InUse)
	})
}

// overReader claims extra bytes more than each buffer it is given holds (or, with extra < 0, a
// negative count), as no io.Reader may.
type overReader struct{ extra int }

func (o overReader) Read(p []byte) (int, error) {
	if o.extra < 0 {
		return o.extra, nil
	}
	return len(p) + o.extra, nil
}

// A reader that reports more bytes than it was asked for (or a negative count) is an error: the
// stager never copies past the chunk it read into, so the device memory after the transfer keeps
// its bytes.
func TestStagerRefusesReaderOverCount(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		const size = 4 * mib
		dev, st := edgeStager(t, d, size)

		for _, extra := range []int{4 * kib, -1} {
			require.NoError(t, d.Fill(dev, size, 0, 21))
			r, err := st.ReaderToDevice(t.Context(), dev, overReader{extra}, mib)
			require.ErrorIs(t, err, pinned.ErrInvalidValue, "extra %d", extra)
			require.LessOrEqual(t, r, int64(mib))
			bad, err := d.Verify(dev+driverPtr(mib), size-mib, mib, 21)
			require.NoError(t, err)
			require.Zero(t, bad, "extra %d: the bytes after the transfer are untouched", extra)
			require.Zero(t, st.Pool().Stats().InUse)
		}
	})
}

// countWriter reports n bytes written whatever it is given, as no io.Writer may when n is negative
// or more than it was given.
type countWriter struct{ n int }

func (c countWriter) Write([]byte) (int, error) { return c.n, nil }

// A writer that reports a negative count, or more bytes than it was given, is an error and adds
// nothing to the count of bytes written, as io.Copy treats it.
func TestStagerRefusesWriterBadCount(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev, st := edgeStager(t, b.Device(t, 0), 2*mib)

		for _, n := range []int{-1, 2 * mib} {
			w, err := st.DeviceToWriter(t.Context(), countWriter{n}, dev, mib)
			require.ErrorIs(t, err, pinned.ErrInvalidValue, "count %d", n)
			require.Zero(t, w, "count %d", n)
			require.Zero(t, st.Pool().Stats().InUse)
		}
	})
}
