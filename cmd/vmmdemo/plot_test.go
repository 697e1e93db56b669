package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/measure/plot"
)

// plotSamples are the sample results of every kind, committed with the plot package.
const plotSamples = "../../measure/plot/testdata"

func runPlotCmd(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var o, e bytes.Buffer
	code = run(&env{stdout: &o, stderr: &e}, append([]string{"plot"}, args...))
	return code, o.String(), e.String()
}

// vmmdemo plot draws every kind from its sample: a valid SVG with labelled axes.
func TestPlotEveryKind(t *testing.T) {
	dir := t.TempDir()
	for _, k := range plot.Kinds() {
		in := filepath.Join(plotSamples, string(k)+".json")
		out := filepath.Join(dir, string(k)+".svg")
		code, stdout, stderr := runPlotCmd(t, "--in", in, "--out", out)
		require.Zero(t, code, stderr)
		require.Contains(t, stdout, string(k)+" figure")
		svg, err := os.ReadFile(out)
		require.NoError(t, err)
		require.Contains(t, string(svg), "<svg")
		require.True(t, strings.HasSuffix(strings.TrimSpace(string(svg)), "</svg>"), "a complete document")
		data, err := os.ReadFile(in)
		require.NoError(t, err)
		fig, err := plot.Draw(data)
		require.NoError(t, err)
		for _, p := range fig.Plots {
			require.Contains(t, string(svg), ">"+p.Y.Label.Text+"</text>", "%s: the y axis is labelled", k)
		}
	}
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, len(plot.Kinds()), "no temporary files left behind")
}

func TestPlotBadInput(t *testing.T) {
	dir := t.TempDir()
	notResult := filepath.Join(dir, "info.json")
	require.NoError(t, os.WriteFile(notResult, []byte(`{"backend":"sim","devices":[]}`), 0o644))
	grow := filepath.Join(plotSamples, "grow.json")
	for name, c := range map[string]struct {
		args []string
		code int
		msg  string
	}{
		"no --in":         {[]string{"--out", filepath.Join(dir, "a.svg")}, 2, "--in and --out"},
		"no --out":        {[]string{"--in", grow}, 2, "--in and --out"},
		"bad extension":   {[]string{"--in", grow, "--out", filepath.Join(dir, "a.bmp")}, 2, "extension"},
		"missing input":   {[]string{"--in", filepath.Join(dir, "none.json"), "--out", filepath.Join(dir, "a.svg")}, 1, "no such file"},
		"not a result":    {[]string{"--in", notResult, "--out", filepath.Join(dir, "a.svg")}, 1, "not a known vmmdemo result"},
		"missing out dir": {[]string{"--in", grow, "--out", filepath.Join(dir, "nodir", "a.svg")}, 1, "no such file"},
	} {
		code, _, stderr := runPlotCmd(t, c.args...)
		require.Equal(t, c.code, code, name)
		require.Contains(t, stderr, c.msg, name)
	}
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 1, "only the input file: no figure and no temporary file was left")
}

// The sample results the plot tests draw have only keys that the subcommands print (the golden list
// of TestJSONKeysGolden), so the figures are drawn from what the command really writes.
func TestPlotSamplesMatchCommandKeys(t *testing.T) {
	golden, err := os.ReadFile(filepath.Join("testdata", "json_keys.golden"))
	require.NoError(t, err)
	known := map[string]map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(string(golden)), "\n") {
		sub, key, _ := strings.Cut(line, " ")
		if known[sub] == nil {
			known[sub] = map[string]bool{}
		}
		known[sub][key] = true
	}
	samples := map[string]string{"sleep-file": "sleep_file.json"} // golden run: sample
	for _, k := range plot.Kinds() {
		samples[string(k)] = string(k) + ".json"
	}
	checked := 0
	for k, sample := range samples {
		want := known[k]
		if want == nil {
			t.Logf("%s: the command's keys are not in the golden list yet; its sample follows the specified keys", k)
			continue
		}
		data, err := os.ReadFile(filepath.Join(plotSamples, sample))
		require.NoError(t, err)
		var v any
		require.NoError(t, json.Unmarshal(data, &v))
		keys := map[string]bool{}
		jsonKeys("", v, keys)
		for key := range keys {
			require.True(t, want[key], "%s sample: key %q is not printed by the %s run of vmmdemo --json", k, key, k)
		}
		checked++
	}
	require.GreaterOrEqual(t, checked, 6)
}
