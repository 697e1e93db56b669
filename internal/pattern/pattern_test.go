package pattern

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
)

func TestHostReference(t *testing.T) {
	b := make([]byte, 64)
	FillHost(b, 16, 7)
	require.Zero(t, CountHost(b, 16, 7))
	require.Equal(t, uint64(8), CountHost(b, 16, 8))
	require.Equal(t, uint64(8), CountHost(b, 0, 7), "a shifted offset is a different pattern")
	b[9] ^= 1
	require.Equal(t, uint64(1), CountHost(b, 16, 7))
	require.Equal(t, Word(2, 7), uint64(b[0])|uint64(b[1])<<8|uint64(b[2])<<16|uint64(b[3])<<24|uint64(b[4])<<32|uint64(b[5])<<40|uint64(b[6])<<48|uint64(b[7])<<56)
}

func TestCheck(t *testing.T) {
	require.Empty(t, Check(8, 8, 0))
	require.NotEmpty(t, Check(8, 0, 0))
	require.NotEmpty(t, Check(4, 8, 0))
	require.NotEmpty(t, Check(8, 12, 0))
	require.NotEmpty(t, Check(8, 8, 3))
	var k Kernels
	k.blocks = 2
	require.Equal(t, driver.Dim3{X: 1, Y: 1, Z: 1}, k.grid(1))
	require.Equal(t, driver.Dim3{X: 2, Y: 1, Z: 1}, k.grid(1<<20))
}
