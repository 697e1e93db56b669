package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/kernels"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/pinned/broker"
	"github.com/cuvmm/cuvmm/vmm"
)

func init() {
	register(&command{
		name:    "broker",
		summary: "a pinned copy broker and N worker processes: bandwidth by request size vs raw pinned copies, round trip, GPU memory vs every worker mapping the region",
		run:     runBroker,
		tour:    []string{"--size", "64MiB", "--workers", "2", "--max-request", "16MiB"},
	})
	register(&command{
		name:    "broker-worker",
		summary: "(internal) a worker process of `vmmdemo broker`",
		run:     runBrokerWorker,
	})
}

// brokerSizes are the request sizes measured (those up to --max-request that fit a worker's window).
var brokerSizes = []uint64{1 << 20, 16 << 20, 256 << 20}

// Targets on the GPU host (the performance section).
const (
	brokerTargetLarge   = 0.95 // requests of 16 MiB and more, over raw pinned copies
	brokerTargetSmall   = 0.80 // 1 MiB requests
	brokerTargetRTTUS   = 30.0 // round trip beyond the copy
	brokerRTTBytes      = 4 << 10
	brokerVerifyPiece   = 16 << 20
	brokerSeedD2H       = 0xb1
	brokerSeedH2D       = 0xb2
	brokerMsgCmd        = ipc.KindUser + 0x70 // parent → worker: brokerCmd (JSON)
	brokerMsgReport     = ipc.KindUser + 0x71 // worker → parent: brokerReport (JSON)
	brokerDirH2D        = "h2d"
	brokerDirD2H        = "d2h"
	brokerCmdConnect    = "connect"
	brokerCmdNaiveOpen  = "naive-open"
	brokerCmdNaiveClose = "naive-close"
	brokerCmdVerify     = "verify"
	brokerCmdBandwidth  = "bandwidth"
	brokerCmdRTT        = "rtt"
	brokerCmdExit       = "exit"
)

type brokerCmd struct {
	Op           string `json:"op"`
	Socket       string `json:"socket,omitempty"`
	WindowOffset uint64 `json:"window_offset,omitempty"`
	WindowBytes  uint64 `json:"window_bytes,omitempty"`
	RequestBytes uint64 `json:"request_bytes,omitempty"`
	Direction    string `json:"direction,omitempty"`
	Bytes        uint64 `json:"bytes,omitempty"`
	Depth        int    `json:"depth,omitempty"`
	Samples      int    `json:"samples,omitempty"`
}

type brokerReport struct {
	Error string   `json:"error,omitempty"`
	Free  []uint64 `json:"free,omitempty"` // per device ordinal, simulator only (its accounting is per process)
	// connect
	GrantOffset uint64 `json:"grant_offset,omitempty"`
	GrantBytes  uint64 `json:"grant_bytes,omitempty"`
	BufferBytes uint64 `json:"buffer_bytes,omitempty"`
	// verify
	CPUBad uint64 `json:"cpu_bad"`
	GPUBad uint64 `json:"gpu_bad"`
	// bandwidth
	StartNS int64  `json:"start_ns,omitempty"`
	EndNS   int64  `json:"end_ns,omitempty"`
	Bytes   uint64 `json:"bytes,omitempty"`
	// rtt
	PingUS       float64 `json:"ping_us,omitempty"`
	RTTUS        float64 `json:"rtt_us,omitempty"`
	BrokerCopyUS float64 `json:"broker_copy_us,omitempty"`
}

type brokerBandwidth struct {
	RequestBytes   uint64    `json:"request_bytes"`
	Direction      string    `json:"direction"`
	BytesPerWorker uint64    `json:"bytes_per_worker"`
	PerWorkerGBs   []float64 `json:"per_worker_gbps"`
	AggregateGBs   float64   `json:"aggregate_gbps"`
	// Raw: this process copies the same bytes between the region and its own device memory, in
	// pieces of the same size queued back to back on one stream per device, every device at once.
	RawGBs          float64   `json:"raw_gbps"`
	RawPerDeviceGBs []float64 `json:"raw_per_device_gbps"`
	VsRaw           float64   `json:"vs_raw"`
	Target          float64   `json:"target"`
}

type brokerRoundTrip struct {
	RequestBytes   uint64    `json:"request_bytes"`
	Samples        int       `json:"samples"`
	PerWorkerRTTUS []float64 `json:"per_worker_rtt_us"`
	// RTTUS is the median over the workers of each one's median round trip of a synchronous copy
	// (Client.Copy), measured in the worker.
	RTTUS float64 `json:"rtt_us"`
	// PingUS is the protocol alone (no copy).
	PingUS float64 `json:"ping_us"`
	// CopyUS is the copy alone: the same copy done in this process (cuMemcpyHtoDAsync then
	// cuStreamSynchronize), median.
	CopyUS float64 `json:"copy_us"`
	// BrokerCopyUS is the broker's own time per request from queuing the copy to its completion.
	BrokerCopyUS float64 `json:"broker_copy_us"`
	// OverheadUS is RTTUS − CopyUS: what the broker adds to a copy.
	OverheadUS float64 `json:"overhead_us"`
	TargetUS   float64 `json:"target_us"`
}

