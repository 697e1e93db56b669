package stripe_test

import (
	"testing"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/stripe"
	"github.com/cuvmm/cuvmm/vmm"
)

// Every fault of New, alone or with any failing clean-up call, leaves nothing that Close and
// System.Close cannot free.
func TestNewFaultMatrix(t *testing.T) {
	total := 0
	for _, l := range []stripe.Layout{stripe.Blocked{}, stripe.Interleaved{Stripe: 2 * mib}} {
		total += testutil.FaultMatrix(t, testutil.FaultCase[struct{}, *stripe.Range]{
			Name:    "stripe New " + l.String(),
			Devices: 2,
			Op: func(sys *vmm.System, _ struct{}) (*stripe.Range, error) {
				devs, err := sys.Devices()
				if err != nil {
					return nil, err
				}
				return stripe.New(devs, 10*mib, l, stripe.Options{HandleTypes: driver.HandleTypePosixFD, ReadOnlyPeers: true})
			},
			Close: func(sys *vmm.System, _ struct{}, r *stripe.Range, _ error) error { return r.Close() },
		})
	}
	t.Logf("stripe fault matrix: %d combinations in all", total)
}
