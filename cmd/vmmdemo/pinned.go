package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/kernels"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

func init() {
	register(&command{
		name:    "pinned",
		summary: "N processes share one pinned region: GPU page-table overhead naive vs shared vs cpu-only; time to ready vs cuMemHostAlloc",
		run:     runPinned,
		tour:    []string{"--size", "64MiB", "--procs", "2"},
	})
	register(&command{
		name:    "pinned-worker",
		summary: "(internal) a worker process of `vmmdemo pinned`",
		run:     runPinnedWorker,
	})
}

// The modes of `vmmdemo pinned`.
const (
	pinNaive   = "naive"    // the creator makes a memfd; every worker registers it (visible to every GPU)
	pinShared  = "shared"   // the creator makes a CPU-only region; every worker grants its own GPU only
	pinCPUOnly = "cpu-only" // the creator makes a CPU-only region; workers map it for the CPU alone
)

var pinModes = []string{pinNaive, pinShared, pinCPUOnly}

// Messages between `vmmdemo pinned` and its workers (JSON payloads), on a socket pair whose worker
// end is the worker's file descriptor 3.
const (
	pinMsgReady   = ipc.KindUser + 0x40 // worker → parent: context up (pinWorkerReport)
	pinMsgOpen    = ipc.KindUser + 0x41 // parent → worker: pinOpenRequest; a pinned region follows
	pinMsgOpened  = ipc.KindUser + 0x42 // worker → parent: region open and checked (pinWorkerReport)
	pinMsgRelease = ipc.KindUser + 0x43 // parent → worker: close the region and exit
)

// pinWindow is a part of the region the creator fills with the pattern and the workers check.
type pinWindow struct {
	Offset uint64 `json:"offset"`
	Size   uint64 `json:"size"`
}

type pinOpenRequest struct {
	Mode    string      `json:"mode"`
	Grant   bool        `json:"grant"`
	Seed    uint64      `json:"seed"`
	Windows []pinWindow `json:"windows"`
}

type pinWorkerReport struct {
	Error       string   `json:"error,omitempty"`
	Device      int      `json:"device"`
	Free        []uint64 `json:"free,omitempty"` // per device, simulator only (its accounting is per process)
	OpenSeconds float64  `json:"open_seconds,omitempty"`
	Kind        string   `json:"kind,omitempty"`
	CPUBad      int      `json:"cpu_bad"`
	GPUBad      uint64   `json:"gpu_bad"`
	Estimate    []uint64 `json:"estimate,omitempty"` // the worker's region's PageTableCost
}

type pinDeviceOverhead struct {
	Device        int    `json:"device"`
	OverheadBytes int64  `json:"overhead_bytes"`
	ExpectedBytes uint64 `json:"expected_bytes"`
}

type pinModeResult struct {
	Mode              string              `json:"mode"`
	RegionKind        string              `json:"region_kind"`
	CreatorSeconds    float64             `json:"creator_seconds"`
	WorkerOpenSeconds []float64           `json:"worker_open_seconds"`
	PerDevice         []pinDeviceOverhead `json:"per_device"`
	Verified          bool                `json:"verified"`
}

type pinReady struct {
	Method  string  `json:"method"`
	Seconds float64 `json:"seconds"`
	Note    string  `json:"note,omitempty"`
}

type pinResult struct {
	Backend       string `json:"backend"`
	SizeBytes     uint64 `json:"size_bytes"`
	Procs         int    `json:"procs"`
	Devices       []int  `json:"devices"`
	WorkerDevices []int  `json:"worker_devices"`
	// WorkerContexts is "all" when every worker holds a context on every device, "own" when only on
	// its own device.
	WorkerContexts string `json:"worker_contexts"`
	// Ready: the time to make SIZE bytes usable by a GPU in one process, each way.
	Ready []pinReady `json:"ready"`
	// ReadyVsHostAlloc is the default region's ready time over cuMemHostAlloc's.
	ReadyVsHostAlloc float64         `json:"ready_vs_host_alloc"`
	Modes            []pinModeResult `json:"modes"`
	// SharedOverNaive is the largest, over devices, of shared's overhead over naive's.
	SharedOverNaive float64 `json:"shared_over_naive"`
	// CPUOnlyOverhead is the largest cpu-only overhead on any device (bytes).
	CPUOnlyOverhead int64  `json:"cpu_only_overhead_bytes"`
	Measure         string `json:"measure"`
}