type brokerDeviceMemory struct {
	Device          int `json:"device"`
	WorkersOnDevice int `json:"workers_on_device"`
	// BrokerBytes: free memory before the region existed less free memory with every worker
	// connected, its buffer registered and the region mapped for its CPU.
	BrokerBytes int64 `json:"broker_bytes"`
	// BrokerRegionBytes: the region and the broker's streams, before any worker connected.
	BrokerRegionBytes int64 `json:"broker_region_bytes"`
	// AddedByWorkersBytes: what connecting the N workers added (their CPU-only views, the broker's
	// imports of their buffers).
	AddedByWorkersBytes int64 `json:"added_by_workers_bytes"`
	// NaiveBytes: every worker mapping the region for its own GPU instead (the baseline).
	NaiveBytes          int64  `json:"naive_bytes"`
	ExpectedBrokerBytes uint64 `json:"expected_broker_bytes"`
	ExpectedNaiveBytes  uint64 `json:"expected_naive_bytes"`
}

type brokerMemory struct {
	Measure   string               `json:"measure"`
	PerDevice []brokerDeviceMemory `json:"per_device"`
}

type brokerTargets struct {
	// MinVsRaw16MiB is the lowest vs_raw of requests of 16 MiB and more (target ≥ 0.95);
	// MinVsRaw1MiB that of 1 MiB requests (target ≥ 0.8); OverheadUS the round-trip overhead
	// (target ≤ 30 µs). Met is meaningful on the GPU only (GPUFigures).
	MinVsRaw16MiB float64 `json:"min_vs_raw_16mib_and_up"`
	MinVsRaw1MiB  float64 `json:"min_vs_raw_1mib"`
	OverheadUS    float64 `json:"overhead_us"`
	// BrokerSameForAnyN: the broker's GPU memory did not grow with the workers (added_by_workers
	// within 2 MiB on every device).
	BrokerSameForAnyN bool `json:"broker_overhead_independent_of_workers"`
	Met               bool `json:"met"`
	GPUFigures        bool `json:"gpu_figures"`
}

type brokerResult struct {
	Backend          string            `json:"backend"`
	RegionBytes      uint64            `json:"region_bytes"`
	RegionKind       string            `json:"region_kind"`
	RegionSeconds    float64           `json:"region_seconds"`
	Workers          int               `json:"workers"`
	WorkerPIDs       []int             `json:"worker_pids"`
	Devices          []int             `json:"devices"`
	WorkerDevices    []int             `json:"worker_devices"`
	WindowBytes      uint64            `json:"window_bytes"`
	BufferBytes      uint64            `json:"buffer_bytes"`
	StreamsPerDevice int               `json:"streams_per_device"`
	Depth            int               `json:"requests_in_flight_per_worker"`
	Verified         bool              `json:"verified"`
	MismatchedWords  uint64            `json:"mismatched_words"`
	Bandwidth        []brokerBandwidth `json:"bandwidth"`
	RoundTrip        brokerRoundTrip   `json:"round_trip"`
	GPUMemory        brokerMemory      `json:"gpu_memory"`
	Targets          brokerTargets     `json:"targets"`
	Timing           string            `json:"timing"`
	Notes            []string          `json:"notes,omitempty"`
}

// brokerWorkerProc is one worker process seen from the parent.
type brokerWorkerProc struct {
	cmd    *exec.Cmd
	conn   *net.UnixConn
	device int
	offset uint64 // its window
	ready  brokerReport
	last   brokerReport
}

