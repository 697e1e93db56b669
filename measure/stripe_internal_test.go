package measure

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestStripeTextNoRawBuild: a raw build time of 0 prints "-", not +Inf or NaN.
func TestStripeTextNoRawBuild(t *testing.T) {
	var w bytes.Buffer
	(&StripeResult{BuildSeconds: 0.01}).Text(&w)
	require.Contains(t, w.String(), "raw driver sequence: 0.000 ms, -;")
	require.NotContains(t, w.String(), "Inf")
	require.NotContains(t, w.String(), "NaN")
}
