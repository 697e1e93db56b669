// Package testutil runs a test once per backend (the simulator always, the real driver when it loads
// and has devices) and ends each run with a leak check.
//
// Environment:
//   - CUVMM_REQUIRE_GPU=1: a missing driver or device fails the test instead of skipping it.
//   - CUVMM_REQUIRE_GPUS=N: a test that needs more devices than the host has fails instead of
//     skipping (set on multi-GPU hosts).
package testutil

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/fuzzfd"
	"github.com/cuvmm/cuvmm/vmm"
)

// Backend is one driver under test.
type Backend struct {
	Name string      // "sim" or "cuda"
	Sys  *vmm.System // open for the test; do not close it
	Sim  *sim.Sim    // the simulator, nil on the real driver
}

// IsSim reports whether the backend is the simulator.
func (b *Backend) IsSim() bool { return b.Sim != nil }

// Device opens device i or fails the test.
func (b *Backend) Device(t testing.TB, i int) *vmm.Device {
	t.Helper()
	d, err := b.Sys.Device(i)
	require.NoError(t, err)
	return d
}

// Option tunes Run.
type Option func(*config)

type config struct {
	devices        int
	simOpts        []sim.Option
	simOnly        bool
	allowListeners bool
	memoryLoss     uint64
}

// Devices makes the test need n devices: the simulator gets n, the real driver skips (or fails with
// CUVMM_REQUIRE_GPUS) when it has fewer.
func Devices(n int) Option { return func(c *config) { c.devices = n } }

// SimOptions passes options to sim.New.
func SimOptions(opts ...sim.Option) Option {
	return func(c *config) { c.simOpts = append(c.simOpts, opts...) }
}

// SimOnly runs the test on the simulator alone (fault injection and other simulator features).
func SimOnly() Option { return func(c *config) { c.simOnly = true } }

// RequireGPU reports whether CUVMM_REQUIRE_GPU=1.
func RequireGPU() bool { return os.Getenv("CUVMM_REQUIRE_GPU") == "1" }

// Run runs fn as subtest "sim" and, unless SimOnly, as subtest "cuda".
func Run(t *testing.T, fn func(t *testing.T, b *Backend), opts ...Option) {
	t.Helper()
	c := config{devices: 1}
	for _, o := range opts {
		o(&c)
	}
	t.Run("sim", func(t *testing.T) { runSim(t, c, fn) })
	if !c.simOnly {
		t.Run("cuda", func(t *testing.T) { runCUDA(t, c, fn) })
	}
}

func runSim(t *testing.T, c config, fn func(t *testing.T, b *Backend)) {
	fdsBefore := fdTable(t)
	s := sim.New(append([]sim.Option{sim.Devices(c.devices)}, c.simOpts...)...)
	sys, err := vmm.Open(s)
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, sys.Close(), "closing the system: something the test made is still open")
		live := s.Live()
		require.True(t, live.Zero(), "simulator objects leaked: %s", live)
		require.NoError(t, s.Close())
		requireNoFDLeak(t, fdsBefore, nil)
	})
	fn(t, &Backend{Name: "sim", Sys: sys, Sim: s})
}

var (
	realOnce sync.Once
	realSys  *vmm.System
	realErr  error
)

// realSystem opens the real driver once per test binary; its primary contexts stay retained for the
// binary's life so that per-test leak checks compare free memory without context creation noise.
func realSystem() (*vmm.System, error) {
	realOnce.Do(func() {
		api, err := driver.Open()
		if err != nil {
			realErr = err
			return
		}
		realSys, realErr = vmm.Open(api)
		if realErr != nil {
			return
		}
		if realSys.DeviceCount() == 0 {
			realErr = fmt.Errorf("the driver reports no devices: %w", driver.ErrNoDevice)
			return
		}
		devs, err := realSys.Devices()
		if err != nil {
			realErr = err
			return
		}
		for _, d := range devs {
			if err := d.LoadKernels(); err != nil {
				realErr = err
				return
			}
			if err := warmConcurrentChecks(d); err != nil {
				realErr = err
				return
			}
		}
	})
	return realSys, realErr
}

