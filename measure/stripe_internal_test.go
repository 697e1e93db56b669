package measure

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
)

// TestStripeTextNoRawBuild: a raw build time of 0 prints "-", not +Inf or NaN.
func TestStripeTextNoRawBuild(t *testing.T) {
	var w bytes.Buffer
	(&StripeResult{BuildSeconds: 0.01}).Text(&w)
	require.Contains(t, w.String(), "raw driver sequence: 0.000 ms, -;")
	require.NotContains(t, w.String(), "Inf")
	require.NotContains(t, w.String(), "NaN")
}

// The reader's events, recorded on the legacy stream, bracket the kernels of every one of its
// streams only because those streams are blocking: the end event must not complete while any of
// them still has a kernel queued.
func TestReaderEndWaitsForEveryStream(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 2 << 20})
		require.NoError(t, err)
		defer func() { require.NoError(t, buf.Close()) }()
		require.NoError(t, buf.Grow(2<<20))
		rd, err := newReader(d)
		require.NoError(t, err)
		defer func() { require.NoError(t, rd.close()) }()
		for k, held := range rd.streams {
			require.NoError(t, b.Sim.HoldStream(held.Handle()))
			require.NoError(t, rd.start.Record(nil))
			for _, s := range rd.streams {
				require.NoError(t, d.LaunchRead(buf.Ptr(), 2<<20, s))
			}
			require.NoError(t, rd.end.Record(nil))
			done, err := rd.end.Query()
			require.NoError(t, b.Sim.ReleaseStream(held.Handle())) // first: a held stream would hang the clean-up
			require.NoError(t, err)
			require.False(t, done, "the end event passed stream %d's queued kernel", k)
			require.NoError(t, rd.end.Synchronize())
		}
	}, testutil.SimOnly(), testutil.SimOptions(sim.DeferWork()))
}