func runBroker(e *env, args []string) (err error) {
	var c common
	fs := newFlags(e, "broker")
	c.register(fs, 2)
	size := sizeFlag{v: 1 << 30}
	fs.Var(&size, "size", "the broker's pinned region")
	workers := fs.Int("workers", 4, "worker processes")
	var devList pinList
	fs.Var(&devList, "devices", "devices the broker serves and the workers use, round robin (comma-separated ordinals, or all)")
	maxReq := sizeFlag{v: 256 << 20}
	fs.Var(&maxReq, "max-request", "largest request size measured (of 1MiB, 16MiB, 256MiB)")
	var perWorker sizeFlag
	fs.Var(&perWorker, "bytes", "bytes each worker moves per request size and direction (default 2GiB on a GPU, 64MiB on the simulator; at least 4 requests)")
	depth := fs.Int("depth", 8, "requests each worker keeps in flight")
	streams := fs.Int("streams", 4, "copy streams per device in the broker")
	samples := fs.Int("rtt-samples", 200, "round trips timed per worker")
	if err := parse(fs, args); err != nil {
		return err
	}
	if size.v == 0 || *workers < 1 || *depth < 1 || *streams < 1 || *samples < 1 {
		return fmt.Errorf("--size must be above 0; --workers, --depth, --streams and --rtt-samples at least 1: %w", errUsage)
	}
	b, err := c.openLegacy(e)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, b.Close()) }()
	var devs []*vmm.Device
	if devList.all || devList.ids == nil {
		if devs, err = b.sys.Devices(); err != nil {
			return err
		}
	} else {
		for _, o := range devList.ids {
			d, err := b.sys.Device(o)
			if err != nil {
				return fmt.Errorf("--devices: %w", err)
			}
			devs = append(devs, d)
		}
	}
	if perWorker.v == 0 {
		perWorker.v = 2 << 30
		if b.sim != nil {
			perWorker.v = 64 << 20
		}
	}
	g, err := devs[0].DeviceGranularity()
	if err != nil {
		return err
	}
	// The region's size as pinned.New will round it, split into one window per worker.
	regionLen, _ := units.RoundUp(size.v, g)
	window := regionLen / uint64(*workers) / g * g
	var sizes []uint64
	for _, s := range brokerSizes {
		if s <= maxReq.v && s <= window {
			sizes = append(sizes, s)
		}
	}
	if len(sizes) == 0 {
		return fmt.Errorf("--size %s over %d workers leaves windows of %s: need at least 1MiB each, and --max-request at least 1MiB: %w",
			units.FormatSize(size.v), *workers, units.FormatSize(window), errUsage)
	}
	bufSize, _ := units.RoundUp(sizes[len(sizes)-1], g)

	res := &brokerResult{Backend: b.name, Workers: *workers, WindowBytes: window, BufferBytes: bufSize,
		StreamsPerDevice: *streams, Depth: *depth, Verified: true,
		Timing: "wall clock: each worker times its own requests; aggregate = all bytes / (last end − first start); raw = this process, same request size, one stream per device, every device at once"}
	if b.sim != nil {
		res.Timing += " (simulator: Go memory copies, not GPU figures)"
	}
	for _, d := range devs {
		res.Devices = append(res.Devices, d.Ordinal())
	}

	// The workers: each brings up its context and its device buffer first, so that the memory
	// measured below is only the region's.
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	out := &pinLockedWriter{w: e.stderr}
	var procs []*brokerWorkerProc
	// stopWorkers tells the workers to exit (or, after a failure, kills them) and reaps them. It runs
	// before the server closes on success, so that the workers leave on their own.
	stopWorkers := func(failed bool) error {
		var errs []error
		for _, w := range procs {
			if !failed {
				_ = brokerSend(w.conn, brokerCmd{Op: brokerCmdExit})
			}
			w.conn.Close()
			if failed {
				_ = w.cmd.Process.Kill()
			}
			if werr := w.cmd.Wait(); werr != nil && !failed {
				errs = append(errs, fmt.Errorf("worker %d: %w", w.cmd.Process.Pid, werr))
			}
		}
		procs = nil
		return errors.Join(errs...)
	}
	defer func() { err = errors.Join(err, stopWorkers(err != nil)) }()
	for i := 0; i < *workers; i++ {
		d := devs[i%len(devs)].Ordinal()
		w, err := brokerStartWorker(e, out, exe, b, &c, d, bufSize)
		if err != nil {
			return err
		}
		w.offset = uint64(i) * window
		procs = append(procs, w)
		res.WorkerDevices = append(res.WorkerDevices, d)
		res.WorkerPIDs = append(res.WorkerPIDs, w.cmd.Process.Pid)
	}
	for _, w := range procs {
		if err := brokerRead(w.conn, &w.ready); err != nil {
			return fmt.Errorf("worker %d: %w", w.cmd.Process.Pid, err)
		}
	}
	count := b.sys.DeviceCount()
	free0, err := pinFreeHeld(count, devs)
	if err != nil {
		return err
	}

	// The broker: the region, made visible to the served devices once, and the server.
	bar := newProgress(e, "pinning the region", size.v, c.json)
	t0 := time.Now()
	region, err := pinned.New(devs[0], size.v, pinned.Options{Grant: devs, Progress: func(done, total uint64) { bar.Update(done) }})
	bar.Done()
	if err != nil {
		return err
	}
	res.RegionSeconds = time.Since(t0).Seconds()
	defer func() { err = errors.Join(err, region.Close()) }()
	res.RegionBytes, res.RegionKind = region.Len(), region.Kind().String()
	windows := map[int32]uint64{}
	for _, w := range procs {
		windows[int32(w.cmd.Process.Pid)] = w.offset
	}
	dir, err := os.MkdirTemp("", "vmmdemo-broker-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	srv, err := broker.NewServer(region, filepath.Join(dir, "broker.sock"), broker.Options{Devices: devs, StreamsPerDevice: *streams,
		Grant: func(peer unix.Ucred) (broker.Grant, error) {
			off, ok := windows[peer.Pid]
			if !ok {
				return broker.Grant{}, fmt.Errorf("pid %d is not one of the demo's workers", peer.Pid)
			}
			// The demo's workers map the whole region to check the bytes with their CPUs.
			return broker.Grant{Offset: off, Length: window, ShareRegion: true}, nil
		}})
	if err != nil {
		return err
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve() }()
	defer func() { err = errors.Join(err, srv.Close(), <-served) }()
	free1, err := pinFreeHeld(count, devs)
	if err != nil {
		return err
	}

	// Every worker connects, maps the region for its CPU and registers its buffer.
	if err := brokerAll(procs, func(w *brokerWorkerProc) brokerCmd {
		return brokerCmd{Op: brokerCmdConnect, Socket: srv.Path(), WindowOffset: w.offset, WindowBytes: window}
	}); err != nil {
		return err
	}
	connected := make([]brokerReport, len(procs))
	for i, w := range procs {
		connected[i] = w.last
		if w.last.GrantOffset != w.offset || w.last.GrantBytes != window {
			return fmt.Errorf("worker %d was granted %s at %#x, want %s at %#x", i, units.FormatSize(w.last.GrantBytes), w.last.GrantOffset, units.FormatSize(window), w.offset)
		}
	}
	free2, err := pinFreeHeld(count, devs)
	if err != nil {
		return err
	}
	// The baseline: every worker maps the region for its own GPU, as it would without a broker.
	if err := brokerAll(procs, func(*brokerWorkerProc) brokerCmd { return brokerCmd{Op: brokerCmdNaiveOpen} }); err != nil {
		return err
	}
	naive := make([]brokerReport, len(procs))
	for i, w := range procs {
		naive[i] = w.last
	}
	free3, err := pinFreeHeld(count, devs)
	if err != nil {
		return err
	}
	if err := brokerAll(procs, func(*brokerWorkerProc) brokerCmd { return brokerCmd{Op: brokerCmdNaiveClose} }); err != nil {
		return err
	}
	brokerMemoryResult(res, b, devs, procs, region.Len(), free0, free1, free2, free3, connected, naive)

	// Both ways, verified: by each worker (its device with a kernel, the region with its CPU) and
	// here (the region with this process's CPU).
	if err := brokerAll(procs, func(*brokerWorkerProc) brokerCmd { return brokerCmd{Op: brokerCmdVerify} }); err != nil {
		return err
	}
	for i, w := range procs {
		n := min(bufSize, window)
		here := brokerBadWords(region.Bytes()[w.offset:w.offset+n], brokerSeedH2D)
		if bad := w.last.CPUBad + w.last.GPUBad + here; bad != 0 {
			res.Verified = false
			res.MismatchedWords += bad
			res.Notes = append(res.Notes, fmt.Sprintf("worker %d: %d words wrong in the region after the device→host copies (its CPU), %d on its device after the host→device copies, %d in the region as the broker's CPU sees it",
				i, w.last.CPUBad, w.last.GPUBad, here))
		}
	}

	// Bandwidth: raw in this process, then the workers through the broker, size by size.
	phases := uint64(len(sizes) * 2)
	pbar := newProgress(e, "bandwidth", phases, c.json)
	for _, s := range sizes {
		for _, d := range []string{brokerDirH2D, brokerDirD2H} {
			bytes := max(perWorker.v/s, 4) * s
			bw := brokerBandwidth{RequestBytes: s, Direction: d, BytesPerWorker: bytes, Target: brokerTargetLarge}
			if s < 16<<20 {
				bw.Target = brokerTargetSmall
			}
			if err := brokerAll(procs, func(*brokerWorkerProc) brokerCmd {
				return brokerCmd{Op: brokerCmdBandwidth, RequestBytes: s, Direction: d, Bytes: bytes, Depth: *depth}
			}); err != nil {
				pbar.Done()
				return err
			}
			// Raw after the broker: both then find the region's pages in place.
			var err error
			if bw.RawGBs, bw.RawPerDeviceGBs, err = brokerRaw(region, devs, res.WorkerDevices, s, d, bytes, bufSize); err != nil {
				pbar.Done()
				return fmt.Errorf("raw %s %s: %w", units.FormatSize(s), d, err)
			}
			var first, last int64
			var total uint64
			for i, w := range procs {
				r := w.last
				bw.PerWorkerGBs = append(bw.PerWorkerGBs, float64(r.Bytes)/float64(max(r.EndNS-r.StartNS, 1)))
				if i == 0 || r.StartNS < first {
					first = r.StartNS
				}
				last = max(last, r.EndNS)
				total += r.Bytes
			}
			bw.AggregateGBs = float64(total) / float64(max(last-first, 1))
			if bw.RawGBs > 0 {
				bw.VsRaw = bw.AggregateGBs / bw.RawGBs
			}
			res.Bandwidth = append(res.Bandwidth, bw)
			pbar.Update(uint64(len(res.Bandwidth)))
		}
	}
	pbar.Done()

	// Round trip: one worker at a time, then the copy alone in this process.
	rt := brokerRoundTrip{RequestBytes: brokerRTTBytes, Samples: *samples, TargetUS: brokerTargetRTTUS}
	var pings, brokerCopies []float64
	for _, w := range procs {
		if err := brokerSend(w.conn, brokerCmd{Op: brokerCmdRTT, Samples: *samples}); err != nil {
			return err
		}
		if err := brokerRead(w.conn, &w.last); err != nil {
			return fmt.Errorf("worker %d: %w", w.cmd.Process.Pid, err)
		}
		rt.PerWorkerRTTUS = append(rt.PerWorkerRTTUS, w.last.RTTUS)
		pings = append(pings, w.last.PingUS)
		brokerCopies = append(brokerCopies, w.last.BrokerCopyUS)
	}
	rt.RTTUS, rt.PingUS, rt.BrokerCopyUS = brokerMedian(rt.PerWorkerRTTUS), brokerMedian(pings), brokerMedian(brokerCopies)
	if rt.CopyUS, err = brokerRawCopyUS(region, devs[0], *samples); err != nil {
		return err
	}
	rt.OverheadUS = rt.RTTUS - rt.CopyUS
	res.RoundTrip = rt

	if err := stopWorkers(false); err != nil {
		return err
	}
	brokerSummarize(res, b.sim == nil)
	if b.sim != nil {
		res.Notes = append(res.Notes, "simulator: bandwidth and times are of Go memory copies and sockets on this machine; GPU memory is the simulator's accounting (each process counts its own, summed here)")
	}
	if c.json {
		return writeJSON(e.stdout, res)
	}
	brokerPrint(e, res)
	return nil
}

