package plot_test

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/measure/plot"
)

// svgTexts parses an SVG document and returns its text elements; it fails the test on bad XML.
func svgTexts(t *testing.T, doc []byte) []string {
	t.Helper()
	dec := xml.NewDecoder(bytes.NewReader(doc))
	var texts []string
	root, inText := "", false
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		require.NoError(t, err, "the SVG is well-formed XML")
		switch el := tok.(type) {
		case xml.StartElement:
			if root == "" {
				root = el.Name.Local
			}
			inText = el.Name.Local == "text"
		case xml.CharData:
			if inText {
				texts = append(texts, strings.TrimSpace(string(el)))
			}
		case xml.EndElement:
			inText = false
		}
	}
	require.Equal(t, "svg", root)
	return texts
}

func TestDrawEverySample(t *testing.T) {
	for _, k := range plot.Kinds() {
		t.Run(string(k), func(t *testing.T) {
			data, err := os.ReadFile(filepath.Join("testdata", string(k)+".json"))
			require.NoError(t, err)
			got, err := plot.Detect(data)
			require.NoError(t, err)
			require.Equal(t, k, got)
			fig, err := plot.Draw(data)
			require.NoError(t, err)
			require.NotEmpty(t, fig.Plots)
			var buf bytes.Buffer
			require.NoError(t, fig.Write(&buf, "svg"))
			texts := svgTexts(t, buf.Bytes())
			for _, p := range fig.Plots {
				require.NotEmpty(t, p.Y.Label.Text, "every panel has a labelled y axis")
				require.Contains(t, texts, p.Y.Label.Text)
				require.Contains(t, texts, p.Title.Text)
				if p.X.Label.Text != "" {
					require.Contains(t, texts, p.X.Label.Text)
				}
			}
			require.Greater(t, strings.Count(buf.String(), "<path"), 10, "the figure has drawn marks, not only text")
		})
	}
}

func TestDetectRejects(t *testing.T) {
	for name, doc := range map[string]string{
		"not JSON":      "hello",
		"a JSON array":  "[1, 2]",
		"unknown keys":  `{"backend": "sim", "rows": []}`,
		"info result":   `{"backend": "sim", "driver_version": 13000, "devices": []}`,
		"share result":  `{"backend": "sim", "round_trip_seconds": 0.001}`,
		"empty object":  `{}`,
		"one key short": `{"growbuf_seconds": 1}`,
	} {
		_, err := plot.Detect([]byte(doc))
		require.ErrorIs(t, err, plot.ErrUnknownResult, name)
		_, err = plot.Draw([]byte(doc))
		require.ErrorIs(t, err, plot.ErrUnknownResult, name)
	}
}

func TestDrawRejectsEmptyResults(t *testing.T) {
	for name, doc := range map[string]string{
		"bandwidth without rows": `{"rows": [], "setup": []}`,
		"pinned without modes":   `{"modes": [], "ready": []}`,
		"grow without steps":     `{"growbuf_seconds": 1, "realloc_seconds": 2, "steps": 0}`,
		"broker without rows":    `{"bandwidth": [], "round_trip": {}}`,
		"bandwidth of strings":   `{"rows": "x", "setup": []}`,
		"sleep without GB/s":     `{"first_sleep_seconds": 1, "baseline_sleep_seconds": 2, "per_device": [{"device": 0}]}`,
		"sleep of zero GB/s":     `{"sleep_gbps": 0, "wake_gbps": 0}`,
		"file without raw I/O":   `{"mode": "file", "sleep_gbps": 5, "wake_gbps": 80}`,
	} {
		_, err := plot.Draw([]byte(doc))
		require.Error(t, err, name)
		require.NotErrorIs(t, err, plot.ErrUnknownResult, name)
	}
}

