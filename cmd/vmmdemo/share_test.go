package main

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestShareSimJSON(t *testing.T) {
	for _, tc := range []struct{ location, access string }{{"device", "device"}, {"host", "device"}, {"host", "cpu"}} {
		t.Run(tc.location+"-"+tc.access, func(t *testing.T) {
			code, out, stderr := runCmd(t, "share", "--backend", "sim", "--size", "16MiB", "--chunks", "4",
				"--location", tc.location, "--child-access", tc.access, "--rounds", "2", "--json")
			require.Equal(t, 0, code, stderr)
			var m map[string]any
			require.NoError(t, json.Unmarshal([]byte(out), &m))
			for _, k := range []string{"size_bytes", "chunks", "handle_type", "export_us", "send_us", "import_map_us", "round_trip_us", "verified"} {
				require.Contains(t, m, k)
			}
			require.Equal(t, true, m["verified"])
			require.Equal(t, float64(16<<20), m["size_bytes"])
			require.Equal(t, "posix-fd", m["handle_type"], "the simulator refuses FABRIC unless enabled: the fallback is posix-fd alone")
			require.Equal(t, tc.access, m["child_access"])
		})
	}
}

func TestShareBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--chunks", "0"}, {"--size", "0"}, {"--location", "disk"}, {"--child-access", "gpu"},
		{"--location", "device", "--child-access", "cpu"}, {"--rounds", "0"},
	} {
		code, _, stderr := runCmd(t, append([]string{"share", "--backend", "sim"}, args...)...)
		require.Equal(t, 2, code, "%v: %s", args, stderr)
	}
}
