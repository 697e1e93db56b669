// Package plot draws the figure of a vmmdemo measurement from its JSON result (`vmmdemo SUB --json`)
// with gonum/plot: bandwidth against size per memory kind (bandwidth), GPU memory overhead per device
// and sharing mode (pinned), growth time and peak memory against realloc-and-copy (grow), broker
// bandwidth against request size (broker), and sleep and wake bandwidth (sleep; in file mode against
// the raw file I/O of the same run, with each round's ratios).
//
// The kind of result is told by its JSON keys (Detect). Only this package and the command that
// imports it (vmmdemo plot) carry the plotting library.
package plot

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// Kind is the measurement a result comes from.
type Kind string

// The kinds Draw knows.
const (
	Bandwidth Kind = "bandwidth" // vmmdemo bandwidth
	Pinned    Kind = "pinned"    // vmmdemo pinned
	Grow      Kind = "grow"      // vmmdemo grow
	Broker    Kind = "broker"    // vmmdemo broker
	Sleep     Kind = "sleep"     // vmmdemo sleep
)

// Kinds lists every kind, in a fixed order.
func Kinds() []Kind { return []Kind{Bandwidth, Pinned, Grow, Broker, Sleep} }

// ErrUnknownResult: the JSON is not a result this package can draw.
var ErrUnknownResult = errors.New("plot: not a known vmmdemo result")

// keys lists, per kind, the sets of top-level keys that identify it: a result is of the kind when
// every key of one of its sets is present.
var keys = map[Kind][][]string{
	Bandwidth: {{"rows", "setup"}},
	Pinned:    {{"modes", "ready"}},
	Grow:      {{"growbuf_seconds", "realloc_seconds"}},
	Broker:    {{"bandwidth", "round_trip"}},
	Sleep:     {{"sleep_gbps", "wake_gbps"}, {"first_sleep_seconds", "baseline_sleep_seconds"}},
}

// Detect tells the kind of a vmmdemo JSON result from its keys.
func Detect(data []byte) (Kind, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(data, &top); err != nil {
		return "", fmt.Errorf("%w: %v", ErrUnknownResult, err)
	}
	has := func(set []string) bool {
		for _, key := range set {
			if _, ok := top[key]; !ok {
				return false
			}
		}
		return true
	}
	var want []string
	for _, k := range Kinds() {
		for _, set := range keys[k] {
			if has(set) {
				return k, nil
			}
			want = append(want, fmt.Sprintf("%s (%s)", strings.Join(set, "+"), k))
		}
	}
	return "", fmt.Errorf("%w: it has none of the key sets %s", ErrUnknownResult, strings.Join(want, ", "))
}

// Figure is a drawn result: one or more plots side by side.
type Figure struct {
	Kind  Kind
	Plots []*plot.Plot
}

// Draw detects the result's kind and draws its figure.
func Draw(data []byte) (*Figure, error) {
	k, err := Detect(data)
	if err != nil {
		return nil, err
	}
	draw := map[Kind]func([]byte) ([]*plot.Plot, error){
		Bandwidth: drawBandwidth, Pinned: drawPinned, Grow: drawGrow, Broker: drawBroker, Sleep: drawSleep,
	}[k]
	ps, err := draw(data)
	if err != nil {
		return nil, fmt.Errorf("plot: %s result: %w", k, err)
	}
	return &Figure{Kind: k, Plots: ps}, nil
}

// Size of one panel of a figure.
const (
	PanelWidth  = 5 * vg.Inch
	PanelHeight = 3.6 * vg.Inch
)

// Write renders the figure in format ("svg", "png", "pdf", "eps") to w, its panels side by side.
func (f *Figure) Write(w io.Writer, format string) error {
	width := PanelWidth * vg.Length(len(f.Plots))
	c, err := draw.NewFormattedCanvas(width, PanelHeight, format)
	if err != nil {
		return fmt.Errorf("plot: %w", err)
	}
	dc := draw.New(c)
	tiles := draw.Tiles{Rows: 1, Cols: len(f.Plots), PadX: vg.Millimeter * 4, PadTop: vg.Millimeter * 2,
		PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 2}
	canvases := plot.Align([][]*plot.Plot{f.Plots}, tiles, dc)
	for i, p := range f.Plots {
		p.Draw(canvases[0][i])
	}
	if _, err := c.WriteTo(w); err != nil {
		return fmt.Errorf("plot: write %s: %w", format, err)
	}
	return nil
}

// sizeLabel names a power-of-two byte size the way the docs do: 64 KiB, 1 MiB, 2 GiB.
func sizeLabel(b float64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	i := 0
	for b >= 1024 && i < len(units)-1 {
		b /= 1024
		i++
	}
	if b == math.Trunc(b) {
		return fmt.Sprintf("%.0f %s", b, units[i])
	}
	return fmt.Sprintf("%.1f %s", b, units[i])
}

// sizeTicks puts one labelled tick at each size (the x values are log2 of the sizes).
type sizeTicks []float64

func (s sizeTicks) Ticks(min, max float64) []plot.Tick {
	out := make([]plot.Tick, 0, len(s))
	for _, b := range s {
		out = append(out, plot.Tick{Value: math.Log2(b), Label: sizeLabel(b)})
	}
	return out
}

func newPlot(title, x, y string) *plot.Plot {
	p := plot.New()
	p.Title.Text, p.X.Label.Text, p.Y.Label.Text = title, x, y
	p.Title.TextStyle.Font.Size = vg.Points(11)
	p.Legend.Top = true
	p.Legend.TextStyle.Font.Size = vg.Points(9)
	p.Y.Min = 0
	p.Add(plotter.NewGrid())
	return p
}

// legendRoom raises the y axis so that the legend in the top corner covers no data.
func legendRoom(p *plot.Plot, entries int) {
	p.Y.Max *= 1 + 0.12*float64(entries)
}