func brokerStartWorker(e *env, out *pinLockedWriter, exe string, b *backend, c *common, device int, bufSize uint64) (*brokerWorkerProc, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "broker-parent"), os.NewFile(uintptr(fds[1]), "broker-worker")
	fc, err := net.FileConn(mine)
	mine.Close()
	if err != nil {
		theirs.Close()
		return nil, err
	}
	cmd := exec.Command(exe, "broker-worker", "--backend", b.name, "--sim-devices", strconv.Itoa(c.simDevices),
		"--device", strconv.Itoa(device), "--buffer", strconv.FormatUint(bufSize, 10))
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
	return &brokerWorkerProc{cmd: cmd, conn: fc.(*net.UnixConn), device: device}, nil
}

func brokerSend(conn *net.UnixConn, cmd brokerCmd) error {
	payload, _ := json.Marshal(cmd)
	return ipc.WriteMessage(conn, brokerMsgCmd, payload, nil)
}

// brokerRead reads one report, turning a worker's error into an error.
func brokerRead(conn *net.UnixConn, r *brokerReport) error {
	*r = brokerReport{}
	return readWorkerReport(conn, brokerMsgReport, r, func() string { return r.Error })
}

// brokerAll sends every worker its command at once and collects the reports into w.last.
func brokerAll(procs []*brokerWorkerProc, cmd func(*brokerWorkerProc) brokerCmd) error {
	for _, w := range procs {
		if err := brokerSend(w.conn, cmd(w)); err != nil {
			return fmt.Errorf("worker %d: %w", w.cmd.Process.Pid, err)
		}
	}
	for _, w := range procs {
		if err := brokerRead(w.conn, &w.last); err != nil {
			return fmt.Errorf("worker %d: %w", w.cmd.Process.Pid, err)
		}
	}
	return nil
}

