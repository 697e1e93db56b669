package units

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseSize(t *testing.T) {
	for in, want := range map[string]uint64{
		"4096": 4096, "64KiB": 64 * KiB, "256MiB": 256 * MiB, "16GiB": 16 * GiB, "16G": 16 * GiB,
		"1.5GiB": 3 * GiB / 2, " 2 mib ": 2 * MiB, "1TB": 1e12, "0": 0, "8b": 8,
	} {
		got, err := ParseSize(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, in := range []string{"", "MiB", "-1", "abc", "1.3B", "99999999999TiB", "NaN", "inf"} {
		_, err := ParseSize(in)
		require.Error(t, err, in)
		require.True(t, errors.Is(err, ErrBadSize), in)
	}
}

// TestParseSizeUnknownUnit: a number with a unit ParseSize does not know says so and lists the units.
func TestParseSizeUnknownUnit(t *testing.T) {
	for in, unit := range map[string]string{"1EiB": "EiB", "2 PB": "PB", "1.5xyz": "xyz"} {
		_, err := ParseSize(in)
		require.ErrorIs(t, err, ErrBadSize, in)
		require.Contains(t, err.Error(), `unknown unit "`+unit+`" (want B, KiB, MiB, GiB, TiB`, in)
	}
}

func TestFormatSize(t *testing.T) {
	require.Equal(t, "2 MiB", FormatSize(2*MiB))
	require.Equal(t, "1.50 MiB", FormatSize(1536*KiB))
	require.Equal(t, "16 GiB", FormatSize(16*GiB))
	require.Equal(t, "12 B", FormatSize(12))
	require.Equal(t, "1.00 KiB", FormatSize(1025))
}

func TestRoundUp(t *testing.T) {
	r, ok := RoundUp(1, 2*MiB)
	require.True(t, ok)
	require.Equal(t, 2*MiB, r)
	r, ok = RoundUp(4*MiB, 2*MiB)
	require.True(t, ok)
	require.Equal(t, 4*MiB, r)
	_, ok = RoundUp(^uint64(0), 2*MiB)
	require.False(t, ok)
}
