package main

import (
	"bytes"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/units"
)

// TestProgressStepsNotBytes: a bar that counts steps (bandwidth's sizes, staging's phases, a pool
// replay's allocations) shows counts, not sizes ("bandwidth ... 4 / 4", not "4 B / 4 B"); bars of
// bytes still show sizes.
func TestProgressStepsNotBytes(t *testing.T) {
	var out, errOut bytes.Buffer
	code := run(&env{stdout: &out, stderr: &errOut, interactive: true},
		[]string{"bandwidth", "--backend", "sim", "--max-size", "1MiB", "--staging", "4MiB"})
	require.Equal(t, 0, code, errOut.String())
	bars := errOut.String()
	require.Regexp(t, `\rbandwidth \[#+\] 100% 4 / 4 `, bars)
	require.Regexp(t, `\rstaging \[#+\] 100% 6 / 6 `, bars)
	require.NotRegexp(t, `\r(bandwidth|staging) \[[^\r]*\d B / `, bars)
	require.Regexp(t, `\r[^\r[]+\[#+\] 100% 1 MiB / 1 MiB `, bars, "a bar of bytes")
}

// TestProgressNeverPastTotal: no bar shows more done than its total (bandwidth's host memory bars
// were begun with the size asked for and told of the size rounded up: "2 MiB / 1 MiB").
func TestProgressNeverPastTotal(t *testing.T) {
	for _, args := range [][]string{
		{"bandwidth", "--backend", "sim", "--max-size", "1MiB", "--no-staging"},
		{"pinned", "--backend", "sim", "--size", "3MiB", "--procs", "1", "--modes", "cpu-only"},
	} {
		var out, errOut bytes.Buffer
		code := run(&env{stdout: &out, stderr: &errOut, interactive: true}, args)
		require.Equal(t, 0, code, errOut.String())
		checkBarsWithinTotal(t, errOut.String())
	}
}

// checkBarsWithinTotal checks every bar of bytes drawn in stderr: done at most total.
func checkBarsWithinTotal(t *testing.T, stderr string) {
	t.Helper()
	draws := regexp.MustCompile(`\r([^\r\[]+) \[[#.]+\] +\d+% ([^/\r]+ ?B) / ([^\r]+?) +(\r|$)`).FindAllStringSubmatch(stderr, -1)
	require.NotEmpty(t, draws)
	for _, d := range draws {
		done, err := units.ParseSize(strings.ReplaceAll(d[2], " ", ""))
		require.NoError(t, err, d[0])
		total, err := units.ParseSize(strings.ReplaceAll(d[3], " ", ""))
		require.NoError(t, err, d[0])
		require.LessOrEqual(t, done, total, "%s: %s of %s", d[1], d[2], d[3])
	}
}