func brokerMemoryResult(res *brokerResult, b *backend, devs []*vmm.Device, procs []*brokerWorkerProc, regionLen uint64,
	free0, free1, free2, free3 []uint64, connected, naive []brokerReport) {
	cost := pinned.PageTableCost(regionLen)
	res.GPUMemory.Measure = "cuMemGetInfo free memory of each device: with every worker's context and buffer up (before the region), after the region and the server, with every worker connected (CPU-only view, buffer registered), and with every worker mapping the region for its own GPU"
	if b.sim != nil {
		res.GPUMemory.Measure += " (simulator: each process counts its own devices; the workers' differences are added to the broker's)"
	}
	sum := func(reps []brokerReport, base func(i int) []uint64, o int) int64 {
		var n int64
		if b.sim == nil {
			return 0
		}
		for i, r := range reps {
			if o < len(r.Free) && o < len(base(i)) {
				n += int64(base(i)[o]) - int64(r.Free[o])
			}
		}
		return n
	}
	for _, d := range devs {
		o := d.Ordinal()
		m := brokerDeviceMemory{Device: o, ExpectedBrokerBytes: cost}
		for _, w := range procs {
			if w.device == o {
				m.WorkersOnDevice++
			}
		}
		m.BrokerRegionBytes = int64(free0[o]) - int64(free1[o])
		m.AddedByWorkersBytes = int64(free1[o]) - int64(free2[o]) + sum(connected, func(i int) []uint64 { return procs[i].ready.Free }, o)
		m.BrokerBytes = m.BrokerRegionBytes + m.AddedByWorkersBytes
		m.NaiveBytes = int64(free2[o]) - int64(free3[o]) + sum(naive, func(i int) []uint64 { return connected[i].Free }, o)
		// A host-NUMA mapping costs the device granted; a registration every device the worker
		// holds a context on, which is its own here. Either way: one region per worker on its device.
		m.ExpectedNaiveBytes = uint64(m.WorkersOnDevice) * cost
		res.GPUMemory.PerDevice = append(res.GPUMemory.PerDevice, m)
	}
}

