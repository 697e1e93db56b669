package main

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/measure"
)

// `vmmdemo broker` re-executes its own binary as its workers (the test binary stands in, see
// TestMain).
func runBrokerJSON(t *testing.T, args ...string) measure.BrokerResult {
	t.Helper()
	code, out, errOut := runPinnedCmd(t, append([]string{"broker", "--backend", "sim", "--json"}, args...)...)
	require.Equal(t, 0, code, errOut)
	var res measure.BrokerResult
	require.NoError(t, json.Unmarshal([]byte(out), &res), out)
	require.Empty(t, errOut, "no progress bar or notice without a terminal")
	return res
}

func TestBrokerCommandJSON(t *testing.T) {
	res := runBrokerJSON(t, "--sim-devices", "2", "--size", "64MiB", "--workers", "3", "--max-request", "16MiB", "--bytes", "32MiB", "--rtt-samples", "20")
	require.Equal(t, "sim", res.Backend)
	require.Equal(t, uint64(64<<20), res.RegionBytes)
	require.Equal(t, "host-numa", res.RegionKind)
	require.Equal(t, []int{0, 1}, res.Devices)
	require.Equal(t, []int{0, 1, 0}, res.WorkerDevices)
	require.Len(t, res.WorkerPIDs, 3)
	require.Equal(t, uint64(20<<20), res.WindowBytes, "64 MiB over 3 workers, in whole 2 MiB granules")
	require.Equal(t, uint64(16<<20), res.BufferBytes)
	require.True(t, res.Verified)
	require.Len(t, res.Bandwidth, 4, "1 and 16 MiB, both ways")
	for _, bw := range res.Bandwidth {
		require.Contains(t, []uint64{1 << 20, 16 << 20}, bw.RequestBytes)
		require.Contains(t, []string{"h2d", "d2h"}, bw.Direction)
		require.Equal(t, max(32<<20, 4*bw.RequestBytes), bw.BytesPerWorker, "at least 4 requests")
		require.Len(t, bw.PerWorkerGBs, 3)
		require.Positive(t, bw.AggregateGBs)
		require.Positive(t, bw.RawGBs)
		require.Len(t, bw.RawPerDeviceGBs, 2)
		require.InDelta(t, bw.AggregateGBs/bw.RawGBs, bw.VsRaw, 1e-9)
		require.Positive(t, bw.ServerCPUSeconds, "the broker's process used CPU while it copied")
		require.Positive(t, bw.ServerCores)
	}
	require.Equal(t, int64(4<<20), res.SpinMaxBytes, "the broker's default")
	rt := res.RoundTrip
	require.Equal(t, uint64(4096), rt.RequestBytes)
	require.Len(t, rt.PerWorkerRTTUS, 3)
	require.Positive(t, rt.RTTUS)
	require.Positive(t, rt.PingUS)
	require.Positive(t, rt.CopyUS)
	require.InDelta(t, rt.RTTUS-rt.CopyUS, rt.OverheadUS, 1e-9)
	cost := int64(64 << 20 / 512)
	require.Len(t, res.GPUMemory.PerDevice, 2)
	for i, m := range res.GPUMemory.PerDevice {
		require.Equal(t, i, m.Device)
		require.Equal(t, []int{2, 1}[i], m.WorkersOnDevice)
		require.Equal(t, cost, m.BrokerBytes, "device %d: the broker maps the region once", i)
		require.Equal(t, cost, m.BrokerRegionBytes)
		require.Zero(t, m.AddedByWorkersBytes, "device %d: CPU-only workers add nothing", i)
		require.Equal(t, int64(m.WorkersOnDevice)*cost, m.NaiveBytes, "device %d: each worker mapping the region pays", i)
		require.Equal(t, uint64(m.NaiveBytes), m.ExpectedNaiveBytes)
		require.Equal(t, uint64(cost), m.ExpectedBrokerBytes)
	}
	require.True(t, res.Targets.BrokerSameForAnyN)
	require.False(t, res.Targets.GPUFigures)
	require.NotEmpty(t, res.Notes)
}

// --spin-max reaches the broker: 0 makes every copy sleep.
func TestBrokerSpinMax(t *testing.T) {
	for arg, want := range map[string]int64{"0": -1, "1MiB": 1 << 20} {
		res := runBrokerJSON(t, "--sim-devices", "1", "--size", "8MiB", "--workers", "1", "--max-request", "1MiB",
			"--bytes", "4MiB", "--rtt-samples", "3", "--spin-max", arg)
		require.Equal(t, want, res.SpinMaxBytes, arg)
		require.True(t, res.Verified, arg)
	}
}

// The broker's GPU memory is the same for 1, 4 and 8 workers; mapping the region in every worker
// grows with them.
func TestBrokerCommandMemoryIndependentOfWorkers(t *testing.T) {
	cost := int64(16 << 20 / 512)
	for _, n := range []int{1, 4, 8} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			res := runBrokerJSON(t, "--sim-devices", "1", "--size", "16MiB", "--workers", fmt.Sprint(n), "--max-request", "1MiB", "--bytes", "2MiB", "--rtt-samples", "2")
			require.True(t, res.Verified)
			require.Len(t, res.GPUMemory.PerDevice, 1)
			m := res.GPUMemory.PerDevice[0]
			require.Equal(t, cost, m.BrokerBytes)
			require.Equal(t, int64(n)*cost, m.NaiveBytes)
		})
	}
}

func TestBrokerCommandText(t *testing.T) {
	code, out, errOut := runPinnedCmd(t, "broker", "--backend", "sim", "--sim-devices", "1", "--size", "8MiB", "--workers", "2", "--max-request", "1MiB", "--bytes", "4MiB", "--rtt-samples", "5")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "copy broker: 8 MiB host-numa region")
	require.Contains(t, out, "data verified both ways: yes")
	require.Contains(t, out, "round trip of a 4 KiB copy")
	require.NotContains(t, out, "16 MiB   h2d", "requests above --max-request are not measured")

	code, _, errOut = runPinnedCmd(t, "broker", "--backend", "sim", "--size", "4MiB", "--workers", "8")
	require.Equal(t, 2, code)
	require.Contains(t, errOut, "need at least 1MiB each")
	code, _, errOut = runPinnedCmd(t, "broker", "--backend", "sim", "--workers", "0")
	require.Equal(t, 2, code)
	require.Contains(t, errOut, "at least 1")
	code, _, errOut = runPinnedCmd(t, "broker", "--backend", "sim", "--devices", "5", "--size", "4MiB")
	require.Equal(t, 2, code)
	require.Contains(t, errOut, "there is no device 5")
}
