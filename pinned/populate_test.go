package pinned_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pinned"
)

// Memory that cannot be faulted in (a file mapping past its file's end, PROT_NONE) is refused with
// an error, as the driver would refuse it, instead of killing the process with SIGBUS or SIGSEGV.
func TestRegisterRefusesMemoryItCannotFaultIn(t *testing.T) {
	if !pinned.PopulateKnown() {
		t.Skip("this kernel lacks MADV_POPULATE_WRITE (Linux 5.14+): Register reads each page in instead, and such memory would kill the test binary")
	}
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		f, err := os.Create(filepath.Join(t.TempDir(), "data"))
		require.NoError(t, err)
		defer f.Close()
		require.NoError(t, f.Truncate(1*mib))
		past, err := unix.Mmap(int(f.Fd()), 0, 2*mib, unix.PROT_READ, unix.MAP_SHARED)
		require.NoError(t, err)
		defer func() { require.NoError(t, unix.Munmap(past)) }()
		none, err := unix.Mmap(-1, 0, 2*mib, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		defer func() { require.NoError(t, unix.Munmap(none)) }()
		for name, mem := range map[string][]byte{"past the file's end": past, "PROT_NONE": none} {
			_, err := pinned.Register(d, mem, pinned.RegisterOptions{ReadOnly: name != "PROT_NONE"})
			require.ErrorIs(t, err, pinned.ErrInvalidValue, name)
			require.ErrorContains(t, err, "fault in", name)
		}
	})
}
