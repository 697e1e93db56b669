package pool

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"

	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// Trace is a sequence of allocations to replay against an allocator.
//
// Text format, one allocation per line, in the order they happen:
//
//	# comments and blank lines are ignored
//	<size> <stream> <lifetime> [tag]
//
// size is a byte count, optionally with a unit (512, 64KiB, 2MiB, 1.5GiB; single letters K, M, G are
// binary); stream is a stream index from 0 to MaxTraceStream (replays map it onto their streams
// modulo their count); lifetime is how many later allocations happen before this block is freed (0:
// freed right before the next allocation; one past the trace's end, as in a truncated trace, frees it
// after the last allocation), or "-" for a block that lives until the end; tag is an optional word for
// accounting (weights, kv, act, scratch). A block is freed on the stream it was allocated on.
type Trace struct {
	Events []TraceEvent
}

// MaxTraceStream is the largest stream index ParseTrace accepts.
const MaxTraceStream = 1<<16 - 1

// TraceEvent is one allocation of a trace.
type TraceEvent struct {
	Size     uint64
	Stream   int
	Lifetime int // -1: until the end
	Tag      string
}

// ParseTrace reads a trace in the text format. A malformed line gives an error wrapping
// vmm.ErrInvalidValue that names the line number and what is wrong.
func ParseTrace(r io.Reader) (*Trace, error) {
	t := &Trace{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), maxTraceLine)
	n := 1
	for ; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = strings.TrimSpace(line[:i])
		}
		if line == "" {
			continue
		}
		ev, err := parseEvent(line)
		if err != nil {
			return nil, fmt.Errorf("pool: trace line %d %q: %w", n, line, err)
		}
		t.Events = append(t.Events, ev)
	}
	if err := sc.Err(); errors.Is(err, bufio.ErrTooLong) {
		return nil, fmt.Errorf("pool: trace line %d: longer than %d bytes: %w", n, maxTraceLine, vmm.ErrInvalidValue)
	} else if err != nil {
		return nil, fmt.Errorf("pool: read trace: %w", err)
	}
	if len(t.Events) == 0 {
		return nil, fmt.Errorf("pool: trace has no allocations: %w", vmm.ErrInvalidValue)
	}
	return t, nil
}

// writable checks that the text format carries e as it is.
func (e TraceEvent) writable() error {
	switch {
	case e.Size == 0:
		return fmt.Errorf("size 0: %w", vmm.ErrInvalidValue)
	case e.Stream < 0 || e.Stream > MaxTraceStream:
		return fmt.Errorf("stream %d: want 0 to %d: %w", e.Stream, MaxTraceStream, vmm.ErrInvalidValue)
	case e.Tag != "" && (strings.ContainsRune(e.Tag, '#') || len(strings.Fields(e.Tag)) != 1 || strings.TrimSpace(e.Tag) != e.Tag):
		return fmt.Errorf("tag %q: want one word without '#': %w", e.Tag, vmm.ErrInvalidValue)
	}
	return nil
}

func parseEvent(line string) (TraceEvent, error) {
	f := strings.Fields(line)
	if len(f) < 3 || len(f) > 4 {
		return TraceEvent{}, fmt.Errorf("want <size> <stream> <lifetime> [tag], got %d fields: %w", len(f), vmm.ErrInvalidValue)
	}
	size, err := units.ParseSize(f[0])
	if err != nil || size == 0 {
		return TraceEvent{}, fmt.Errorf("size %q: want a positive byte count: %w", f[0], vmm.ErrInvalidValue)
	}
	stream, err := strconv.Atoi(f[1])
	if err != nil || stream < 0 || stream > MaxTraceStream {
		return TraceEvent{}, fmt.Errorf("stream %q: want an integer from 0 to %d: %w", f[1], MaxTraceStream, vmm.ErrInvalidValue)
	}
	life := -1
	if f[2] != "-" {
		if life, err = strconv.Atoi(f[2]); err != nil || life < 0 {
			return TraceEvent{}, fmt.Errorf("lifetime %q: want a non-negative integer or -: %w", f[2], vmm.ErrInvalidValue)
		}
	}
	ev := TraceEvent{Size: size, Stream: stream, Lifetime: life}
	if len(f) == 4 {
		ev.Tag = f[3]
	}
	return ev, nil
}

// maxTraceLine is the longest line ParseTrace reads.
const maxTraceLine = 1 << 20

// WriteTo writes the trace in the text format. An event that format cannot carry, so that
// ParseTrace would refuse or misread it (size 0, a stream outside 0 to MaxTraceStream, a tag that
// is not one word without '#'), is refused with an error wrapping vmm.ErrInvalidValue that names
// it, before anything is written.
func (t *Trace) WriteTo(w io.Writer) (int64, error) {
	for i, e := range t.Events {
		if err := e.writable(); err != nil {
			return 0, fmt.Errorf("pool: write trace: event %d: %w", i, err)
		}
	}
	bw := bufio.NewWriter(w)
	var n int64
	c, _ := fmt.Fprintln(bw, "# cuvmm pool trace: <size> <stream> <lifetime> [tag]; lifetime = later allocations before the free, - = never")
	n += int64(c)
	for _, e := range t.Events {
		life := "-"
		if e.Lifetime >= 0 {
			life = strconv.Itoa(e.Lifetime)
		}
		c, _ = fmt.Fprintf(bw, "%d %d %s %s\n", e.Size, e.Stream, life, e.Tag)
		n += int64(c)
	}
	return n, bw.Flush()
}

// FreesBefore returns, for each allocation i, the indexes of the blocks freed right before it (an
// extra last entry lists those freed after the last allocation, before the blocks that live until the
// end).
func (t *Trace) FreesBefore() [][]int {
	out := make([][]int, len(t.Events)+1)
	for i, e := range t.Events {
		if e.Lifetime < 0 {
			continue
		}
		at := len(t.Events)
		if e.Lifetime < at-i-1 { // without overflow for any lifetime
			at = i + e.Lifetime + 1
		}
		out[at] = append(out[at], i)
	}
	return out
}

// PeakInUse is the most bytes the trace has allocated at once, and the largest single request.
func (t *Trace) PeakInUse() (peak, largest uint64) {
	frees := t.FreesBefore()
	var cur uint64
	for i, e := range t.Events {
		for _, j := range frees[i] {
			cur -= t.Events[j].Size
		}
		cur += e.Size
		peak = max(peak, cur)
		largest = max(largest, e.Size)
	}
	return peak, largest
}

// Scale returns a copy with every size multiplied by f (at least 1 byte, at most the largest
// multiple of MinBlock that fits 64 bits; a NaN f gives 1 byte), rounded to MinBlock above it, so
// that a trace can be sized to a device.
func (t *Trace) Scale(f float64) *Trace {
	const most = math.MaxUint64 / MinBlock * MinBlock
	out := &Trace{Events: make([]TraceEvent, len(t.Events))}
	for i, e := range t.Events {
		s := math.Max(1, math.Round(float64(e.Size)*f))
		if s > MinBlock {
			s = math.Round(s/MinBlock) * MinBlock
		}
		switch {
		case math.IsNaN(s):
			e.Size = 1
		case s >= most:
			e.Size = most
		default:
			e.Size = uint64(s)
		}
		out.Events[i] = e
	}
	return out
}

// Streams is the number of distinct stream indexes the trace uses (the largest plus one), at most
// math.MaxInt.
func (t *Trace) Streams() int {
	n := 0
	for _, e := range t.Events {
		n = max(n, min(e.Stream, math.MaxInt-1)+1)
	}
	return n
}
