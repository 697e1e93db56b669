package pinned_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pinned"
)

// A shared-memory region larger than a file can be (an int64 size) is a bad size, ErrInvalidValue,
// like one whose rounding overflows; not the error of a negative file length.
func TestSharedMemoryRefusesSizeBeyondFile(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		for _, size := range []uint64{math.MaxInt64 + 1, math.MaxUint64 - 4*mib} {
			_, err := pinned.New(d, size, pinned.Options{Kind: pinned.SharedMemory})
			require.ErrorIs(t, err, pinned.ErrInvalidValue, "size %#x", size)
			_, err = pinned.New(d, size, pinned.Options{Kind: pinned.SharedMemory, CPUOnly: true})
			require.ErrorIs(t, err, pinned.ErrInvalidValue, "size %#x", size)
		}
	})
}
