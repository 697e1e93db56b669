package testutil

import (
	"fmt"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/vmm"
)

// CleanupFunctions are the driver calls that undo something: FaultMatrix combines every primary fault
// with the failure of each call of these that the failed operation makes.
var CleanupFunctions = []string{
	"cuMemUnmap", "cuMemRelease", "cuMemAddressFree", "cuMemHostUnregister", "cuMemFree",
	"cuMemFreeHost", "cuStreamDestroy", "cuEventDestroy", "cuModuleUnload",
}

// FaultCase is one multi-step operation for FaultMatrix. S is what Setup makes, R what Op returns.
type FaultCase[S, R any] struct {
	// Name names the operation in the log and in failures.
	Name string
	// Devices is the number of simulated devices (0: 1); SimOptions are passed to sim.New.
	Devices    int
	SimOptions []sim.Option
	// Setup prepares what the operation needs, with no fault armed (may be nil).
	Setup func(t testing.TB, sys *vmm.System) S
	// Op is the operation under test; every call it makes is a candidate for a fault.
	Op func(sys *vmm.System, state S) (R, error)
	// Close closes everything Setup and Op made (result is Op's, the zero R when Op failed). It runs
	// with no fault armed, up to three times until it returns nil, as a user retrying Close would.
	Close func(sys *vmm.System, state S, result R, opErr error) error
	// Primary lists the functions whose calls are made to fail as the primary fault; nil: every
	// function Op calls.
	Primary []string
	// Code is the result code of the injected faults (0: CUDA_ERROR_OUT_OF_MEMORY).
	Code driver.Result
}

type armed struct {
	fn string
	n  int
}

func (a armed) String() string { return fmt.Sprintf("%s #%d", a.fn, a.n) }

// FaultMatrix runs c once per combination of a primary fault (the n-th call, for every n, of every
// function Op calls, or of c.Primary) with no further fault and with the failure of each clean-up
// call (CleanupFunctions) that the primary fault's run makes. After each run it closes everything
// with no fault armed (c.Close, then System.Close, each retried up to three times) and requires both
// to succeed, the simulator to hold nothing, and no file descriptor to be left open: no failure, even
// of a clean-up, leaves an object that no API can free. Each combination runs on a fresh simulator.
// It logs and returns the number of combinations.
func FaultMatrix[S, R any](t *testing.T, c FaultCase[S, R]) int {
	t.Helper()
	calls := c.run(t, nil)
	primary := c.Primary
	if primary == nil {
		for fn := range calls {
			primary = append(primary, fn)
		}
		sort.Strings(primary)
	}
	combos := 0
	for _, fn := range primary {
		for n := 1; n <= calls[fn]; n++ {
			p := armed{fn, n}
			during := c.run(t, []armed{p})
			combos++
			for _, cf := range CleanupFunctions {
				for m := 1; m <= during[cf]; m++ {
					c.run(t, []armed{p, {cf, m}})
					combos++
				}
			}
		}
	}
	require.NotZero(t, combos, "%s: the operation made no call that a fault could hit", c.Name)
	t.Logf("fault matrix %s: %d combinations (%d primary functions)", c.Name, combos, len(primary))
	return combos
}

// run runs the case with faults armed and returns the calls Op made by function.
func (c FaultCase[S, R]) run(t *testing.T, faults []armed) map[string]int {
	t.Helper()
	name := c.Name
	if len(faults) > 0 {
		parts := make([]string, len(faults))
		for i, f := range faults {
			parts[i] = f.String()
		}
		name += " failing " + strings.Join(parts, " and ")
	}
	code := c.Code
	if code == driver.Success {
		code = driver.ErrorOutOfMemory
	}
	fds := fdTable(t)
	n := max(c.Devices, 1)
	s := sim.New(append([]sim.Option{sim.Devices(n)}, c.SimOptions...)...)
	defer s.Close()
	sys, err := vmm.Open(s)
	require.NoError(t, err, name)
	var state S
	if c.Setup != nil {
		state = c.Setup(t, sys)
	}
	before := s.CallCounts()
	for _, f := range faults {
		s.FailNth(f.fn, f.n, code)
	}
	res, opErr := c.Op(sys, state)
	after := s.CallCounts()
	s.ClearFaults()
	if len(faults) == 0 {
		require.NoError(t, opErr, "%s: the operation fails with no fault armed", name)
	}
	if c.Close != nil {
		require.NoError(t, retry(func() error { return c.Close(sys, state, res, opErr) }), "%s: closing what the operation left (op error: %v)", name, opErr)
	}
	require.NoError(t, retry(sys.Close), "%s: System.Close (op error: %v)", name, opErr)
	live := s.Live()
	require.True(t, live.Zero(), "%s: objects no API can free: %s (op error: %v)", name, live, opErr)
	require.NoError(t, s.Close(), name)
	requireNoFDLeak(t, fds, nil)
	out := map[string]int{}
	for fn, n := range after {
		if d := n - before[fn]; d > 0 {
			out[fn] = d
		}
	}
	return out
}

func retry(fn func() error) error {
	var err error
	for i := 0; i < 3; i++ {
		if err = fn(); err == nil {
			return nil
		}
	}
	return err
}
