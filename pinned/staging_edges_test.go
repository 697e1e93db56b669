package pinned_test

import (
	"bytes"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pinned"
)

// A transfer whose size no int64 count can report, or whose device range wraps the address space,
// is refused instead of its chunk count overflowing into a transfer of nothing that succeeds.
func TestStagerRefusesHugeSizes(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		dev, free := deviceBuffer(t, d, 2*mib)
		defer free()
		st, err := pinned.NewStager(d, pinned.StagerOptions{BufferSize: mib})
		require.NoError(t, err)
		defer func() { require.NoError(t, st.Close()) }()
		ctx := t.Context()

		for _, n := range []uint64{math.MaxUint64, math.MaxUint64 - mib + 2, math.MaxInt64 + 1} {
			r, err := st.ReaderToDevice(ctx, dev, bytes.NewReader(make([]byte, 10)), n)
			require.ErrorIs(t, err, pinned.ErrInvalidValue, "reader to device of %#x bytes", n)
			require.Zero(t, r)
			w, err := st.DeviceToWriter(ctx, &bytes.Buffer{}, dev, n)
			require.ErrorIs(t, err, pinned.ErrInvalidValue, "device to writer of %#x bytes", n)
			require.Zero(t, w)
		}
		_, err = st.DeviceToWriter(ctx, &bytes.Buffer{}, driverPtr(math.MaxUint64-mib+1), 2*mib)
		require.ErrorIs(t, err, pinned.ErrInvalidValue, "a range that wraps the address space")
		require.Zero(t, st.Pool().Stats().InUse)
	})
}
