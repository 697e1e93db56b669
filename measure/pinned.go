package measure

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// PinnedOptions are Pinned's options.
type PinnedOptions struct {
	Env
	// Size is the region's size; Procs the worker processes that share it.
	Size  uint64
	Procs int
	// Devices the workers use, round robin (nil: every device).
	Devices []int
	// Modes to run, of naive, shared and cpu-only (nil: all three).
	Modes []string
	// NoBaseline skips timing cuMemHostAlloc of the same size.
	NoBaseline bool
	// WorkerContexts is the devices each worker holds a context on: "all" (a worker that uses every
	// GPU, as multi-GPU services do) or "own" (its device only, as with one visible GPU per
	// worker). A registration costs page tables on every device where its process has a context.
	WorkerContexts string
}

func (o *PinnedOptions) check() error {
	if err := o.Env.check(); err != nil {
		return err
	}
	if o.WorkerContexts != "all" && o.WorkerContexts != "own" {
		return fmt.Errorf("--worker-contexts %q: want all or own: %w", o.WorkerContexts, ErrInvalidOption)
	}
	if err := firstErr(nonZeroSize("size", o.Size), atLeast(1, intOption{"procs", o.Procs})); err != nil {
		return err
	}
	if o.Procs > MaxWorkers {
		return fmt.Errorf("--procs %d: want at most %d: %w", o.Procs, MaxWorkers, ErrInvalidOption)
	}
	if o.Modes == nil {
		o.Modes = pinModes
	}
	for i, m := range o.Modes {
		if !slices.Contains(pinModes, m) {
			return fmt.Errorf("--modes: unknown mode %q (want naive, shared, cpu-only): %w", m, ErrInvalidOption)
		}
		if slices.Contains(o.Modes[:i], m) {
			return fmt.Errorf("--modes: %q is listed twice: %w", m, ErrInvalidOption)
		}
	}
	return nil
}

// Pinned has Procs worker processes share one pinned region in each mode (naive: each registers
// the creator's memfd; shared: each maps a CPU-only region for its own GPU; cpu-only: each maps it
// for the CPU alone), checks what they read, and measures each device's GPU memory overhead
// against what the page tables should cost; it also times making the region ready against
// cuMemHostAlloc.
func Pinned(opts PinnedOptions) (*PinnedResult, error) {
	if err := opts.check(); err != nil {
		return nil, err
	}
	opts.syncLog()
	b := opts.Backend
	all, err := b.Sys.Devices()
	if err != nil {
		return nil, err
	}
	devs, err := devices(b, opts.Devices, "devices")
	if err != nil {
		return nil, err
	}
	res := &PinnedResult{Backend: b.Name, SizeBytes: opts.Size, Procs: opts.Procs, WorkerContexts: opts.WorkerContexts,
		Devices: ordinalsOf(devs)}
	for i := 0; i < opts.Procs; i++ {
		res.WorkerDevices = append(res.WorkerDevices, devs[i%len(devs)].Ordinal())
	}
	res.Measure = "cuMemGetInfo free memory of each device after every worker's context is up, then while every worker holds the region; the difference is the overhead"
	if b.Sim() {
		res.Measure += " (simulator: each process has its own simulated devices, so the figure sums the workers' own differences)"
	}
	if err := pinReadyTimes(&opts, devs[0], res); err != nil {
		return nil, err
	}
	for _, m := range opts.Modes {
		mr, err := pinRunMode(&opts, m, res.WorkerDevices, all)
		if err != nil {
			return nil, fmt.Errorf("mode %s: %w", m, err)
		}
		res.Modes = append(res.Modes, *mr)
	}
	pinSummarize(res)
	return res, nil
}

// The sharing modes Pinned measures.
const (
	pinNaive   = "naive"    // the creator makes a memfd; every worker registers it (visible to every GPU)
	pinShared  = "shared"   // the creator makes a CPU-only region; every worker grants its own GPU only
	pinCPUOnly = "cpu-only" // the creator makes a CPU-only region; workers map it for the CPU alone
)

var pinModes = []string{pinNaive, pinShared, pinCPUOnly}

// PinnedDeviceOverhead is one device's GPU memory overhead in one mode.
type PinnedDeviceOverhead struct {
	Device        int    `json:"device"`
	OverheadBytes int64  `json:"overhead_bytes"`
	ExpectedBytes uint64 `json:"expected_bytes"`
}

