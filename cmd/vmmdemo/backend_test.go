package main

import (
	"bytes"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/measure"
)

// A measurement that fails and leaves something open reports both: its own error and the backend's
// Close refusing, so that a leak on an error path is not hidden behind the first error.
func TestMeasureAndShowReportsCloseErrorAfterFailure(t *testing.T) {
	var out, errOut bytes.Buffer
	runErr := errors.New("the measurement failed")
	err := measureAndShow(&env{stdout: &out, stderr: &errOut}, &common{backend: "sim", simDevices: 1},
		func(me measure.Env) (*measure.GrowResult, error) {
			d, err := me.Backend.Sys.Device(0)
			require.NoError(t, err)
			_, err = d.NewStream(true) // left open: System.Close refuses (the simulator is closed anyway)
			require.NoError(t, err)
			return nil, runErr
		})
	require.ErrorIs(t, err, runErr)
	require.ErrorContains(t, err, "stream", "the Close error names what was left open")
}
