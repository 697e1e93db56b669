package pinned_test

import (
	"errors"
	"net"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

type shareState struct {
	region     *pinned.Region
	send, recv *net.UnixConn
}

func (s shareState) close() error {
	return errors.Join(s.region.Close(), s.send.Close(), s.recv.Close())
}

// newShareState makes a region of kind and a socket pair; with shared, the region is already sent.
func newShareState(t testing.TB, sys *vmm.System, kind pinned.Kind, shared bool) shareState {
	d, err := sys.Device(0)
	require.NoError(t, err)
	r, err := pinned.New(d, 4<<20, pinned.Options{Kind: kind, ChunkSize: 2 << 20})
	require.NoError(t, err)
	send, recv := testutil.SocketPair(t)
	if shared {
		require.NoError(t, r.Share(send))
	}
	return shareState{r, send, recv}
}

// Every fault of New, Share and Receive, alone or with any failing clean-up call, leaves nothing that
// Close and System.Close cannot free, and no descriptor open.
func TestFaultMatrix(t *testing.T) {
	total := 0
	for _, kind := range []pinned.Kind{pinned.HostNUMA, pinned.SharedMemory} {
		total += testutil.FaultMatrix(t, testutil.FaultCase[struct{}, *pinned.Region]{
			Name: "pinned New " + kind.String(),
			Op: func(sys *vmm.System, _ struct{}) (*pinned.Region, error) {
				d, err := sys.Device(0)
				if err != nil {
					return nil, err
				}
				return pinned.New(d, 6<<20, pinned.Options{Kind: kind, ChunkSize: 2 << 20})
			},
			Close: func(_ *vmm.System, _ struct{}, r *pinned.Region, _ error) error { return r.Close() },
		})
		// Sharing a memfd makes no driver call: nothing to fail there.
		if kind == pinned.HostNUMA {
			total += testutil.FaultMatrix(t, testutil.FaultCase[shareState, struct{}]{
				Name:  "pinned Share " + kind.String(),
				Setup: func(t testing.TB, sys *vmm.System) shareState { return newShareState(t, sys, kind, false) },
				Op: func(_ *vmm.System, s shareState) (struct{}, error) {
					return struct{}{}, s.region.Share(s.send)
				},
				Close: func(_ *vmm.System, s shareState, _ struct{}, _ error) error { return s.close() },
			})
		}
		total += testutil.FaultMatrix(t, testutil.FaultCase[shareState, *pinned.Region]{
			Name:  "pinned Receive " + kind.String(),
			Setup: func(t testing.TB, sys *vmm.System) shareState { return newShareState(t, sys, kind, true) },
			Op: func(sys *vmm.System, s shareState) (*pinned.Region, error) {
				d, err := sys.Device(0)
				if err != nil {
					return nil, err
				}
				return pinned.Receive(s.recv, d, pinned.OpenOptions{Grant: []*vmm.Device{d}})
			},
			Close: func(_ *vmm.System, s shareState, r *pinned.Region, _ error) error {
				return errors.Join(r.Close(), s.close())
			},
		})
	}
	t.Logf("pinned fault matrix: %d combinations in all", total)
}