// PinnedModeResult is one sharing mode.
type PinnedModeResult struct {
	Mode              string                 `json:"mode"`
	RegionKind        string                 `json:"region_kind"`
	CreatorSeconds    float64                `json:"creator_seconds"`
	WorkerOpenSeconds []float64              `json:"worker_open_seconds"`
	PerDevice         []PinnedDeviceOverhead `json:"per_device"`
	Verified          bool                   `json:"verified"`
}

// PinnedReady is the time to make the region usable by a GPU one way.
type PinnedReady struct {
	Method  string  `json:"method"`
	Seconds float64 `json:"seconds"`
	Note    string  `json:"note,omitempty"`
}

// PinnedResult is the GPU page-table overhead of a pinned region shared by N processes, by sharing
// mode, and the time to make it ready against cuMemHostAlloc.
type PinnedResult struct {
	Backend       string `json:"backend"`
	SizeBytes     uint64 `json:"size_bytes"`
	Procs         int    `json:"procs"`
	Devices       []int  `json:"devices"`
	WorkerDevices []int  `json:"worker_devices"`
	// WorkerContexts is "all" when every worker holds a context on every device, "own" when only on
	// its own device.
	WorkerContexts string `json:"worker_contexts"`
	// Ready: the time to make SIZE bytes usable by a GPU in one process, each way.
	Ready []PinnedReady `json:"ready"`
	// ReadyVsHostAlloc is the default region's ready time over cuMemHostAlloc's.
	ReadyVsHostAlloc float64            `json:"ready_vs_host_alloc"`
	Modes            []PinnedModeResult `json:"modes"`
	// SharedOverNaive is the largest, over devices, of shared's overhead over naive's.
	SharedOverNaive float64 `json:"shared_over_naive"`
	// CPUOnlyOverhead is the largest cpu-only overhead on any device (bytes).
	CPUOnlyOverhead int64  `json:"cpu_only_overhead_bytes"`
	Measure         string `json:"measure"`
}

// pinReadyTimes times making size bytes usable by dev: the default region, a shared-memory region,
// and cuMemHostAlloc (the baseline).
func pinReadyTimes(o *PinnedOptions, dev *vmm.Device, res *PinnedResult) error {
	size, baseline := o.Size, !o.NoBaseline
	timeRegion := func(method, note string, opts pinned.Options) (float64, error) {
		update, end := lazyBar(o.Progress, "pinning "+method)
		opts.Progress = update
		t0 := time.Now()
		r, err := pinned.New(dev, size, opts)
		sec := time.Since(t0).Seconds()
		end()
		if err != nil {
			return 0, fmt.Errorf("%s region of %s: %w", method, units.FormatSize(size), err)
		}
		res.Ready = append(res.Ready, PinnedReady{Method: method, Seconds: sec, Note: note})
		return sec, r.Close()
	}
	var def float64
	var err error
	if pinned.SupportsHostNUMA(dev) {
		if def, err = timeRegion("host-numa", "pinned.New: cuMemCreate on the host NUMA node, mapped, CPU and device granted", pinned.Options{Kind: pinned.HostNUMA}); err != nil {
			return err
		}
	}
	sec, err := timeRegion("shared-memory", "pinned.New: memfd + mmap + cuMemHostRegister (4 KiB shmem pages)", pinned.Options{Kind: pinned.SharedMemory})
	if err != nil {
		return err
	}
	if def == 0 {
		def = sec
	}
	mem, err := pinned.MapAnonymous(size)
	if err != nil {
		return err
	}
	t0 := time.Now()
	r, err := pinned.Register(dev, mem, pinned.RegisterOptions{HugePages: true})
	if err == nil {
		res.Ready = append(res.Ready, PinnedReady{Method: "registered-thp", Seconds: time.Since(t0).Seconds(),
			Note: "pinned.Register of anonymous memory advised MADV_HUGEPAGE"})
		err = r.Close()
	}
	if err = errors.Join(err, pinned.Unmap(mem)); err != nil {
		return err
	}
	if !baseline {
		return nil
	}
	sec, err = pinHostAllocTime(o, dev)
	if err != nil {
		return err
	}
	res.Ready = append(res.Ready, PinnedReady{Method: "cuMemHostAlloc", Seconds: sec, Note: "the baseline"})
	res.ReadyVsHostAlloc = def / sec
	return nil
}

