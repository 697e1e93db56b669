package ipc_test

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/memfd"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
)

// fakeSimMemfd is a memfd named like the simulator's 2 MiB device-0 allocation, which the simulator
// would import, made without the seals a real simulator allocation carries.
func fakeSimMemfd(t *testing.T, size int64, seal bool) *os.File {
	t.Helper()
	flags := unix.MFD_CLOEXEC
	if seal {
		flags |= unix.MFD_ALLOW_SEALING
	}
	fd, err := unix.MemfdCreate("cuvmm-sim loc=device:0 size=2097152 types=1 comp=0 rdma=0 usage=0", flags)
	require.NoError(t, err)
	f := os.NewFile(uintptr(fd), "fake")
	t.Cleanup(func() { f.Close() })
	require.NoError(t, unix.Ftruncate(fd, size))
	if seal {
		_, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, memfd.Seals)
		require.NoError(t, err)
	}
	return f
}

// Open refuses a memfd its sender could still resize (or of another size than the chunk's), with
// nothing left mapped; a sealed one of the right size opens.
func TestOpenChecksSeals(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		desc := ipc.Descriptor{Size: 2 * mib, Chunks: []ipc.ChunkDesc{{Size: 2 * mib, Location: driver.DeviceLocation(0), HandleType: driver.HandleTypePosixFD}}}
		for _, tc := range []struct {
			name     string
			size     int64
			seal     bool
			sentinel error
		}{{"unsealed", 2 * mib, false, memfd.ErrNotSealed}, {"wrong size", 4 * mib, true, memfd.ErrSize}} {
			r := &ipc.Received{Desc: desc, Files: []*os.File{fakeSimMemfd(t, tc.size, tc.seal)}}
			_, err := ipc.Open(dev, r)
			require.ErrorIs(t, err, tc.sentinel, tc.name)
			require.ErrorIs(t, err, ipc.ErrProtocol, tc.name)
			require.Contains(t, err.Error(), "check seals")
		}
		r := &ipc.Received{Desc: desc, Files: []*os.File{fakeSimMemfd(t, 2*mib, true)}}
		buf, err := ipc.Open(dev, r)
		require.NoError(t, err)
		require.NoError(t, buf.Close())
	}, testutil.SimOnly())
}
