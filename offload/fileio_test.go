package offload_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/vmm"
)

// flakyFile is a file whose n-th ReadAt or WriteAt fails with errDisk, or calls hook first. With
// eofAtEnd its ReadAt answers a full read that reaches the end of the file with io.EOF, as
// io.ReaderAt allows.
type flakyFile struct {
	*os.File
	mu                  sync.Mutex
	reads, writes       int
	failRead, failWrite int
	hook                func()
	eofAtEnd            bool
}

var errDisk = errors.New("disk error")

func (f *flakyFile) count(n *int, fail int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	*n++
	if *n == fail {
		if f.hook != nil {
			f.hook()
			return nil
		}
		return errDisk
	}
	return nil
}

func (f *flakyFile) ReadAt(p []byte, off int64) (int, error) {
	if err := f.count(&f.reads, f.failRead); err != nil {
		return 0, err
	}
	n, err := f.File.ReadAt(p, off)
	if st, serr := f.Stat(); err == nil && serr == nil && f.eofAtEnd && off+int64(n) == st.Size() {
		return n, io.EOF
	}
	return n, err
}

func (f *flakyFile) WriteAt(p []byte, off int64) (int, error) {
	if err := f.count(&f.writes, f.failWrite); err != nil {
		return 0, err
	}
	return f.File.WriteAt(p, off)
}

// fileFixture is a set holding one File buffer of 24 MiB in 4 MiB chunks, moved in 2 MiB parts by 3
// goroutines through two 4 MiB slots: 12 parts through 4 staging buffers, so that buffers are
// reused while earlier copies may still run. The parts and buffers are set here rather than left to
// the defaults, because the tests count parts.
type fileFixture struct {
	set *offload.Set
	buf *growbuf.Buffer
	d   *vmm.Device
	f   *flakyFile
}

const fixtureSeed = 61

func newFileFixture(t *testing.T, b *testutil.Backend) *fileFixture {
	d := b.Device(t, 0)
	osf, err := os.CreateTemp(t.TempDir(), "parts")
	require.NoError(t, err)
	t.Cleanup(func() { osf.Close() })
	m := &fileFixture{d: d, f: &flakyFile{File: osf}, buf: newBuf(t, d, 24*mib, 4*mib, fixtureSeed, nil)}
	m.set = newSet(t, b, offload.Options{SlotSize: 4 * mib, IOWorkers: 3, FilePart: 2 * mib, FileBuffers: 4})
	require.NoError(t, m.set.Add("f", m.buf, offload.File, offload.EntryOptions{File: m.f}))
	return m
}

func (m *fileFixture) requireIntact(t *testing.T) {
	t.Helper()
	require.False(t, m.set.Asleep("f"))
	requirePattern(t, m.d, m.buf.Ptr(), 24*mib, fixtureSeed)
}

// TestFileFaults fails each driver call of a File sleep and wake, one at a time: a failed Sleep
// leaves the buffer awake and intact, a failed Wake leaves it asleep with its file intact, each can
// be retried, and the leak check at the end of each run finds nothing.
func TestFileFaults(t *testing.T) {
	var sleepCalls, wakeCalls map[string]int
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		m := newFileFixture(t, b)
		sleepCalls = callsOf(b.Sim, func() { require.NoError(t, m.set.Sleep(bg)) })
		wakeCalls = callsOf(b.Sim, func() { require.NoError(t, m.set.Wake(bg)) })
		m.requireIntact(t)
	}, testutil.SimOnly())
	require.Equal(t, 12, wakeCalls["cuMemcpyAsync"], "one copy per part")
	for _, phase := range []struct {
		name  string
		calls map[string]int
	}{{"sleep", sleepCalls}, {"wake", wakeCalls}} {
		for fn, n := range phase.calls {
			for i := 1; i <= n; i++ {
				t.Run(fmt.Sprintf("%s/%s#%d", phase.name, fn, i), func(t *testing.T) {
					testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
						failFileCall(t, b, phase.name == "wake", fn, i)
					}, testutil.SimOnly())
				})
			}
		}
	}
}

func failFileCall(t *testing.T, b *testutil.Backend, wake bool, fn string, i int) {
	m := newFileFixture(t, b)
	if wake {
		require.NoError(t, m.set.Sleep(bg))
	}
	b.Sim.FailNth(fn, i, driver.ErrorUnknown)
	var err error
	if wake {
		err = m.set.Wake(bg)
	} else {
		err = m.set.Sleep(bg)
	}
	b.Sim.ClearFaults()
	if err != nil {
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.Equal(t, wake, m.set.Asleep("f"), "the old state")
		if !wake {
			m.requireIntact(t)
			require.NoError(t, m.set.Sleep(bg), "a failed sleep can be retried")
		}
	}
	if m.set.Asleep("f") {
		require.NoError(t, m.set.Wake(bg), "a failed wake can be retried")
	}
	m.requireIntact(t)
}

