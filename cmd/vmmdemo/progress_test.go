package main

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
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
