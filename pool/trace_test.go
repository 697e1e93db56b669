package pool_test

import (
	"bytes"
	"flag"
	"math"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/pool"
	"github.com/cuvmm/cuvmm/vmm"
)

var update = flag.Bool("update", false, "rewrite testdata/serving.trace from SyntheticServing(1)")

func TestParseTrace(t *testing.T) {
	tr, err := pool.ParseTrace(strings.NewReader("# weights\n4GiB 0 - weights\n\n2M 1 0 kv # freed before the next\n512 3 1\n100 0 0\n"))
	require.NoError(t, err)
	require.Equal(t, []pool.TraceEvent{
		{Size: 4 << 30, Stream: 0, Lifetime: -1, Tag: "weights"},
		{Size: 2 << 20, Stream: 1, Lifetime: 0, Tag: "kv"},
		{Size: 512, Stream: 3, Lifetime: 1},
		{Size: 100, Stream: 0, Lifetime: 0},
	}, tr.Events)
	peak, largest := tr.PeakInUse()
	require.Equal(t, uint64(4<<30+2<<20), peak)
	require.Equal(t, uint64(4<<30), largest)
	require.Equal(t, 4, tr.Streams())
	require.Equal(t, [][]int{nil, nil, {1}, nil, {2, 3}}, tr.FreesBefore())

	var buf bytes.Buffer
	_, err = tr.WriteTo(&buf)
	require.NoError(t, err)
	again, err := pool.ParseTrace(&buf)
	require.NoError(t, err)
	require.Equal(t, tr, again)
}

func TestParseTraceBadLines(t *testing.T) {
	for _, c := range []struct{ text, want string }{
		{"1M 0 -\n2M 0\n", "line 2 \"2M 0\": want <size> <stream> <lifetime> [tag], got 2 fields"},
		{"1M 0 - a b\n", "line 1"},
		{"# c\n\nlots 0 -\n", "line 3 \"lots 0 -\": size \"lots\""},
		{"0 0 -\n", "size \"0\": want a positive byte count"},
		{"1M -1 -\n", "stream \"-1\""},
		{"1M x -\n", "stream \"x\""},
		{"1M 0 -2\n", "lifetime \"-2\""},
		{"1M 0 soon\n", "lifetime \"soon\""},
		{"# nothing\n", "no allocations"},
		{"1M 65536 -\n", "line 1 \"1M 65536 -\": stream \"65536\": want an integer from 0 to 65535"},
		{"1M 9223372036854775807 -\n", "stream \"9223372036854775807\""},
	} {
		_, err := pool.ParseTrace(strings.NewReader(c.text))
		require.ErrorIs(t, err, vmm.ErrInvalidValue, c.text)
		require.Contains(t, err.Error(), c.want)
	}
}

// Lifetimes past the trace's end, up to the largest int, free the block after the last allocation;
// a trace made in Go may also hold stream indexes ParseTrace refuses. Nothing overflows.
func TestTraceComputationsDoNotOverflow(t *testing.T) {
	tr, err := pool.ParseTrace(strings.NewReader("1MiB 0 9223372036854775807\n2MiB 0 9223372036854775806\n4MiB 1 0\n"))
	require.NoError(t, err)
	require.Equal(t, [][]int{nil, nil, nil, {0, 1, 2}}, tr.FreesBefore())
	peak, largest := tr.PeakInUse()
	require.Equal(t, uint64(7<<20), peak)
	require.Equal(t, uint64(4<<20), largest)
	tr.Events[0].Stream = math.MaxInt
	require.Equal(t, math.MaxInt, tr.Streams())
}

// TestServingTraceCommitted keeps testdata/serving.trace, the documented sample, equal to what the
// generator makes (go test ./pool -run Committed -update rewrites it).
func TestServingTraceCommitted(t *testing.T) {
	tr := pool.SyntheticServing(1)
	var buf bytes.Buffer
	_, err := tr.WriteTo(&buf)
	require.NoError(t, err)
	if *update {
		require.NoError(t, os.WriteFile("testdata/serving.trace", buf.Bytes(), 0o644))
	}
	f, err := os.Open("testdata/serving.trace")
	require.NoError(t, err)
	defer f.Close()
	committed, err := pool.ParseTrace(f)
	require.NoError(t, err)
	require.Equal(t, tr, committed)
	peak, largest := tr.PeakInUse()
	t.Logf("%d allocations, peak in use %.2f GiB, largest %.2f GiB", len(tr.Events), float64(peak)/(1<<30), float64(largest)/(1<<30))
	require.Greater(t, peak, uint64(40<<30))
	require.Equal(t, 4, tr.Streams())
}