// pinList is a flag.Value: a comma-separated list of ordinals, or "all".
type pinList struct {
	all bool
	ids []int
}

func (l *pinList) String() string {
	if l.all || l.ids == nil {
		return "all"
	}
	s := make([]string, len(l.ids))
	for i, v := range l.ids {
		s[i] = strconv.Itoa(v)
	}
	return strings.Join(s, ",")
}

func (l *pinList) Set(v string) error {
	l.all, l.ids = false, nil
	if strings.TrimSpace(v) == "all" {
		l.all = true
		return nil
	}
	for _, f := range strings.Split(v, ",") {
		o, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || o < 0 {
			return fmt.Errorf("device %q: want a non-negative ordinal", f)
		}
		l.ids = append(l.ids, o)
	}
	return nil
}

func runPinned(e *env, args []string) error {
	var c common
	fs := newFlags(e, "pinned")
	c.register(fs, 2)
	size := sizeFlag{v: 1 << 30}
	fs.Var(&size, "size", "region size")
	procs := fs.Int("procs", 4, "worker processes")
	var devList pinList
	fs.Var(&devList, "devices", "devices the workers use, round robin (comma-separated ordinals, or all)")
	modes := fs.String("modes", strings.Join(pinModes, ","), "modes to run: naive, shared, cpu-only")
	noBaseline := fs.Bool("no-baseline", false, "skip timing cuMemHostAlloc of the same size")
	workerContexts := fs.String("worker-contexts", "all", "devices each worker holds a context on: all (a worker that uses every GPU, as multi-GPU services do) or own (its device only, as with one visible GPU per worker); a registration costs page tables on every device where its process has a context")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *workerContexts != "all" && *workerContexts != "own" {
		return fmt.Errorf("--worker-contexts %q: want all or own: %w", *workerContexts, errUsage)
	}
	allContexts := *workerContexts == "all"
	if size.v == 0 || *procs < 1 {
		return fmt.Errorf("--size must be above 0 and --procs at least 1: %w", errUsage)
	}
	var runModes []string
	for _, m := range strings.Split(*modes, ",") {
		m = strings.TrimSpace(m)
		if m != pinNaive && m != pinShared && m != pinCPUOnly {
			return fmt.Errorf("--modes: unknown mode %q (want naive, shared, cpu-only): %w", m, errUsage)
		}
		runModes = append(runModes, m)
	}
	b, err := c.openLegacy(e)
	if err != nil {
		return err
	}
	defer b.Close()
	all, err := b.sys.Devices()
	if err != nil {
		return err
	}
	var devs []*vmm.Device
	if devList.all || devList.ids == nil {
		devs = all
	} else {
		for _, o := range devList.ids {
			d, err := b.sys.Device(o)
			if err != nil {
				return fmt.Errorf("--devices: %w", err)
			}
			devs = append(devs, d)
		}
	}
	res := &pinResult{Backend: b.name, SizeBytes: size.v, Procs: *procs, WorkerContexts: *workerContexts}
	for _, d := range devs {
		res.Devices = append(res.Devices, d.Ordinal())
	}
	for i := 0; i < *procs; i++ {
		res.WorkerDevices = append(res.WorkerDevices, devs[i%len(devs)].Ordinal())
	}
	res.Measure = "cuMemGetInfo free memory of each device after every worker's context is up, then while every worker holds the region; the difference is the overhead"
	if b.sim != nil {
		res.Measure += " (simulator: each process has its own simulated devices, so the figure sums the workers' own differences)"
	}
	if err := pinReadyTimes(e, b, devs[0], size.v, !*noBaseline, c.json, res); err != nil {
		return err
	}
	for _, m := range runModes {
		mr, err := pinRunMode(e, b, &c, m, size.v, res.WorkerDevices, all, allContexts)
		if err != nil {
			return fmt.Errorf("mode %s: %w", m, err)
		}
		res.Modes = append(res.Modes, *mr)
	}
	pinSummarize(res)
	if c.json {
		return writeJSON(e.stdout, res)
	}
	pinPrint(e, res)
	return nil
}

