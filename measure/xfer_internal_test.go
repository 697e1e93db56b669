package measure

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestXferTimedResetsBeforeTimedSteps: the receiver's buffer is zeroed after the warm-up and
// before the timed steps, so timed steps that deliver nothing leave it zero and fail verification.
func TestXferTimedResetsBeforeTimedSteps(t *testing.T) {
	var calls []string
	buf := byte(0)
	steps := 0
	step := func() error {
		steps++
		if steps == 1 { // only the warm-up delivers
			buf = 1
		}
		calls = append(calls, "step")
		return nil
	}
	wait := func() error { calls = append(calls, "wait"); return nil }
	reset := func() error { buf = 0; calls = append(calls, "reset"); return nil }
	_, err := xferTimed(1, 2, step, wait, reset)
	require.NoError(t, err)
	require.Equal(t, []string{"step", "wait", "reset", "step", "step", "wait"}, calls)
	require.Zero(t, buf, "what the warm-up delivered is gone before the timed steps")
	_, err = xferTimed(1, 1, step, wait, nil)
	require.NoError(t, err)
}
