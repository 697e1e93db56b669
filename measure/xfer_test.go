package measure_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/measure"
)

func TestXferSim(t *testing.T) {
	for _, o := range []struct{ register, byChunks bool }{{false, false}, {true, false}, {false, true}} {
		b := simBackend(t, 2)
		rec := &recorder{}
		res, err := measure.Xfer(measure.XferOptions{Env: measure.Env{Backend: b, Progress: rec}, Size: 8 << 20,
			Register: o.register, ByChunks: o.byChunks, Warmup: 1, Iters: 2})
		require.NoError(t, err)
		require.NoError(t, res.Check())
		require.True(t, res.Verified)
		require.Equal(t, o.register, res.Registered)
		require.Equal(t, o.register || o.byChunks, res.ByChunks)
		require.Equal(t, "auto", res.Transport)
		require.Greater(t, res.NCCLGBps, 0.0)
		require.Greater(t, res.NativeGBps, 0.0)
		require.Greater(t, res.Chunks, 1, "a growable buffer of several chunks")
		require.Contains(t, rec.labels, "filling KV blocks")
	}
}

func TestXferOptions(t *testing.T) {
	b := simBackend(t, 2)
	for _, o := range []measure.XferOptions{
		{Size: 3 << 20},
		{Size: 4 << 20, Transport: "rdma"},
		{Size: 4 << 20, Peer: "mpi"},
		{Size: 4 << 20, Devices: [2]int{1, 1}},
		{Size: 4 << 20, Devices: [2]int{0, 5}},
	} {
		o.Env = measure.Env{Backend: b}
		_, err := measure.Xfer(o)
		require.ErrorIs(t, err, measure.ErrInvalidOption, "%+v", o)
	}
}
