package offload

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
)

// PlanFileStaging says what a Set's File path does for one buffer: the parts that plan and
// fileParts cut, and the staging stagingPlan gives them, for sizes that end inside a chunk, chunks
// larger and smaller than a slot, and parts that do not divide a slot.
func TestPlanFileStagingMatchesTheSet(t *testing.T) {
	const mib = 1 << 20
	cases := []struct {
		size, chunk uint64
		opts        Options
	}{
		{64 * mib, 4 * mib, Options{SlotSize: 16 * mib}},
		{24 * mib, 4 * mib, Options{SlotSize: 4 * mib, IOWorkers: 3, FilePart: 2 * mib, FileBuffers: 4}},
		{10 * mib, 6 * mib, Options{SlotSize: 4 * mib, FilePart: 3 * mib}},
		{8 * mib, 2 * mib, Options{SlotSize: 64 * mib, IOWorkers: 16, FilePart: 1 * mib}},
		{6 * mib, 2 * mib, Options{FilePart: 128 * mib}},
	}
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		for _, c := range cases {
			buf, err := growbuf.New(d, growbuf.Options{MaxSize: c.size, Chunk: growbuf.FixedChunks(c.chunk)})
			require.NoError(t, err)
			require.NoError(t, buf.Grow(c.size))
			f, err := os.CreateTemp(t.TempDir(), "plan")
			require.NoError(t, err)
			s := NewSet(b.Sys, c.opts)
			require.NoError(t, s.Add("f", buf, File, EntryOptions{File: f}))
			refs, err := s.prepare(s.entries)
			require.NoError(t, err)
			us := plan(refs, s.opts.SlotSize)[d]
			size := ringSize(us)
			part := min(s.opts.FilePart, size)
			jobs := len(fileParts(us, part))
			slots, bufs, g := stagingPlan(size, part, s.opts.IOWorkers, s.opts.FileBuffers, jobs)

			got := PlanFileStaging(c.opts, c.size, c.chunk)
			require.Equal(t, jobs, got.Parts, "%+v", c)
			require.Equal(t, [4]uint64{uint64(g), uint64(slots), size, part}, [4]uint64{uint64(got.Goroutines), uint64(got.Slots), got.SlotBytes, got.Part}, "%+v", c)
			total := 0
			for _, n := range got.Buffers {
				total += n
			}
			require.Equal(t, bufs, total, "%+v", c)
			forget(s.entries)
			require.NoError(t, s.Remove("f"))
			require.NoError(t, s.Close())
			require.NoError(t, buf.Close())
			require.NoError(t, f.Close())
		}
	}, testutil.SimOnly())
}
