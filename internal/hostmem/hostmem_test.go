package hostmem

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// resident reports (mincore)  which pages of mem are resident.
func resident(t *testing.T, mem []byte) []byte {
	t.Helper()
	vec := make([]byte, (len(mem)+PageSize-1)/PageSize)
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&mem[0])), uintptr(len(mem)), uintptr(unsafe.Pointer(&vec[0])))
	require.Zero(t, errno)
	return vec
}

func TestFaultInMakesEveryPageResidentAndKeepsTheBytes(t *testing.T) {
	const pages = 64
	mem, err := unix.Mmap(-1, 0, pages*PageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	defer func() { require.NoError(t, unix.Munmap(mem)) }()
	for _, v := range resident(t, mem) {
		require.Zero(t, v&1, "fresh anonymous memory is not resident")
	}
	mem[5*PageSize+7] = 42
	FaultIn(mem[3:]) // an unaligned start: the first page's first whole word is at offset 4
	for i, v := range resident(t, mem) {
		require.Equal(t, byte(1), v&1, "page %d", i)
	}
	for i, b := range mem {
		if i == 5*PageSize+7 {
			require.Equal(t, byte(42), b)
		} else {
			require.Zero(t, b, "byte %d", i)
		}
	}
}

func TestFaultInEdges(t *testing.T) {
	FaultIn(nil)
	mem, err := unix.Mmap(-1, 0, 2*PageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	defer func() { require.NoError(t, unix.Munmap(mem)) }()
	copy(mem[PageSize-3:], []byte{1, 2, 3, 4, 5})
	FaultIn(mem[PageSize-3 : PageSize+2]) // no whole aligned word in either page: read
	require.Equal(t, []byte{1, 2, 3, 4, 5}, mem[PageSize-3:PageSize+2])
	FaultIn(mem[PageSize-2 : PageSize+6]) // the second page has one
	require.Equal(t, []byte{2, 3, 4, 5, 0, 0, 0, 0}, mem[PageSize-2:PageSize+6])
}

func TestReadInMakesEveryPageResidentOfReadOnlyMemory(t *testing.T) {
	const pages = 16
	mem, err := unix.Mmap(-1, 0, pages*PageSize, unix.PROT_READ, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	defer func() { require.NoError(t, unix.Munmap(mem)) }()
	for _, v := range resident(t, mem) {
		require.Zero(t, v&1, "fresh anonymous memory is not resident")
	}
	ReadIn(mem) // a write would fault: the mapping is read-only
	for i, v := range resident(t, mem) {
		require.Equal(t, byte(1), v&1, "page %d", i)
	}
	ReadIn(nil)
}
