package sim

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
)

// With DeferWork an async copy from pinned memory moves its bytes when its stream is synchronized,
// as on a GPU: a source changed before then is what arrives. Without it the copy moves at once.
func TestDeferredWorkMovesDataAtSynchronize(t *testing.T) {
	for _, deferred := range []bool{false, true} {
		var opts []Option
		if deferred {
			opts = append(opts, DeferWork())
		}
		s := start(t, opts...)
		bind(t, s, 0)
		host, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		p := unsafe.Pointer(&host[0])
		require.NoError(t, s.MemHostRegister(p, 4096, 0))
		dev, err := s.MemAlloc(4096)
		require.NoError(t, err)
		st, err := s.StreamCreate(driver.StreamNonBlocking)
		require.NoError(t, err)

		host[0] = 1
		require.NoError(t, s.MemcpyHtoDAsync(dev, p, 4096, st))
		host[0] = 2 // too early: the copy may not have read it yet
		require.NoError(t, s.StreamSynchronize(st))
		out := make([]byte, 4096)
		require.NoError(t, s.MemcpyDtoH(unsafe.Pointer(&out[0]), dev, 4096))
		want := byte(1)
		if deferred {
			want = 2
		}
		require.Equal(t, want, out[0], "deferred %v", deferred)

		require.NoError(t, s.StreamDestroy(st))
		require.NoError(t, s.MemFree(dev))
		require.NoError(t, s.MemHostUnregister(p))
		require.NoError(t, unix.Munmap(host))
	}
}
