package main

import (
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

var updateGolden = flag.Bool("update", false, "rewrite testdata/json_keys.golden from the current output")

// keyRuns are the subcommands whose --json keys the golden file fixes, with small sizes on the
// simulator. A run is named by its subcommand, or by the subcommand, a dash and a mode
// ("sleep-file" runs vmmdemo sleep with the arguments given).
var keyRuns = map[string][]string{
	"sleep":         {"--sim-devices", "2", "--devices", "0,1", "--size", "8MiB", "--chunk", "4MiB", "--slot", "4MiB"},
	"sleep-prepare": {"--size", "8MiB", "--chunk", "4MiB", "--slot", "4MiB", "--prepare"},
	"sleep-file":    {"--size", "8MiB", "--chunk", "4MiB", "--slot", "4MiB", "--mode", "file", "--file-rounds", "3"},
	"info":          {"--sim-devices", "2"},
	"grow":          {"--to", "16MiB", "--step", "4MiB"},
	"stripe":        {"--devices", "0,1", "--size", "16MiB", "--stripe", "4MiB", "--builds", "1", "--reads", "1"},
	"share":         {"--size", "4MiB", "--chunks", "2", "--rounds", "1"},
	"bandwidth":     {"--max-size", "1MiB", "--staging", "4MiB", "--staging-chunk", "1MiB"},
	"pinned":        {"--sim-devices", "2", "--size", "4MiB", "--procs", "2"},
	"broker":        {"--sim-devices", "2", "--size", "8MiB", "--workers", "2", "--max-request", "1MiB", "--bytes", "2MiB", "--rtt-samples", "2"},
	"pool":          {"--synthetic", "serving", "--memory", "256MiB", "--fill-fraction", "0.6", "--verify-every", "256", "--cache-iters", "10"},
	"xfer":          {"--sim-devices", "2", "--size", "4MiB", "--block", "2MiB", "--warmup", "1", "--iters", "1"},
}

// varying are the key paths, by prefix, that the golden file leaves out because they depend on the
// run: xfer's nccl_env has a key per NCCL_* variable of the host, and pool leaves out an
// allocator's stitches when it made none.
var varying = []string{"xfer nccl_env.", "pool allocators.cuvmm.stitches"}

// jsonKeys lists every key path of a decoded JSON value: "a.b" for nested objects, "a[].b" for the
// objects in an array (the union over its elements).
func jsonKeys(prefix string, v any, out map[string]bool) {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			p := k
			if prefix != "" {
				p = prefix + "." + k
			}
			out[p] = true
			jsonKeys(p, e, out)
		}
	case []any:
		for _, e := range x {
			jsonKeys(prefix+"[]", e, out)
		}
	}
}

// TestJSONKeysGolden runs each subcommand with --json and compares its key paths with the committed
// list, so that no change drops or renames a key unnoticed. Run with -update after adding keys on
// purpose.
func TestJSONKeysGolden(t *testing.T) {
	golden := filepath.Join("testdata", "json_keys.golden")
	var lines []string
	names := make([]string, 0, len(keyRuns))
	for n := range keyRuns {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, name := range names {
		sub, _, _ := strings.Cut(name, "-")
		code, out, errOut := runCmd(t, append([]string{sub, "--backend", "sim", "--json"}, keyRuns[name]...)...)
		require.Equal(t, 0, code, "%s: %s", name, errOut)
		var v any
		require.NoError(t, json.Unmarshal([]byte(out), &v), "%s: %s", name, out)
		keys := map[string]bool{}
		jsonKeys("", v, keys)
		for k := range keys {
			line := name + " " + k
			if !slices.ContainsFunc(varying, func(v string) bool { return strings.HasPrefix(line, v) }) {
				lines = append(lines, line)
			}
		}
	}
	slices.Sort(lines)
	got := strings.Join(lines, "\n") + "\n"
	if *updateGolden {
		require.NoError(t, os.WriteFile(golden, []byte(got), 0o644))
	}
	want, err := os.ReadFile(golden)
	require.NoError(t, err)
	require.Equal(t, string(want), got, "the --json keys changed; run go test ./cmd/vmmdemo -run TestJSONKeysGolden -update if that is on purpose")
}
