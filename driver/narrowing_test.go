//go:build cgo && linux

package driver

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Go ints crossing into C ints are checked, so that a value out of range is refused as the simulator
// refuses it, instead of wrapping to another device, descriptor or setting.
func TestBindingsRefuseValuesThatWouldWrap(t *testing.T) {
	l := openFake(t)
	require.NoError(t, l.Init(0))
	_, err := l.DeviceGet(1 << 32)
	require.ErrorIs(t, err, ErrorInvalidDevice, "ordinal 1<<32 is not device 0")
	_, err = l.DeviceGet(-1)
	require.ErrorIs(t, err, ErrorInvalidDevice)

	_, err = l.MemImportFromShareableHandle(1<<32+5, HandleTypePosixFD)
	require.ErrorIs(t, err, ErrorInvalidValue, "fd 1<<32+5 is not fd 5")

	pool, err := l.DeviceGetDefaultMemPool(0)
	require.NoError(t, err)
	require.NoError(t, l.MemPoolSetAttribute(pool, MemPoolReuseAllowOpportunistic, 1<<32))
	v, err := l.MemPoolGetAttribute(pool, MemPoolReuseAllowOpportunistic)
	require.NoError(t, err)
	require.Equal(t, uint64(1), v, "a non-zero reuse setting is true")

	require.Equal(t, int32(-1), HostNUMALocation(1<<32).ID, "no node wraps to node 0")
	require.Equal(t, int32(1), HostNUMALocation(1).ID)
}
