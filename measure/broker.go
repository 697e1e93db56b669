package measure

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/pinned/broker"
	"github.com/cuvmm/cuvmm/vmm"
)

// BrokerOptions are Broker's options.
type BrokerOptions struct {
	Env
	// Size is the broker's pinned region, split into one window per worker; Workers the worker
	// processes.
	Size    uint64
	Workers int
	// Devices the broker serves and the workers use, round robin (nil: every device).
	Devices []int
	// MaxRequest is the largest request size measured: one of 1 MiB, 16 MiB and 256 MiB (0: 256
	// MiB). The sizes up to it that fit a worker's window are measured.
	MaxRequest uint64
	// BytesPerWorker is what each worker moves per request size and direction (0: 2 GiB on a GPU,
	// 64 MiB on the simulator; at least 4 requests).
	BytesPerWorker uint64
	// Depth is the requests each worker keeps in flight, Streams the broker's copy streams per
	// device, RTTSamples the round trips timed per worker (all at least 1).
	Depth, Streams, RTTSamples int
	// SpinMax is the broker's Options.SpinMax: copies of at most this many bytes are waited for by
	// spinning, larger ones sleeping (0: the broker's default, 4 MiB; negative: every copy sleeps).
	SpinMax int64
	// SocketDir is the directory the broker's socket is made in (it must exist and stays); empty,
	// a private temporary directory is made and removed.
	SocketDir string
}

// brokerSizes are the request sizes measured (those up to MaxRequest that fit a worker's window).
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
	Free []uint64 `json:"free,omitempty"` // per device ordinal, simulator only (its accounting is per process)
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

// BrokerBandwidth is one request size and direction through the broker against raw copies.
type BrokerBandwidth struct {
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
	// ServerCPUSeconds is the CPU time of this process, which runs the broker, while the workers
	// copied through it (getrusage, user and system); ServerCores that time over the same wall time:
	// the cores the broker kept busy.
	ServerCPUSeconds float64 `json:"server_cpu_seconds"`
	ServerCores      float64 `json:"server_cores"`
}

