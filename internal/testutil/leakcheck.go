package testutil

import (
	"bufio"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/vmm"
)

// AllowListeningSockets leaves listening TCP sockets out of the descriptor check of the real-driver
// run. NCCL (2.28) leaves the listening sockets of its bootstrap open when a communicator is aborted
// while it still waits for its peers there; nothing outside NCCL can close them. Every other
// descriptor is still checked.
func AllowListeningSockets() Option { return func(c *config) { c.allowListeners = true } }

// AllowDeviceMemoryLoss lets the real-driver run end with up to n bytes less free memory on a
// device than it started with (logged, not failed). NCCL (2.28) keeps the connection buffers of a
// communicator that is aborted while an operation is in flight for the life of the process; only
// the tests that abort one use this. More than n still fails.
func AllowDeviceMemoryLoss(n uint64) Option { return func(c *config) { c.memoryLoss = n } }

// memoryReturnWait is how long the leak check waits for device memory to come back: NCCL frees some
// of an aborted communicator's memory from its own threads.
const memoryReturnWait = 3 * time.Second

// requireMemoryBack fails for each device whose free memory has not come back (within 2 MiB, or
// allowed bytes) to what it was at the start, after waiting up to memoryReturnWait; it logs a wait
// that was needed.
func requireMemoryBack(t testing.TB, devs []*vmm.Device, before []uint64, allowed uint64) {
	t.Helper()
	const slack = 2 << 20
	start, back := time.Now(), true
	for i, d := range devs {
		for {
			require.NoError(t, d.Synchronize())
			free, _, err := d.MemInfo()
			require.NoError(t, err)
			if free+slack >= before[i] {
				break
			}
			if time.Since(start) > memoryReturnWait {
				back = false
				lost := before[i] - free
				if lost <= allowed {
					t.Logf("device %d: %d bytes less free memory at the end (allowed up to %d: NCCL keeps an aborted communicator's buffers)", i, lost, allowed)
				} else {
					t.Errorf("device %d: free memory %d bytes at the end, %d at the start: %d bytes leaked", i, free, before[i], lost)
				}
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	if took := time.Since(start); back && took > 100*time.Millisecond {
		t.Logf("device memory came back %v after the test", took.Round(time.Millisecond))
	}
}

// listeningSockets is the set of socket inodes ("socket:[N]") of this process's network namespace
// that are listening TCP sockets.
func listeningSockets(t testing.TB) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	for _, name := range []string{"/proc/self/net/tcp", "/proc/self/net/tcp6"} {
		f, err := os.Open(name)
		if err != nil {
			continue // no IPv6 here
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			// sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
			fields := strings.Fields(sc.Text())
			if len(fields) > 9 && fields[3] == "0A" {
				out["socket:["+fields[9]+"]"] = true
			}
		}
		f.Close()
	}
	return out
}
