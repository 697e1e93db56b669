package offload_test

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/vmm"
)

const mib = 1 << 20

var bg = context.Background()

// newBuf makes a growable buffer of size bytes in chunks of chunk bytes on d, filled with the
// pattern of seed; the test's end closes it.
func newBuf(t *testing.T, d *vmm.Device, size, chunk, seed uint64, o *growbuf.Options) *growbuf.Buffer {
	t.Helper()
	var opts growbuf.Options
	if o != nil {
		opts = *o
	}
	if opts.MaxSize == 0 {
		opts.MaxSize = 4 * size
	}
	opts.Chunk = growbuf.FixedChunks(chunk)
	buf, err := growbuf.New(d, opts)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, buf.Close()) })
	require.NoError(t, buf.Grow(size))
	if seed != 0 {
		require.NoError(t, d.Fill(buf.Ptr(), size, 0, seed))
	}
	return buf
}

// requirePattern checks that buf holds the pattern of seed, reading it with a kernel at the address
// taken before the sleep.
func requirePattern(t *testing.T, d *vmm.Device, ptr driver.DevicePtr, size, seed uint64) {
	t.Helper()
	bad, err := d.Verify(ptr, size, 0, seed)
	require.NoError(t, err)
	require.Zero(t, bad, "words that lost their content")
}

// requireZero checks that [ptr, ptr+size) reads as zeros.
func requireZero(t *testing.T, d *vmm.Device, ptr driver.DevicePtr, size uint64) {
	t.Helper()
	b := make([]byte, size)
	require.NoError(t, d.CopyDtoH(b, ptr))
	for i, v := range b {
		if v != 0 {
			t.Fatalf("byte %d is %#x, want 0", i, v)
		}
	}
}

func free(t *testing.T, d *vmm.Device) uint64 {
	t.Helper()
	require.NoError(t, d.Synchronize())
	f, _, err := d.MemInfo()
	require.NoError(t, err)
	return f
}

func newSet(t *testing.T, b *testutil.Backend, opts offload.Options) *offload.Set {
	t.Helper()
	if opts.SlotSize == 0 {
		opts.SlotSize = 4 * mib
	}
	s := offload.NewSet(b.Sys, opts)
	t.Cleanup(func() { require.NoError(t, s.Close()); require.NoError(t, s.Close()) })
	return s
}

func pinnedHostNUMA(d *vmm.Device) bool {
	return d.Supports(driver.AttrHostNUMAVirtualMemoryManagementSupported) && d.HostNUMAID() >= 0
}

func hostNUMA(d *vmm.Device) driver.Location { return driver.HostNUMALocation(d.HostNUMAID()) }

// newOwnedBuf is newBuf without the cleanup: the caller closes it.
func newOwnedBuf(d *vmm.Device, size, chunk, seed uint64) (*growbuf.Buffer, error) {
	buf, err := growbuf.New(d, growbuf.Options{MaxSize: 4 * size, Chunk: growbuf.FixedChunks(chunk)})
	if err != nil {
		return nil, err
	}
	if err := buf.Grow(size); err != nil {
		return nil, errors.Join(err, buf.Close())
	}
	if err := d.Fill(buf.Ptr(), size, 0, seed); err != nil {
		return nil, errors.Join(err, buf.Close())
	}
	return buf, nil
}

// savedBuf makes a buffer of size bytes in 2 MiB chunks on d filled with the pattern of seed, and
// saves a checkpoint of a Keep set holding it under tag (the set is closed again). The caller
// closes the buffer.
func savedBuf(t *testing.T, b *testutil.Backend, d *vmm.Device, tag string, size, seed uint64) (*growbuf.Buffer, []byte) {
	t.Helper()
	buf, err := newOwnedBuf(d, size, 2*mib, seed)
	require.NoError(t, err)
	set := offload.NewSet(b.Sys, offload.Options{SlotSize: 2 * mib})
	defer func() { require.NoError(t, set.Close()) }()
	require.NoError(t, set.Add(tag, buf, offload.Keep, offload.EntryOptions{}))
	var ck bytes.Buffer
	require.NoError(t, set.Save(bg, &ck))
	return buf, ck.Bytes()
}

// requireFreeAbout checks a free-memory figure: exactly on the simulator, whose accounting the
// tests model (the backup's page tables included), within 4 MiB on the real driver, whose page
// tables and allocator keep their own granularity.
func requireFreeAbout(t *testing.T, b *testutil.Backend, want, got uint64, msg string) {
	t.Helper()
	if b.IsSim() {
		require.Equal(t, want, got, msg)
		return
	}
	diff := max(want, got) - min(want, got)
	require.LessOrEqual(t, diff, uint64(4*mib), "%s: free %d, want about %d", msg, got, want)
}

// keptW makes a buffer of size bytes in chunks of chunk bytes on d, filled with seed's pattern and
// kept under the tag "w" in a set whose slots are a chunk each and which reports its progress to
// progress (nil: to nothing).
func keptW(t *testing.T, b *testutil.Backend, d *vmm.Device, size, chunk, seed uint64, progress func(done, total uint64)) (*growbuf.Buffer, *offload.Set) {
	t.Helper()
	buf := newBuf(t, d, size, chunk, seed, nil)
	set := newSet(t, b, offload.Options{SlotSize: chunk, Progress: progress})
	require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
	return buf, set
}

// keptWithProgress is keptW of 32 MiB in 8 MiB chunks on device 0.
func keptWithProgress(t *testing.T, b *testutil.Backend, seed uint64, progress func(done, total uint64)) (*vmm.Device, *growbuf.Buffer, *offload.Set) {
	t.Helper()
	d := b.Device(t, 0)
	buf, set := keptW(t, b, d, 32*mib, 8*mib, seed, progress)
	return d, buf, set
}

// savedW makes a 4 MiB buffer of seed's pattern on d, kept under the tag "w" in a set of 2 MiB
// slots, and that set's checkpoint.
func savedW(t *testing.T, b *testutil.Backend, d *vmm.Device, seed uint64) (*growbuf.Buffer, *offload.Set, []byte) {
	t.Helper()
	buf, set := keptW(t, b, d, 4*mib, 2*mib, seed, nil)
	var ck bytes.Buffer
	require.NoError(t, set.Save(bg, &ck))
	return buf, set, ck.Bytes()
}