// BrokerRoundTrip is the round trip of a small synchronous copy through the broker.
type BrokerRoundTrip struct {
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

// BrokerDeviceMemory is one device's GPU memory with the broker against every worker mapping the
// region.
type BrokerDeviceMemory struct {
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

// BrokerMemory is the GPU memory the broker costs.
type BrokerMemory struct {
	Measure   string               `json:"measure"`
	PerDevice []BrokerDeviceMemory `json:"per_device"`
}

// BrokerTargets are the broker's targets on the GPU host and whether they were met.
type BrokerTargets struct {
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

// BrokerResult is a pinned copy broker serving N worker processes.
type BrokerResult struct {
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
	SpinMaxBytes     int64             `json:"spin_max_bytes"` // the broker's SpinMax; -1: every copy sleeps
	Depth            int               `json:"requests_in_flight_per_worker"`
	Verified         bool              `json:"verified"`
	MismatchedWords  uint64            `json:"mismatched_words"`
	Bandwidth        []BrokerBandwidth `json:"bandwidth"`
	RoundTrip        BrokerRoundTrip   `json:"round_trip"`
	GPUMemory        BrokerMemory      `json:"gpu_memory"`
	Targets          BrokerTargets     `json:"targets"`
	Timing           string            `json:"timing"`
	Notes            []string          `json:"notes,omitempty"`
}

func (o *BrokerOptions) check() error {
	if err := o.Env.check(); err != nil {
		return err
	}
	if err := firstErr(nonZeroSize("size", o.Size), atLeast(1, intOption{"workers", o.Workers}, intOption{"depth", o.Depth},
		intOption{"streams", o.Streams}, intOption{"rtt-samples", o.RTTSamples})); err != nil {
		return err
	}
	if o.Workers > MaxWorkers {
		return fmt.Errorf("--workers %d: want at most %d: %w", o.Workers, MaxWorkers, ErrInvalidOption)
	}
	if o.MaxRequest == 0 {
		o.MaxRequest = brokerSizes[len(brokerSizes)-1]
	}
	if !slices.Contains(brokerSizes, o.MaxRequest) {
		names := make([]string, len(brokerSizes))
		for i, s := range brokerSizes {
			names[i] = strings.ReplaceAll(units.FormatSize(s), " ", "")
		}
		return fmt.Errorf("--max-request %s: want one of %s (the request sizes measured): %w",
			units.FormatSize(o.MaxRequest), strings.Join(names, ", "), ErrInvalidOption)
	}
	if o.BytesPerWorker == 0 {
		o.BytesPerWorker = pick[uint64](o.Backend.Sim(), 64<<20, 2<<30)
	}
	return nil
}

// brokerRun is one Broker run: what it made, so that everything is freed on every path.
type brokerRun struct {
	o       *BrokerOptions
	devs    []*vmm.Device
	res     *BrokerResult
	sizes   []uint64
	window  uint64
	bufSize uint64
	procs   []*brokerProc
	region  *pinned.Region
	srv     *broker.Server
	served  chan error
	dir     string // made here, removed at the end
}

// Broker runs a pinned copy broker over a region and Workers worker processes that copy through it
// between their device buffers and their windows of the region: bandwidth by request size against
// raw pinned copies in this process, the round trip of a small copy against the copy alone, the
// data checked both ways, and each device's GPU memory against every worker mapping the region.
func Broker(opts BrokerOptions) (res *BrokerResult, err error) {
	if err := opts.check(); err != nil {
		return nil, err
	}
	opts.syncLog()
	b := &brokerRun{o: &opts}
	if b.devs, err = devices(opts.Backend, opts.Devices, "devices"); err != nil {
		return nil, err
	}
	if err := b.plan(); err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, b.close(err != nil)) }()
	if err := b.startWorkers(); err != nil {
		return nil, err
	}
	free0, err := b.free()
	if err != nil {
		return nil, err
	}
	if err := b.startServer(); err != nil {
		return nil, err
	}
	if err := b.memory(free0); err != nil {
		return nil, err
	}
	if err := b.verify(); err != nil {
		return nil, err
	}
	if err := b.bandwidths(); err != nil {
		return nil, err
	}
	if err := b.roundTrip(); err != nil {
		return nil, err
	}
	if err := b.stopWorkers(false); err != nil {
		return nil, err
	}
	brokerSummarize(b.res, !opts.Backend.Sim())
	if opts.Backend.Sim() {
		b.res.Notes = append(b.res.Notes, "simulator: bandwidth and times are of Go memory copies and sockets on this machine; GPU memory is the simulator's accounting (each process counts its own, summed here)")
	}
	return b.res, nil
}

// plan splits the region (its size as pinned.New will round it) into one window per worker and
// picks the request sizes that fit.
func (b *brokerRun) plan() error {
	o := b.o
	g, err := b.devs[0].DeviceGranularity()
	if err != nil {
		return err
	}
	regionLen, _ := units.RoundUp(o.Size, g)
	b.window = regionLen / uint64(o.Workers) / g * g
	for _, s := range brokerSizes {
		if s <= o.MaxRequest && s <= b.window {
			b.sizes = append(b.sizes, s)
		}
	}
	if len(b.sizes) == 0 {
		return fmt.Errorf("--size %s over %d workers leaves windows of %s: need at least 1MiB each: %w",
			units.FormatSize(o.Size), o.Workers, units.FormatSize(b.window), ErrInvalidOption)
	}
	b.bufSize, _ = units.RoundUp(b.sizes[len(b.sizes)-1], g)
	b.res = &BrokerResult{Backend: o.Backend.Name, Workers: o.Workers, WindowBytes: b.window, BufferBytes: b.bufSize,
		StreamsPerDevice: o.Streams, Depth: o.Depth, Verified: true, Devices: ordinalsOf(b.devs),
		Timing: "wall clock: each worker times its own requests; aggregate = all bytes / (last end − first start); raw = this process, same request size, one stream per device, every device at once"}
	if o.Backend.Sim() {
		b.res.Timing += " (simulator: Go memory copies, not GPU figures)"
	}
	return nil
}

// startServer pins the region, made visible to the served devices once, and starts the server
// with one window per worker.
func (b *brokerRun) startServer() (err error) {
	o := b.o
	bar := begin(o.Progress, "pinning the region", o.Size)
	t0 := time.Now()
	b.region, err = pinned.New(b.devs[0], o.Size, pinned.Options{Grant: b.devs, Progress: func(done, total uint64) { bar.Update(done) }})
	bar.Done()
	if err != nil {
		return err
	}
	b.res.RegionSeconds = time.Since(t0).Seconds()
	b.res.RegionBytes, b.res.RegionKind = b.region.Len(), b.region.Kind().String()
	windows := map[int32]uint64{}
	for _, w := range b.procs {
		windows[int32(w.p.Pid())] = w.offset
	}
	dir := o.SocketDir
	if dir == "" {
		if b.dir, err = os.MkdirTemp("", "vmmdemo-broker-"); err != nil {
			return err
		}
		dir = b.dir
	}
	b.srv, err = broker.NewServer(b.region, filepath.Join(dir, "broker.sock"), broker.Options{Devices: b.devs, StreamsPerDevice: o.Streams, SpinMax: o.SpinMax,
		Grant: func(peer unix.Ucred) (broker.Grant, error) {
			off, ok := windows[peer.Pid]
			if !ok {
				return broker.Grant{}, fmt.Errorf("pid %d is not one of the demo's workers", peer.Pid)
			}
			// The demo's workers map the whole region to check the bytes with their CPUs.
			return broker.Grant{Offset: off, Length: b.window, ShareRegion: true}, nil
		}})
	if err != nil {
		return err
	}
	b.res.SpinMaxBytes = b.srv.SpinMax()
	b.served = make(chan error, 1)
	go func() { b.served <- b.srv.Serve() }()
	return nil
}

// close stops the workers (killed after a failure), then the server, the region and the directory.
func (b *brokerRun) close(failed bool) error {
	err := b.stopWorkers(failed)
	if b.srv != nil {
		err = errors.Join(err, b.srv.Close(), <-b.served)
	}
	if b.region != nil {
		err = errors.Join(err, b.region.Close())
	}
	if b.dir != "" {
		err = errors.Join(err, os.RemoveAll(b.dir))
	}
	return err
}

// free is each served device's free memory, by ordinal.
func (b *brokerRun) free() ([]uint64, error) {
	return pinFreeHeld(b.o.Backend.Sys.DeviceCount(), b.devs)
}