// pinReadyTimes times making size bytes usable by dev: the default region, a shared-memory region,
// and cuMemHostAlloc (the baseline).
func pinReadyTimes(e *env, b *backend, dev *vmm.Device, size uint64, baseline, jsonOut bool, res *pinResult) error {
	timeRegion := func(method, note string, opts pinned.Options) (float64, error) {
		bar := newProgress(e, "pinning "+method, size, jsonOut)
		opts.Progress = func(done, total uint64) { bar.Update(done) }
		t0 := time.Now()
		r, err := pinned.New(dev, size, opts)
		sec := time.Since(t0).Seconds()
		bar.Done()
		if err != nil {
			return 0, fmt.Errorf("%s region of %s: %w", method, units.FormatSize(size), err)
		}
		res.Ready = append(res.Ready, pinReady{Method: method, Seconds: sec, Note: note})
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
		res.Ready = append(res.Ready, pinReady{Method: "registered-thp", Seconds: time.Since(t0).Seconds(),
			Note: "pinned.Register of anonymous memory advised MADV_HUGEPAGE"})
		err = r.Close()
	}
	if err = errors.Join(err, pinned.Unmap(mem)); err != nil {
		return err
	}
	if baseline {
		bar := newProgress(e, "cuMemHostAlloc", size, jsonOut)
		bar.Update(0)
		t0 := time.Now()
		hb, err := dev.HostAlloc(size, driver.HostAllocPortable|driver.HostAllocDeviceMap)
		sec := time.Since(t0).Seconds()
		bar.Done()
		if err != nil {
			return err
		}
		res.Ready = append(res.Ready, pinReady{Method: "cuMemHostAlloc", Seconds: sec, Note: "the baseline"})
		if err := hb.Close(); err != nil {
			return err
		}
		res.ReadyVsHostAlloc = def / sec
	}
	return nil
}

// pinWorker is one worker process seen from the parent.
type pinWorker struct {
	cmd    *exec.Cmd
	conn   *net.UnixConn
	device int
	ready  pinWorkerReport
	opened pinWorkerReport
}

func pinWindows(size uint64) []pinWindow {
	w := min(size, 1<<20) &^ 7
	ws := []pinWindow{{0, w}}
	if size >= 2*w {
		ws = append(ws, pinWindow{(size - w) &^ 7, w})
	}
	return ws
}

