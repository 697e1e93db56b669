package metrics_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/metrics"
	"github.com/cuvmm/cuvmm/offload"
)

// A scrape of a set's collector follows its buffers through a sleep and a wake.
func TestSetScrapeFollowsSleepAndWake(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		buf, err := growbuf.New(dev, growbuf.Options{MaxSize: 64 * mib, Chunk: growbuf.FixedChunks(2 * mib)})
		require.NoError(t, err)
		defer func() { require.NoError(t, buf.Close()) }()
		require.NoError(t, buf.Grow(8*mib))
		set := offload.NewSet(b.Sys, offload.Options{SlotSize: 4 * mib, FirstSleep: offload.FirstSleepStage})
		defer func() { require.NoError(t, set.Close()) }()
		require.NoError(t, set.Add("weights", buf, offload.Keep, offload.EntryOptions{}))
		reg := prometheus.NewRegistry()
		reg.MustRegister(metrics.NewSet(set, "model", metrics.Options{}))
		w := map[string]string{"set": "model", "tag": "weights", "policy": "keep"}
		sleep, wake := map[string]string{"set": "model", "op": "sleep"}, map[string]string{"set": "model", "op": "wake"}

		fams := scrape(t, reg)
		require.Equal(t, float64(8*mib), value(fams, "cuvmm_offload_buffer_bytes", w))
		require.Zero(t, value(fams, "cuvmm_offload_buffer_asleep", w))
		require.Contains(t, fams, "cuvmm_offload_calls_total", "the counters exist before the first sleep")

		require.NoError(t, set.Sleep(context.Background()))
		fams = scrape(t, reg)
		require.Equal(t, 1.0, value(fams, "cuvmm_offload_buffer_asleep", w))
		require.Equal(t, float64(8*mib), value(fams, "cuvmm_offload_asleep_bytes", map[string]string{"set": "model"}))
		require.GreaterOrEqual(t, value(fams, "cuvmm_offload_backup_bytes", nil), float64(8*mib))
		require.Equal(t, 1.0, value(fams, "cuvmm_offload_calls_total", sleep))
		require.Equal(t, float64(8*mib), value(fams, "cuvmm_offload_bytes_total", sleep))
		require.Positive(t, value(fams, "cuvmm_offload_last_seconds", sleep))
		require.Positive(t, value(fams, "cuvmm_offload_last_sleep_step_seconds", map[string]string{"set": "model", "step": "copy"}))
		require.Contains(t, fams, "cuvmm_offload_last_sleep_step_seconds")
		require.Equal(t, float64(8*mib), value(fams, "cuvmm_offload_last_sleep_staged_bytes", nil), "the first sleep staged the backup")
		require.Contains(t, fams["cuvmm_offload_last_sleep_step_seconds"].GetHelp(), "wait (", "the help names the labels the series has")
		require.Contains(t, fmt.Sprint(fams["cuvmm_offload_last_sleep_step_seconds"].GetMetric()), `value:"wait"`, "a step label is wait")

		require.NoError(t, set.Wake(context.Background()))
		fams = scrape(t, reg)
		require.Zero(t, value(fams, "cuvmm_offload_buffer_asleep", w))
		require.Zero(t, value(fams, "cuvmm_offload_asleep_bytes", nil))
		require.Equal(t, 1.0, value(fams, "cuvmm_offload_calls_total", wake))
		require.Equal(t, float64(8*mib), value(fams, "cuvmm_offload_bytes_total", wake))
		require.Zero(t, value(fams, "cuvmm_offload_failures_total", wake))
	})
}

// Sets register side by side by name; a snapshot's figures come through as they are.
func TestSetCollectorsByName(t *testing.T) {
	stats := func() offload.Stats {
		return offload.Stats{Buffers: []offload.BufferStats{{Tag: "kv", Policy: offload.File, Bytes: 3 << 30, Asleep: true}},
			WakeFailures: 2, WakeTime: 1500 * time.Millisecond, PooledBytes: 5, BackupBytes: 5}
	}
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(metrics.NewSetFunc(stats, "a", metrics.Options{})))
	require.NoError(t, reg.Register(metrics.NewSetFunc(stats, "b", metrics.Options{})))
	require.Error(t, reg.Register(metrics.NewSetFunc(stats, "a", metrics.Options{})))
	fams := scrape(t, reg)
	require.Equal(t, float64(3<<30), value(fams, "cuvmm_offload_buffer_bytes", map[string]string{"set": "b", "tag": "kv", "policy": "file"}))
	require.Equal(t, 2.0, value(fams, "cuvmm_offload_failures_total", map[string]string{"set": "a", "op": "wake"}))
	require.Equal(t, 1.5, value(fams, "cuvmm_offload_seconds_total", map[string]string{"set": "a", "op": "wake"}))
	require.Equal(t, 5.0, value(fams, "cuvmm_offload_pooled_bytes", map[string]string{"set": "a"}))
}
