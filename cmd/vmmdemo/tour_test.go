package main

import (
	"flag"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

var tourFrom = flag.String("tour-golden-from", "", "rewrite testdata/tour.golden from this file of `vmmdemo tour --backend sim` output")

// goldenTourSections are the subcommands whose part of the tour the golden file fixes (subcommands
// added later are left out of the comparison, so that adding one does not need a new golden file).
var goldenTourSections = []string{"info", "grow", "stripe", "share", "bandwidth", "pinned", "broker"}

var tourNumber = regexp.MustCompile(`-?[0-9]+(\.[0-9]+)?`)

// normalizeTour keeps the tour's sections of goldenTourSections with every number replaced by N
// and runs of spaces collapsed, blank lines left out (figures, pids and column widths vary from run
// to run).
func normalizeTour(out string) string {
	var keep []string
	in := false
	for _, line := range strings.Split(out, "\n") {
		if name, ok := strings.CutPrefix(line, "== vmmdemo "); ok {
			name, _, _ = strings.Cut(name, " ")
			in = slices.Contains(goldenTourSections, name)
		}
		if (in || line == "tour complete") && strings.TrimSpace(line) != "" {
			line = tourNumber.ReplaceAllString(line, "N")
			line = strings.Join(strings.Fields(strings.ReplaceAll(line, " - ", " N ")), " ")
			keep = append(keep, line)
		}
	}
	// Blank lines carry nothing and depend on which section follows the last golden one.
	keep = slices.DeleteFunc(keep, func(l string) bool { return l == "" })
	return strings.Join(keep, "\n") + "\n"
}

// TestTourGolden: the tour on the simulator runs every subcommand and prints what it printed before the measurements moved
// to package measure, but for the figures themselves.
func TestTourGolden(t *testing.T) {
	golden := filepath.Join("testdata", "tour.golden")
	if *tourFrom != "" {
		b, err := os.ReadFile(*tourFrom)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(golden, []byte(normalizeTour(string(b))), 0o644))
	}
	code, out, stderr := runPinnedCmd(t, "tour", "--backend", "sim")
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out, stderr)
	require.True(t, strings.HasSuffix(strings.TrimSpace(out), "tour complete"), out)
	want, err := os.ReadFile(golden)
	require.NoError(t, err)
	require.Equal(t, normalizeTour(string(want)), normalizeTour(out))
}