func pinRunMode(e *env, b *backend, c *common, mode string, size uint64, workerDevs []int, all []*vmm.Device, allContexts bool) (res *pinModeResult, err error) {
	res = &pinModeResult{Mode: mode}
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	// Workers write to our stderr; exec copies through a goroutine per worker unless it is a file.
	out := &pinLockedWriter{w: e.stderr}
	var workers []*pinWorker
	idle, err := pinFree(all)
	if err != nil {
		return nil, err
	}
	defer func() {
		if len(workers) > 0 && b.sim == nil {
			// The workers' contexts are freed after they exit, not always before Wait returns:
			// let them go before the next mode takes its baseline.
			defer pinWaitFree(all, idle)
		}
		for _, w := range workers {
			w.conn.Close()
			if err != nil {
				_ = w.cmd.Process.Kill()
			}
			if werr := w.cmd.Wait(); werr != nil && err == nil {
				err = fmt.Errorf("worker on device %d: %w", w.device, werr)
			}
		}
	}()
	for _, dev := range workerDevs {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return nil, err
		}
		mine, theirs := os.NewFile(uintptr(fds[0]), "pinned-parent"), os.NewFile(uintptr(fds[1]), "pinned-worker")
		fc, err := net.FileConn(mine)
		mine.Close()
		if err != nil {
			theirs.Close()
			return nil, err
		}
		cmd := exec.Command(exe, "pinned-worker", "--backend", b.name, "--sim-devices", strconv.Itoa(c.simDevices), "--device", strconv.Itoa(dev),
			"--all-devices="+strconv.FormatBool(allContexts))
		if f, ok := e.stderr.(*os.File); ok {
			cmd.Stdout, cmd.Stderr = f, f
		} else {
			cmd.Stdout, cmd.Stderr = out, out
		}
		cmd.ExtraFiles = []*os.File{theirs}
		err = cmd.Start()
		theirs.Close()
		if err != nil {
			fc.Close()
			return nil, fmt.Errorf("start a worker: %w", err)
		}
		workers = append(workers, &pinWorker{cmd: cmd, conn: fc.(*net.UnixConn), device: dev})
	}
	for _, w := range workers {
		if err := pinRead(w.conn, pinMsgReady, &w.ready); err != nil {
			return nil, fmt.Errorf("worker on device %d: %w", w.device, err)
		}
	}
	// Every worker's context is up: this is the baseline.
	parentBefore, err := pinFree(all)
	if err != nil {
		return nil, err
	}

	// The creator.
	opts := pinned.Options{CPUOnly: true}
	if mode == pinNaive {
		opts.Kind = pinned.SharedMemory
	}
	t0 := time.Now()
	r, err := pinned.New(all[workerDevs[0]], size, opts)
	if err != nil {
		return nil, err
	}
	res.CreatorSeconds = time.Since(t0).Seconds()
	defer func() { err = errors.Join(err, r.Close()) }()
	res.RegionKind = r.Kind().String()
	const seed = 0x71
	req := pinOpenRequest{Mode: mode, Grant: mode != pinCPUOnly, Seed: seed, Windows: pinWindows(r.Len())}
	for _, win := range req.Windows {
		pinFillCPU(r.Bytes()[win.Offset:win.Offset+win.Size], win.Offset, seed)
	}
	payload, _ := json.Marshal(req)
	for _, w := range workers {
		if err := ipc.WriteMessage(w.conn, pinMsgOpen, payload, nil); err != nil {
			return nil, err
		}
		if err := r.Share(w.conn); err != nil {
			return nil, err
		}
	}
	bar := newProgress(e, "workers opening ("+mode+")", uint64(len(workers))*size, c.json)
	for i, w := range workers {
		if err := pinRead(w.conn, pinMsgOpened, &w.opened); err != nil {
			bar.Done()
			return nil, fmt.Errorf("worker on device %d: %w", w.device, err)
		}
		bar.Update(uint64(i+1) * size)
	}
	bar.Done()
	parentAfter, err := pinFree(all)
	if err != nil {
		return nil, err
	}

	res.Verified = true
	cost := pinned.PageTableCost(r.Len())
	for _, d := range all {
		o := d.Ordinal()
		pd := pinDeviceOverhead{Device: o}
		if b.sim == nil {
			// Free memory is device-wide on the real driver: the parent sees every process.
			pd.OverheadBytes = int64(parentBefore[o]) - int64(parentAfter[o])
		} else {
			// Each simulator counts its own process: add the workers' differences to the parent's.
			pd.OverheadBytes = int64(parentBefore[o]) - int64(parentAfter[o])
			for _, w := range workers {
				pd.OverheadBytes += int64(w.ready.Free[o]) - int64(w.opened.Free[o])
			}
		}
		for _, w := range workers {
			switch {
			case mode == pinNaive && (allContexts || w.device == o):
				pd.ExpectedBytes += cost // a registration is visible in every context of its process
			case mode == pinShared && w.device == o:
				pd.ExpectedBytes += cost
			}
		}
		res.PerDevice = append(res.PerDevice, pd)
	}
	for _, w := range workers {
		res.WorkerOpenSeconds = append(res.WorkerOpenSeconds, w.opened.OpenSeconds)
		if w.opened.CPUBad != 0 || w.opened.GPUBad != 0 {
			res.Verified = false
		}
	}
	for _, w := range workers {
		if err := ipc.WriteMessage(w.conn, pinMsgRelease, nil, nil); err != nil {
			return nil, err
		}
	}
	return res, nil
}