// A file-mode sleep result is drawn against the raw file I/O of its run, with each round's ratios.
func TestDrawSleepFile(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("testdata", "sleep_file.json"))
	require.NoError(t, err)
	fig, err := plot.Draw(data)
	require.NoError(t, err)
	require.Equal(t, plot.Sleep, fig.Kind)
	var titles []string
	for _, p := range fig.Plots {
		titles = append(titles, p.Title.Text)
	}
	require.Equal(t, []string{"file sleep (simulator)", "file wake (simulator)", "each round (simulator)"}, titles)
	rounds := fig.Plots[2]
	require.Equal(t, 0.5, rounds.X.Min)
	require.Equal(t, 3.5, rounds.X.Max, "three rounds")
	var buf bytes.Buffer
	require.NoError(t, fig.Write(&buf, "svg"))
	texts := svgTexts(t, buf.Bytes())
	for _, want := range []string{"raw write", "raw read", "the set", "wake ÷ raw read", "sleep ÷ raw write"} {
		require.Contains(t, texts, want)
	}

	// A result of an older release, without rounds, is drawn without their panel.
	require.Len(t, drawWithout(t, data, "wake_vs_raw_file_rounds").Plots, 2)
}

// drawWithout draws the result data with its key left out.
func drawWithout(t *testing.T, data []byte, key string) *plot.Figure {
	t.Helper()
	var r map[string]any
	require.NoError(t, json.Unmarshal(data, &r))
	delete(r, key)
	old, err := json.Marshal(r)
	require.NoError(t, err)
	fig, err := plot.Draw(old)
	require.NoError(t, err)
	return fig
}

// A keep result is drawn with each warm round's ratios against its raw copies, and without them
// where an older release's result has none.
func TestDrawSleepRounds(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("testdata", "sleep.json"))
	require.NoError(t, err)
	fig, err := plot.Draw(data)
	require.NoError(t, err)
	require.Len(t, fig.Plots, 3)
	rounds := fig.Plots[2]
	require.Equal(t, "each round (simulator)", rounds.Title.Text)
	require.Equal(t, 5.5, rounds.X.Max, "five rounds")
	var buf bytes.Buffer
	require.NoError(t, fig.Write(&buf, "svg"))
	texts := svgTexts(t, buf.Bytes())
	require.Contains(t, texts, "sleep ÷ raw D2H")
	require.Contains(t, texts, "wake ÷ raw H2D")
	require.Len(t, drawWithout(t, data, "sleep_vs_raw_rounds").Plots, 2)
}

// A sleep run with --prepare labels its first sleep as the one after Set.Prepare, and on one
// device compares Prepare and the first sleep together with the usual backup.
func TestDrawSleepPrepared(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("testdata", "sleep.json"))
	require.NoError(t, err)
	var r map[string]any
	require.NoError(t, json.Unmarshal(data, &r))
	labels := func(devices []int) []string {
		r["prepare_seconds"], r["devices"] = 0.5, devices
		b, err := json.Marshal(r)
		require.NoError(t, err)
		fig, err := plot.Draw(b)
		require.NoError(t, err)
		var buf bytes.Buffer
		require.NoError(t, fig.Write(&buf, "svg"))
		return svgTexts(t, buf.Bytes())
	}
	one := labels([]int{0})
	require.Contains(t, one, "first sleep, after Prepare")
	require.Contains(t, one, "Prepare + first sleep")
	two := labels([]int{0, 1})
	require.Contains(t, two, "first sleep, after Prepare")
	require.NotContains(t, two, "Prepare + first sleep", "with two devices the one-device panel is the cold sleep after TrimPool")
	require.Contains(t, two, "first sleep")
}

func TestWriteFormats(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("testdata", "grow.json"))
	require.NoError(t, err)
	fig, err := plot.Draw(data)
	require.NoError(t, err)
	var png bytes.Buffer
	require.NoError(t, fig.Write(&png, "png"))
	require.True(t, bytes.HasPrefix(png.Bytes(), []byte("\x89PNG")))
	require.Error(t, fig.Write(io.Discard, "bmp"))
}