// TestFileIOFailures fails the n-th read or write of the file, or cancels the context there: the
// call fails naming the part, nothing is lost, and a retry succeeds.
func TestFileIOFailures(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		for _, n := range []int{1, 5, 12} {
			m := newFileFixture(t, b)
			m.f.failWrite = n
			err := m.set.Sleep(bg)
			require.ErrorIs(t, err, errDisk)
			require.ErrorContains(t, err, "write 2 MiB of \"f\" at file offset")
			m.requireIntact(t)
			require.NoError(t, m.set.Sleep(bg))

			m.f.failRead = m.f.reads + n
			err = m.set.Wake(bg)
			require.ErrorIs(t, err, errDisk)
			require.ErrorContains(t, err, "read 2 MiB of \"f\" at file offset")
			require.True(t, m.set.Asleep("f"))
			require.NoError(t, m.set.Wake(bg))
			m.requireIntact(t)

			ctx, cancel := context.WithCancel(bg)
			m.f.hook = cancel
			require.NoError(t, m.set.Sleep(bg))
			m.f.failRead = m.f.reads + n
			require.ErrorIs(t, m.set.Wake(ctx), context.Canceled)
			require.True(t, m.set.Asleep("f"))
			m.f.hook = nil
			require.NoError(t, m.set.Wake(bg))
			m.requireIntact(t)
		}
	})
}

// TestFileReaderAtEOF: a backing whose ReadAt returns io.EOF with a full read at the end of its
// data (allowed by io.ReaderAt) wakes like any other; a short read at the end still fails.
func TestFileReaderAtEOF(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		m := newFileFixture(t, b)
		m.f.eofAtEnd = true
		require.NoError(t, m.set.Sleep(bg))
		require.NoError(t, m.set.Wake(bg))
		m.requireIntact(t)

		require.NoError(t, m.set.Sleep(bg))
		require.NoError(t, m.f.Truncate(24*mib-4096))
		err := m.set.Wake(bg)
		require.ErrorIs(t, err, io.EOF)
		require.ErrorContains(t, err, "read 2 MiB of \"f\" at file offset 23068672")
		require.True(t, m.set.Asleep("f"), "a short file leaves the buffer asleep")
		require.NoError(t, m.buf.Close(), "closing it frees its backup")
	})
}

// TestFilePartOptions moves a File buffer of 24 MiB in 4 MiB chunks with other part sizes and
// staging buffer counts: a part that is not a multiple of 4 KiB is rounded up, one larger than a
// slot is cut to the slot, and the content comes back whole every time (one copy per part).
func TestFilePartOptions(t *testing.T) {
	for _, c := range []struct {
		name   string
		part   uint64
		bufs   int
		copies int
	}{
		{"1MiB-1buf", mib, 1, 24},
		{"3MiB+1-2bufs", 3*mib + 1, 2, 12}, // 3 MiB + 4 KiB, then the rest of each chunk
		{"64MiB-cut-to-slot", 64 * mib, 2, 6},
		{"2^63-cut-to-slot", 1 << 63, 1, 6},
	} {
		t.Run(c.name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				d := b.Device(t, 0)
				f, err := os.CreateTemp(t.TempDir(), "parts")
				require.NoError(t, err)
				t.Cleanup(func() { f.Close() })
				buf := newBuf(t, d, 24*mib, 4*mib, fixtureSeed, nil)
				set := newSet(t, b, offload.Options{SlotSize: 4 * mib, IOWorkers: 3, FilePart: c.part, FileBuffers: c.bufs})
				require.NoError(t, set.Add("f", buf, offload.File, offload.EntryOptions{File: f}))
				wake := func() { require.NoError(t, set.Wake(bg)) }
				require.NoError(t, set.Sleep(bg))
				if b.Sim != nil {
					require.Equal(t, c.copies, callsOf(b.Sim, wake)["cuMemcpyAsync"], "one copy per part")
				} else {
					wake()
				}
				requirePattern(t, d, buf.Ptr(), 24*mib, fixtureSeed)
			})
		})
	}
}

// The goroutines of a Sleep and a Wake wait for their copies on blocking events (asleep, not
// spinning on a CPU that the goroutines reading or writing files need), in Keep and File mode.
func TestCopiesWaitOnBlockingEvents(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		m := newFileFixture(t, b)
		require.NoError(t, m.set.Add("k", newBuf(t, m.d, 8*mib, 4*mib, 7, nil), offload.Keep, offload.EntryOptions{}))
		blocking := driver.EventBlockingSync | driver.EventDisableTiming
		made := func() [3]int {
			c := b.Sim.EventsCreated
			return [3]int{c(blocking), c(driver.EventDisableTiming), c(driver.EventDefault)}
		}
		before := made()
		require.NoError(t, m.set.Sleep(bg))
		require.NoError(t, m.set.Wake(bg))
		after := made()
		require.Greater(t, after[0], before[0], "no blocking event")
		require.Equal(t, before[1:], after[1:], "events that spin")
		m.requireIntact(t)
	}, testutil.SimOnly())
}