// pinLockedWriter serialises the writes of several workers' output copiers.
type pinLockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *pinLockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// pinRead reads one message of kind want into v, turning a worker's error report into an error.
func pinRead(conn *net.UnixConn, want uint16, v *pinWorkerReport) error {
	return readWorkerReport(conn, want, v, func() string { return v.Error })
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

func pinWords(b []byte) []uint64 {
	if len(b) < 8 {
		return nil
	}
	return unsafeWords(b)
}

func pinFillCPU(b []byte, off, seed uint64) {
	for i := range pinWords(b) {
		pinWords(b)[i] = kernels.Pattern(off/8+uint64(i), seed)
	}
}

func pinBadCPU(b []byte, off, seed uint64) int {
	n := 0
	for i, w := range pinWords(b) {
		if w != kernels.Pattern(off/8+uint64(i), seed) {
			n++
		}
	}
	return n
}

func pinSummarize(res *pinResult) {
	var naive, shared, cpu *pinModeResult
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

func pinPrint(e *env, r *pinResult) {
	w := e.stdout
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

// runPinnedWorker is one worker of `vmmdemo pinned`: it brings up its device's context, reports,
// opens the region the parent sends as the mode says, checks it, reports again and holds it until
// told to release it.
func runPinnedWorker(e *env, args []string) error {
	var c common
	fs := newFlags(e, "pinned-worker")
	c.register(fs, 1)
	device := fs.Int("device", 0, "the worker's device")
	allDevices := fs.Bool("all-devices", false, "hold a context on every device, not only the worker's")
	fd := fs.Int("fd", 3, "the socket to the parent")
	if err := parse(fs, args); err != nil {
		return err
	}
	conn, err := parentConn(*fd)
	if err != nil {
		return err
	}
	defer conn.Close()
	rep := pinWorkerReport{Device: *device}
	send := func(kind uint16, err error) error {
		if err != nil {
			rep.Error = err.Error()
		}
		payload, _ := json.Marshal(rep)
		if werr := ipc.WriteMessage(conn, kind, payload, nil); werr != nil && err == nil {
			err = werr
		}
		return err
	}
	b, err := c.openLegacy(e)
	if err != nil {
		return send(pinMsgReady, err)
	}
	defer b.Close()
	d, err := b.sys.Device(*device)
	if err == nil {
		err = d.LoadKernels() // now, so that the module's memory is in the baseline
	}
	// The devices this worker holds a context on: its own, or every one (which retains every
	// device's primary context).
	held := []*vmm.Device{d}
	if err == nil && *allDevices {
		held, err = b.sys.Devices()
	}
	if err == nil && b.sim != nil {
		rep.Free, err = pinFreeHeld(b.sys.DeviceCount(), held)
	}
	if err := send(pinMsgReady, err); err != nil {
		return err
	}

	var req pinOpenRequest
	if err := readJSONMessage(conn, pinMsgOpen, &req); err != nil {
		return err
	}
	opts := pinned.OpenOptions{}
	if req.Grant {
		opts.Grant = []*vmm.Device{d}
	}
	t0 := time.Now()
	r, err := pinned.Receive(conn, d, opts)
	rep.OpenSeconds = time.Since(t0).Seconds()
	if err != nil {
		return send(pinMsgOpened, err)
	}
	defer r.Close()
	rep.Kind = r.Kind().String()
	rep.Estimate = r.PageTableCost()
	for _, win := range req.Windows {
		if win.Offset+win.Size > r.Len() {
			return send(pinMsgOpened, fmt.Errorf("window %+v outside the %s region", win, units.FormatSize(r.Len())))
		}
		rep.CPUBad += pinBadCPU(r.Bytes()[win.Offset:win.Offset+win.Size], win.Offset, req.Seed)
		if req.Grant && win.Size > 0 {
			bad, err := d.Verify(r.Ptr()+driver.DevicePtr(win.Offset), win.Size, win.Offset, req.Seed)
			if err != nil {
				return send(pinMsgOpened, err)
			}
			rep.GPUBad += bad
		}
	}
	if b.sim != nil {
		if rep.Free, err = pinFreeHeld(b.sys.DeviceCount(), held); err != nil {
			return send(pinMsgOpened, err)
		}
	}
	if err := send(pinMsgOpened, nil); err != nil {
		return err
	}
	if k, _, _, err := ipc.ReadMessage(conn); err != nil || k != pinMsgRelease {
		return fmt.Errorf("waiting for release: kind %#x: %v", k, err)
	}
	return r.Close()
}

// unsafeWords views b (8-byte aligned, length at least 8) as 64-bit words.
func unsafeWords(b []byte) []uint64 { return unsafe.Slice((*uint64)(unsafe.Pointer(&b[0])), len(b)/8) }