// warmConcurrentChecks runs a burst of concurrent pattern checks once per binary. The first such
// burst in a process grows memory the driver keeps for the process (measured on the H200: 4 MiB
// after the first burst of 8 concurrent checks, nothing after it), which would otherwise count as
// a leak of whichever test runs one first.
func warmConcurrentChecks(d *vmm.Device) error {
	const n, size = 8, 2 << 20
	buf, err := d.AllocPlain(n * size)
	if err != nil {
		return err
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ptr := buf.Ptr() + driver.DevicePtr(i*size)
			if errs[i] = d.Fill(ptr, size, 0, 1); errs[i] == nil {
				_, errs[i] = d.Verify(ptr, size, 0, 1)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errors.Join(errs...), buf.Close())
}

func runCUDA(t *testing.T, c config, fn func(t *testing.T, b *Backend)) {
	sys, err := realSystem()
	if err != nil {
		if RequireGPU() {
			t.Fatalf("CUVMM_REQUIRE_GPU=1 but the real driver is not usable: %v", err)
		}
		t.Skipf("real driver not usable here (set CUVMM_REQUIRE_GPU=1 to fail instead): %v", err)
	}
	if n := sys.DeviceCount(); n < c.devices {
		want, _ := strconv.Atoi(os.Getenv("CUVMM_REQUIRE_GPUS"))
		if want >= c.devices {
			t.Fatalf("test needs %d GPUs, CUVMM_REQUIRE_GPUS=%d, the host has %d", c.devices, want, n)
		}
		t.Skipf("test needs %d GPUs; this host has %d (set CUVMM_REQUIRE_GPUS to fail instead)", c.devices, n)
	}
	devs, err := sys.Devices()
	require.NoError(t, err)
	before := make([]uint64, len(devs))
	for i, d := range devs {
		require.NoError(t, d.Synchronize())
		before[i], _, err = d.MemInfo()
		require.NoError(t, err)
	}
	fdsBefore := fdTable(t)
	t.Cleanup(func() {
		requireMemoryBack(t, devs, before, c.memoryLoss)
		var allowed map[string]bool
		if c.allowListeners {
			allowed = listeningSockets(t)
		}
		requireNoFDLeak(t, fdsBefore, allowed)
	})
	fn(t, &Backend{Name: "cuda", Sys: sys})
}

// OpenFDs counts this process's open file descriptors, leaving out the NVIDIA device nodes that the
// real driver opens and closes on its own.
func OpenFDs(t testing.TB) int {
	t.Helper()
	fuzzfd.Settle() // a file dropped earlier is closed now, not between the caller's two counts
	n := 0
	for _, target := range fdTable(t) {
		if !driverDevice(target) {
			n++
		}
	}
	return n
}

// netpollOnce starts the Go runtime's poller (an epoll and an eventfd it keeps open for the
// process's life) before the first descriptor table is read, so that the test that happens to
// open the first pollable file is not blamed for the runtime's own descriptors.
var netpollOnce sync.Once

func startNetpoll() {
	netpollOnce.Do(func() {
		if r, w, err := os.Pipe(); err == nil {
			r.Close()
			w.Close()
		}
	})
}

// fdTable maps each open descriptor to what it points at.
func fdTable(t testing.TB) map[string]string {
	startNetpoll()
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	out := make(map[string]string, len(ents))
	for _, e := range ents {
		target, err := os.Readlink("/proc/self/fd/" + e.Name())
		if err != nil {
			continue // the directory's own descriptor, closed by now
		}
		out[e.Name()] = target
	}
	return out
}

// driverDevice reports whether a descriptor points at one of the NVIDIA device nodes, which the real
// driver opens and closes on its own (from background threads too) while a process uses it.
func driverDevice(target string) bool { return strings.HasPrefix(target, "/dev/nvidia") }

// requireNoFDLeak fails when descriptors opened since before (other than the driver's own device
// nodes and the targets in allowed, which it logs) are still open, naming them.
func requireNoFDLeak(t testing.TB, before map[string]string, allowed map[string]bool) {
	t.Helper()
	var leaked []string
	for fd, target := range fdTable(t) {
		if before[fd] == target || driverDevice(target) {
			continue
		}
		if allowed[target] {
			t.Logf("descriptor %s -> %s left open, allowed (a listening socket)", fd, target)
			continue
		}
		leaked = append(leaked, fd+" -> "+target)
	}
	sort.Strings(leaked)
	require.Empty(t, leaked, "file descriptors leaked")
}

// StillWaiting runs call on another goroutine and fails the test if it returns within d: for a call
// (a Close, say) that must wait for something the test releases next. what names the call and why it
// should wait. It returns the channel that the call's result comes on.
func StillWaiting(t testing.TB, d time.Duration, what string, call func() error) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- call() }()
	select {
	case err := <-done:
		t.Fatalf("%s returned (%v)", what, err)
	case <-time.After(d):
	}
	return done
}
