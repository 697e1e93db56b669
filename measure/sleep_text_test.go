package measure

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
)

// The text says how the first sleep compares with the usual backup in words that fit the ratio:
// faster above 1, slower below (the simulator's timings can put it there), and each file round.
func TestSleepText(t *testing.T) {
	for _, c := range []struct {
		speedup float64
		want    string
	}{
		{6.25, "first sleep of one device 0.800 s: 6.2x faster"},
		{1, "1.0x faster"},
		{0.5, "first sleep of one device 0.800 s: 2.0x slower"},
	} {
		var b bytes.Buffer
		(&SleepResult{Mode: "keep", FirstSleepOneSeconds: 0.8, FirstSleepSpeedup: c.speedup}).Text(&b)
		require.Contains(t, b.String(), c.want)
	}
	var b bytes.Buffer
	(&SleepResult{Mode: "file", File: "f.bin", Rounds: 3, WakeVsRawFileRounds: []float64{0.9, 0.95, 1.02}, WakeVsRawFileRoundsMedian: 0.95}).Text(&b)
	require.Contains(t, b.String(), "(medians of 3 rounds)")
	require.Contains(t, b.String(), "0.90, 0.95, 1.02x (median 0.95x)")
}