// pinHostAllocTime times cuMemHostAlloc of the region's size: the baseline.
func pinHostAllocTime(o *PinnedOptions, dev *vmm.Device) (float64, error) {
	bar := begin(o.Progress, "cuMemHostAlloc", o.Size)
	bar.Update(0)
	t0 := time.Now()
	hb, err := dev.HostAlloc(o.Size, driver.HostAllocPortable|driver.HostAllocDeviceMap)
	sec := time.Since(t0).Seconds()
	bar.Done()
	if err != nil {
		return 0, err
	}
	return sec, hb.Close()
}

func pinFree(devs []*vmm.Device) ([]uint64, error) {
	out := make([]uint64, len(devs))
	for i, d := range devs {
		if err := d.Synchronize(); err != nil {
			return nil, err
		}
		var err error
		if out[i], _, err = d.MemInfo(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// pinFreeHeld is pinFree for the devices held, by ordinal; devices not held read 0 (a process
// without a context on a device adds nothing to it).
func pinFreeHeld(count int, held []*vmm.Device) ([]uint64, error) {
	free, err := pinFree(held)
	if err != nil {
		return nil, err
	}
	out := make([]uint64, count)
	for i, d := range held {
		out[d.Ordinal()] = free[i]
	}
	return out, nil
}

// pinWaitFree waits (up to 10 s) until every device has the free memory it had in idle again, less
// 2 MiB.
func pinWaitFree(devs []*vmm.Device, idle []uint64) {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		now, err := pinFree(devs)
		if err != nil {
			return
		}
		ok := true
		for i := range idle {
			if now[i]+2<<20 < idle[i] {
				ok = false
			}
		}
		if ok {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func pinSummarize(res *PinnedResult) {
	var naive, shared, cpu *PinnedModeResult
	for i := range res.Modes {
		switch res.Modes[i].Mode {
		case pinNaive:
			naive = &res.Modes[i]
		case pinShared:
			shared = &res.Modes[i]
		case pinCPUOnly:
			cpu = &res.Modes[i]
		}
	}
	if naive != nil && shared != nil {
		for i := range naive.PerDevice {
			if n := naive.PerDevice[i].OverheadBytes; n > 0 {
				res.SharedOverNaive = max(res.SharedOverNaive, float64(shared.PerDevice[i].OverheadBytes)/float64(n))
			}
		}
	}
	if cpu != nil {
		for _, pd := range cpu.PerDevice {
			res.CPUOnlyOverhead = max(res.CPUOnlyOverhead, pd.OverheadBytes)
		}
	}
}

func pinMiB(n int64) string { return fmt.Sprintf("%.2f MiB", float64(n)/float64(1<<20)) }

// Text writes the result for people.
func (r *PinnedResult) Text(w io.Writer) {
	fmt.Fprintf(w, "pinned region of %s shared by %d worker processes on devices %v (%s backend)\n",
		units.FormatSize(r.SizeBytes), r.Procs, r.WorkerDevices, r.Backend)
	fmt.Fprintln(w, "time to make the region ready in one process:")
	for _, rd := range r.Ready {
		fmt.Fprintf(w, "  %-15s %9.1f ms  %s\n", rd.Method, rd.Seconds*1e3, rd.Note)
	}
	if r.ReadyVsHostAlloc > 0 {
		fmt.Fprintf(w, "  default region / cuMemHostAlloc: %.3f\n", r.ReadyVsHostAlloc)
	}
	fmt.Fprintf(w, "GPU memory overhead while every worker holds the region (%s):\n", r.Measure)
	for _, m := range r.Modes {
		fmt.Fprintf(w, "  %-8s (%s region, creator %.1f ms, verified %s)\n", m.Mode, m.RegionKind, m.CreatorSeconds*1e3, yesNo(m.Verified))
		for _, pd := range m.PerDevice {
			fmt.Fprintf(w, "    device %d: %12s   expected %12s (2 MiB per GiB per process per device)\n",
				pd.Device, pinMiB(pd.OverheadBytes), pinMiB(int64(pd.ExpectedBytes)))
		}
	}
	fmt.Fprintf(w, "shared / naive overhead (worst device): %.3f; cpu-only overhead (worst device): %s\n",
		r.SharedOverNaive, pinMiB(r.CPUOnlyOverhead))
}