// brokerRaw measures the raw pinned copy bandwidth at request size s: this process copies, on every
// device in use at once, as many bytes as that device's workers move through the broker, in pieces of
// s queued back to back on one stream, from (or into) the region.
func brokerRaw(region *pinned.Region, devs []*vmm.Device, workerDevs []int, s uint64, dir string, perWorker, bufSize uint64) (float64, []float64, error) {
	type result struct {
		start, end time.Time
		bytes      uint64
		err        error
	}
	results := make([]result, len(devs))
	var wg sync.WaitGroup
	for i, d := range devs {
		n := 0
		for _, o := range workerDevs {
			if o == d.Ordinal() {
				n++
			}
		}
		if n == 0 {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := &results[i]
			r.err = func() (err error) {
				// Device memory made like the workers' buffers: one VMM allocation, mapped.
				res, err := d.System().Reserve(bufSize, vmm.ReserveOptions{})
				if err != nil {
					return err
				}
				defer func() { err = errors.Join(err, res.Close()) }()
				buf, err := res.MapNew(0, bufSize, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
				if err != nil {
					return err
				}
				defer func() { err = errors.Join(err, buf.Close()) }()
				st, err := d.NewStream(true)
				if err != nil {
					return err
				}
				defer func() { err = errors.Join(err, st.Close()) }()
				count := perWorker / s * uint64(n)
				hostSlots, bufSlots := region.Len()/s, bufSize/s
				queue := func(k uint64) error {
					host, dev := (k%hostSlots)*s, buf.Ptr()+driver.DevicePtr((k%bufSlots)*s)
					if dir == brokerDirH2D {
						return region.CopyToDevice(st, dev, host, s)
					}
					return region.CopyFromDevice(st, dev, host, s)
				}
				// Untimed: one pass over the device buffer, so that first-touch costs are not timed.
				for k := uint64(0); k < bufSlots; k++ {
					if err := queue(k); err != nil {
						return err
					}
				}
				if err := st.Synchronize(); err != nil {
					return err
				}
				r.start = time.Now()
				for k := uint64(0); k < count; k++ {
					if err := queue(k); err != nil {
						return err
					}
				}
				err = st.Synchronize()
				r.end, r.bytes = time.Now(), count*s
				return err
			}()
		}()
	}
	wg.Wait()
	var first, last time.Time
	var total uint64
	var per []float64
	for i := range devs {
		r := results[i]
		if r.err != nil {
			return 0, nil, r.err
		}
		if r.bytes == 0 {
			per = append(per, 0)
			continue
		}
		per = append(per, float64(r.bytes)/float64(max(r.end.Sub(r.start).Nanoseconds(), 1)))
		if first.IsZero() || r.start.Before(first) {
			first = r.start
		}
		if r.end.After(last) {
			last = r.end
		}
		total += r.bytes
	}
	return float64(total) / float64(max(last.Sub(first).Nanoseconds(), 1)), per, nil
}

// brokerRawCopyUS is the copy alone: a 4 KiB copy from the region into device memory and its
// stream's completion, in this process, median of samples.
func brokerRawCopyUS(region *pinned.Region, d *vmm.Device, samples int) (us float64, err error) {
	buf, err := d.AllocPlain(brokerRTTBytes)
	if err != nil {
		return 0, err
	}
	defer func() { err = errors.Join(err, buf.Close()) }()
	st, err := d.NewStream(true)
	if err != nil {
		return 0, err
	}
	defer func() { err = errors.Join(err, st.Close()) }()
	times := make([]float64, 0, samples)
	for i := 0; i < samples+10; i++ {
		t0 := time.Now()
		if err := region.CopyToDevice(st, buf.Ptr(), 0, brokerRTTBytes); err != nil {
			return 0, err
		}
		if err := st.Synchronize(); err != nil {
			return 0, err
		}
		if i >= 10 {
			times = append(times, float64(time.Since(t0).Nanoseconds())/1e3)
		}
	}
	return brokerMedian(times), nil
}

func brokerMedian(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[len(s)/2]
}

func brokerBadWords(b []byte, seed uint64) uint64 {
	var n uint64
	for i, w := range unsafeWords(b) {
		if w != kernels.Pattern(uint64(i), seed) {
			n++
		}
	}
	return n
}

func brokerSummarize(res *brokerResult, gpu bool) {
	t := &res.Targets
	t.GPUFigures = gpu
	t.MinVsRaw16MiB, t.MinVsRaw1MiB = -1, -1
	for _, bw := range res.Bandwidth {
		if bw.RequestBytes >= 16<<20 && (t.MinVsRaw16MiB < 0 || bw.VsRaw < t.MinVsRaw16MiB) {
			t.MinVsRaw16MiB = bw.VsRaw
		}
		if bw.RequestBytes == 1<<20 && (t.MinVsRaw1MiB < 0 || bw.VsRaw < t.MinVsRaw1MiB) {
			t.MinVsRaw1MiB = bw.VsRaw
		}
	}
	t.OverheadUS = res.RoundTrip.OverheadUS
	t.BrokerSameForAnyN = true
	for _, m := range res.GPUMemory.PerDevice {
		if m.AddedByWorkersBytes > 2<<20 || m.AddedByWorkersBytes < -(2<<20) {
			t.BrokerSameForAnyN = false
		}
	}
	t.Met = res.Verified && t.BrokerSameForAnyN && t.OverheadUS <= brokerTargetRTTUS &&
		(t.MinVsRaw16MiB < 0 || t.MinVsRaw16MiB >= brokerTargetLarge) && (t.MinVsRaw1MiB < 0 || t.MinVsRaw1MiB >= brokerTargetSmall)
}

func brokerPrint(e *env, r *brokerResult) {
	w := e.stdout
	fmt.Fprintf(w, "copy broker: %s %s region (pinned in %.1f ms), %d worker processes on devices %v, %s windows, %s device buffers (%s backend)\n",
		units.FormatSize(r.RegionBytes), r.RegionKind, r.RegionSeconds*1e3, r.Workers, r.WorkerDevices, units.FormatSize(r.WindowBytes), units.FormatSize(r.BufferBytes), r.Backend)
	fmt.Fprintf(w, "timing: %s\n", r.Timing)
	fmt.Fprintf(w, "\nbandwidth, %d requests in flight per worker, %d streams per device:\n", r.Depth, r.StreamsPerDevice)
	fmt.Fprintf(w, "  %-8s %-4s %12s %12s %8s %8s   per worker GB/s\n", "request", "dir", "aggregate", "raw", "× raw", "target")
	for _, bw := range r.Bandwidth {
		fmt.Fprintf(w, "  %-8s %-4s %9.1f GB/s %7.1f GB/s %8.3f %8.2f  ", units.FormatSize(bw.RequestBytes), bw.Direction, bw.AggregateGBs, bw.RawGBs, bw.VsRaw, bw.Target)
		for _, g := range bw.PerWorkerGBs {
			fmt.Fprintf(w, " %.1f", g)
		}
		fmt.Fprintln(w)
	}
	rt := r.RoundTrip
	fmt.Fprintf(w, "\nround trip of a %s copy (median of %d per worker): %.1f µs; the copy alone %.1f µs (the broker's own view %.1f µs); overhead %.1f µs (target ≤ %.0f); ping %.1f µs\n",
		units.FormatSize(rt.RequestBytes), rt.Samples, rt.RTTUS, rt.CopyUS, rt.BrokerCopyUS, rt.OverheadUS, rt.TargetUS, rt.PingUS)
	fmt.Fprintf(w, "\nGPU memory per device (%s):\n", r.GPUMemory.Measure)
	for _, m := range r.GPUMemory.PerDevice {
		fmt.Fprintf(w, "  device %d (%d workers): broker %s (region %s, workers added %s; expected %s)   each worker mapping the region: %s (expected %s)\n",
			m.Device, m.WorkersOnDevice, pinMiB(m.BrokerBytes), pinMiB(m.BrokerRegionBytes), pinMiB(m.AddedByWorkersBytes), pinMiB(int64(m.ExpectedBrokerBytes)),
			pinMiB(m.NaiveBytes), pinMiB(int64(m.ExpectedNaiveBytes)))
	}
	t := r.Targets
	fmt.Fprintf(w, "\ndata verified both ways: %s\n", yesNo(r.Verified))
	verdict := map[bool]string{true: "met", false: "not met"}[t.Met]
	if !t.GPUFigures {
		verdict = "the targets are for GPU figures; these are the simulator's"
	}
	fmt.Fprintf(w, "targets: ≥16 MiB × raw %.3f (≥ %.2f), 1 MiB × raw %.3f (≥ %.2f), overhead %.1f µs (≤ %.0f), broker memory independent of workers %s: %s\n",
		t.MinVsRaw16MiB, brokerTargetLarge, t.MinVsRaw1MiB, brokerTargetSmall, t.OverheadUS, brokerTargetRTTUS, yesNo(t.BrokerSameForAnyN), verdict)
	for _, n := range r.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
}

// runBrokerWorker is one worker of `vmmdemo broker`: it brings up its device and a device buffer,
// reports, then follows the parent's commands (on descriptor 3) until told to exit.
func runBrokerWorker(e *env, args []string) error {
	var c common
	fs := newFlags(e, "broker-worker")
	c.register(fs, 1)
	device := fs.Int("device", 0, "the worker's device")
	bufSize := fs.Uint64("buffer", 16<<20, "the device buffer's size (a multiple of the granularity)")
	fd := fs.Int("fd", 3, "the socket to the parent")
	if err := parse(fs, args); err != nil {
		return err
	}
	ctl, err := parentConn(*fd)
	if err != nil {
		return err
	}
	defer ctl.Close()
	w := &brokerWorker{sim: c.backend == "sim"}
	rep := brokerReport{}
	report := func(err error) error {
		if err != nil {
			rep.Error = err.Error()
		}
		payload, _ := json.Marshal(rep)
		if werr := ipc.WriteMessage(ctl, brokerMsgReport, payload, nil); werr != nil && err == nil {
			err = werr
		}
		return err
	}
	b, err := c.openLegacy(e)
	if err != nil {
		return report(err)
	}
	defer b.Close()
	defer w.close()
	if err := w.setup(b, *device, *bufSize); err != nil {
		return report(err)
	}
	rep.Free = w.free()
	if err := report(nil); err != nil {
		return err
	}
	for {
		var cmd brokerCmd
		if err := readJSONMessage(ctl, brokerMsgCmd, &cmd); err != nil {
			return err
		}
		if cmd.Op == brokerCmdExit {
			return w.close()
		}
		rep = brokerReport{}
		if err := report(w.do(cmd, &rep)); err != nil {
			return err
		}
	}
}

// brokerWorker is a worker's state.
type brokerWorker struct {
	sim    bool
	dev    *vmm.Device
	res    *vmm.Reservation
	bufLen uint64
	client *broker.Client
	buf    *broker.Buffer
	view   *pinned.Region // CPU only
	naive  *pinned.Region // granted to the worker's GPU
	winOff uint64
	winLen uint64
}

func (w *brokerWorker) setup(b *backend, device int, size uint64) error {
	d, err := b.sys.Device(device)
	if err != nil {
		return err
	}
	w.dev = d
	if err := d.LoadKernels(); err != nil { // now, so that the module's memory is in the baseline
		return err
	}
	if w.res, err = b.sys.Reserve(size, vmm.ReserveOptions{}); err != nil {
		return err
	}
	if _, err := w.res.MapNew(0, size, d, vmm.AllocOptions{HandleTypes: driver.HandleTypePosixFD}, vmm.ReadWrite(d)); err != nil {
		return err
	}
	w.bufLen = size
	return nil
}

// free is this process's free memory per device ordinal on the simulator (nil on a GPU, where the
// parent sees every process).
func (w *brokerWorker) free() []uint64 {
	if !w.sim {
		return nil
	}
	all, err := w.dev.System().Devices()
	if err != nil {
		return nil
	}
	var held []*vmm.Device
	for _, d := range all {
		if d == w.dev {
			held = append(held, d)
		}
	}
	f, err := pinFreeHeld(len(all), held)
	if err != nil {
		return nil
	}
	return f
}

func (w *brokerWorker) close() error {
	var errs []error
	if w.naive != nil {
		errs = append(errs, w.naive.Close())
		w.naive = nil
	}
	if w.view != nil {
		errs = append(errs, w.view.Close())
		w.view = nil
	}
	if w.client != nil {
		errs = append(errs, w.client.Close()) // the broker drops the buffer with the connection
		w.client = nil
	}
	if w.res != nil {
		for _, m := range w.res.Mappings() {
			errs = append(errs, m.Close())
		}
		errs = append(errs, w.res.Close())
		w.res = nil
	}
	return errors.Join(errs...)
}

func (w *brokerWorker) do(cmd brokerCmd, rep *brokerReport) error {
	ctx := context.Background()
	switch cmd.Op {
	case brokerCmdConnect:
		c, err := broker.Dial(cmd.Socket)
		if err != nil {
			return err
		}
		w.client = c
		g := c.Info().Grant
		rep.GrantOffset, rep.GrantBytes = g.Offset, g.Length
		w.winOff, w.winLen = g.Offset, g.Length
		if w.view, err = c.Region(ctx, w.dev, pinned.OpenOptions{}); err != nil {
			return err
		}
		if w.buf, err = c.Register(ctx, ipc.FromReservation(w.res)); err != nil {
			return err
		}
		rep.BufferBytes = w.buf.Len()
		rep.Free = w.free()
		return nil

	case brokerCmdNaiveOpen:
		var err error
		if w.naive, err = w.client.Region(ctx, w.dev, pinned.OpenOptions{Grant: []*vmm.Device{w.dev}}); err != nil {
			return err
		}
		rep.Free = w.free()
		return nil

	case brokerCmdNaiveClose:
		err := w.naive.Close()
		w.naive = nil
		return err

	case brokerCmdVerify:
		n := min(w.bufLen, w.winLen)
		ptr := w.res.Ptr()
		// Device → host: the GPU writes the pattern, the broker copies it into the window, this
		// process's CPU checks it.
		if err := w.dev.Fill(ptr, n, 0, brokerSeedD2H); err != nil {
			return err
		}
		if err := w.pieces(ctx, broker.ToHost, n); err != nil {
			return err
		}
		rep.CPUBad = brokerBadWords(w.view.Bytes()[w.winOff:w.winOff+n], brokerSeedD2H)
		// Host → device: the CPU writes the pattern into the window, the broker copies it to the
		// device, a kernel checks it.
		pinFillCPU(w.view.Bytes()[w.winOff:w.winOff+n], 0, brokerSeedH2D)
		// cuMemsetD8 is asynchronous for device memory: finish it before the broker writes there,
		// since the broker's copies are not ordered with this process's own work.
		if err := w.dev.Memset(ptr, 0, n); err != nil {
			return err
		}
		if err := w.dev.Synchronize(); err != nil {
			return err
		}
		if err := w.pieces(ctx, broker.ToDevice, n); err != nil {
			return err
		}
		bad, err := w.dev.Verify(ptr, n, 0, brokerSeedH2D)
		rep.GPUBad = bad
		return err

	case brokerCmdBandwidth:
		s := cmd.RequestBytes
		dir := broker.ToDevice
		if cmd.Direction == brokerDirD2H {
			dir = broker.ToHost
		}
		count := cmd.Bytes / s
		hostSlots, bufSlots := w.winLen/s, w.bufLen/s
		if count == 0 || hostSlots == 0 || bufSlots == 0 {
			return fmt.Errorf("requests of %s do not fit the window (%s) or the buffer (%s)", units.FormatSize(s), units.FormatSize(w.winLen), units.FormatSize(w.bufLen))
		}
		inflight := make([]*broker.Completion, 0, cmd.Depth)
		start := time.Now()
		for k := uint64(0); k < count; k++ {
			if len(inflight) == cmd.Depth {
				if err := inflight[0].Wait(ctx); err != nil {
					return err
				}
				inflight = inflight[1:]
			}
			cp, err := w.client.CopyAsync(broker.Request{Buffer: w.buf.ID(), Dir: dir,
				HostOffset: w.winOff + (k%hostSlots)*s, BufferOffset: (k % bufSlots) * s, Length: s})
			if err != nil {
				return err
			}
			inflight = append(inflight, cp)
		}
		for _, cp := range inflight {
			if err := cp.Wait(ctx); err != nil {
				return err
			}
		}
		end := time.Now()
		rep.StartNS, rep.EndNS, rep.Bytes = start.UnixNano(), end.UnixNano(), count*s
		return nil

	case brokerCmdRTT:
		var pings, rtts, copies []float64
		for i := 0; i < cmd.Samples+10; i++ {
			t0 := time.Now()
			if err := w.client.Ping(ctx); err != nil {
				return err
			}
			if i >= 10 {
				pings = append(pings, float64(time.Since(t0).Nanoseconds())/1e3)
			}
		}
		for i := 0; i < cmd.Samples+10; i++ {
			t0 := time.Now()
			cp, err := w.client.CopyAsync(broker.Request{Buffer: w.buf.ID(), Dir: broker.ToDevice, HostOffset: w.winOff, Length: brokerRTTBytes})
			if err == nil {
				err = cp.Wait(ctx)
			}
			if err != nil {
				return err
			}
			if i >= 10 {
				rtts = append(rtts, float64(time.Since(t0).Nanoseconds())/1e3)
				copies = append(copies, float64(cp.BrokerTime().Nanoseconds())/1e3)
			}
		}
		rep.PingUS, rep.RTTUS, rep.BrokerCopyUS = brokerMedian(pings), brokerMedian(rtts), brokerMedian(copies)
		return nil
	}
	return fmt.Errorf("unknown command %q", cmd.Op)
}

// pieces copies the first n bytes of the buffer to or from the start of the window, in pipelined
// pieces.
func (w *brokerWorker) pieces(ctx context.Context, dir broker.Direction, n uint64) error {
	var comps []*broker.Completion
	for off := uint64(0); off < n; off += brokerVerifyPiece {
		cp, err := w.client.CopyAsync(broker.Request{Buffer: w.buf.ID(), Dir: dir, HostOffset: w.winOff + off, BufferOffset: off,
			Length: min(brokerVerifyPiece, n-off)})
		if err != nil {
			return err
		}
		comps = append(comps, cp)
	}
	for _, cp := range comps {
		if err := cp.Wait(ctx); err != nil {
			return err
		}
	}
	return nil
}
