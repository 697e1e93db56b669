package measure

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync/atomic"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/vmm"
)

// sleepSeed varies the pattern Sleep writes.
const sleepSeed = 0x736c6570 // "slep"

// SleepOptions are Sleep's options.
type SleepOptions struct {
	Env
	// Size is the buffer on each device (a multiple of the granularity).
	Size uint64
	// Devices are the device ordinals, one buffer each (empty: device 0).
	Devices []int
	// Mode is the offload policy: "keep" (default), "discard" or "file".
	Mode string
	// File is the file of the file mode (default: a new file in Env.TempDir's directory, or the
	// system's, removed at the end). Each device's buffer takes Size bytes of it, in device order.
	File string
	// Chunk is the buffers' chunk size (default 512 MiB, or Size when smaller).
	Chunk uint64
	// SlotSize is the set's backup slot size, a multiple of 2 MiB (0: offload.DefaultSlotSize).
	SlotSize uint64
	// IOWorkers is the set's file I/O parallelism for each device (default
	// offload.DefaultIOWorkers); the set's staging plan may use fewer, and the raw file figures
	// use as many goroutines in all as the set does.
	IOWorkers int
	// FilePart and FileBuffers are the set's file part size and staging buffers per goroutine
	// (defaults offload.DefaultFilePart and offload.DefaultFileBuffers); the raw file figures use
	// the same.
	FilePart    uint64
	FileBuffers int
	// Rounds is how many rounds of warm sleeps and wakes are timed (default 5, in file mode 3; at
	// most 50), each against raw transfers of the same bytes timed in the same round; the medians
	// are reported, and each round's ratios too. Keep and discard: a raw copy out, a sleep, a raw
	// copy in and a wake, every device at once. File: a raw write, a sleep, a raw read, a wake and
	// a raw read again, each phase after an fsync.
	Rounds int
	// FileRounds is Rounds' older name, for file mode only.
	//
	// Deprecated: use Rounds.
	FileRounds int
	// Prepare pins the backup with Set.Prepare before the first sleep, as a service that knows it
	// will sleep does at start (keep mode only): PrepareSeconds reports it, and the first sleep then
	// only copies.
	Prepare bool
	// FirstSleep is how the set backs up a Keep buffer when its pool is empty: "auto" (default),
	// "pin" or "stage" (offload.FirstSleep).
	FirstSleep string
}

// SleepDevice is one device's part of a Sleep run.
type SleepDevice struct {
	Device       int     `json:"device"`
	Bytes        uint64  `json:"bytes"`
	FreedBytes   uint64  `json:"freed_bytes"`
	PtrUnchanged bool    `json:"ptr_unchanged"`
	Verified     bool    `json:"verified"`
	GraphOK      bool    `json:"graph_verified"`
	RawD2HGBps   float64 `json:"raw_d2h_gbps"`
	RawH2DGBps   float64 `json:"raw_h2d_gbps"`
}

// SleepResult is a sleep and wake of one buffer per device, against raw pinned copies and the usual
// cuMemHostAlloc-then-copy backup, all measured in the same run.
type SleepResult struct {
	Backend    string `json:"backend"`
	Mode       string `json:"mode"`
	Devices    []int  `json:"devices"`
	SizeBytes  uint64 `json:"size_bytes"`  // per device
	TotalBytes uint64 `json:"total_bytes"` // over the devices
	ChunkBytes uint64 `json:"chunk_bytes"`
	// Verified: after every wake each buffer held its pattern (Discard: zeros), read by a kernel
	// through the address saved before the first sleep, and a graph captured before it agreed.
	Verified     bool    `json:"verified"`
	PtrUnchanged bool    `json:"ptr_unchanged"`
	FreedBytes   uint64  `json:"freed_bytes"` // rise of free memory over the devices at the first sleep
	FreedRatio   float64 `json:"freed_ratio"` // FreedBytes / TotalBytes
	// The first sleep pins its backup on the way; the later ones reuse it (warm). With
	// SleepOptions.Prepare, Set.Prepare pinned it first, in PrepareSeconds, and the first sleep only
	// copies.
	PrepareSeconds    float64 `json:"prepare_seconds,omitempty"`
	FirstSleepSeconds float64 `json:"first_sleep_seconds"`
	FirstWakeSeconds  float64 `json:"first_wake_seconds"`
	SleepSeconds      float64 `json:"sleep_seconds"`
	WakeSeconds       float64 `json:"wake_seconds"`
	FirstSleepGBps    float64 `json:"first_sleep_gbps"`
	SleepGBps         float64 `json:"sleep_gbps"`
	WakeGBps          float64 `json:"wake_gbps"`
	// Raw copies into memory already pinned (cuMemcpyDtoH / cuMemcpyHtoD in pieces of the slot
	// size, every device at once), over the same bytes: the limit. Every device starts each phase
	// together; the rate is over the window from that start to the last device's finish.
	RawD2HGBps float64 `json:"raw_d2h_gbps"`
	RawH2DGBps float64 `json:"raw_h2d_gbps"`
	// RawPinGBps is how fast this host pins fresh memory with pinned.Register (map, fault in from
	// several threads, then cuMemHostRegister), timed on the raw copies' host memory (up to 2 GiB per
	// device, every device at once). FirstSleepLimitSeconds is the longer of pinning and copying the
	// bytes at these rates (on the measured hosts, pinning): the floor of a first sleep that copies
	// each piece while it pins the next as pinned.Register does (fault in, then register). The first
	// sleep also overlaps faulting pages in with registering others, so it can beat it. These
	// floors bound a Keep set's sleeps only: a File sleep writes a file, a Discard sleep copies
	// nothing (the rates are measured in every mode).
	RawPinGBps             float64 `json:"raw_pin_gbps"`
	FirstSleepLimitSeconds float64 `json:"first_sleep_limit_seconds"`
	// A second cold sleep, after TrimPool gave the backup back: it pins again, now memory the host
	// has already provided to the process once (on a virtual machine whose memory grows as it is first
	// touched, the first sleep also pays for that growth). RawRepinGBps is the pinning rate of such
	// memory, RepinSleepLimitSeconds the floor that follows, as for the first sleep.
	RepinSleepSeconds      float64 `json:"repin_sleep_seconds"`
	RawRepinGBps           float64 `json:"raw_repin_gbps"`
	RepinSleepLimitSeconds float64 `json:"repin_sleep_limit_seconds"`
	SleepVsRaw             float64 `json:"sleep_vs_raw"` // SleepGBps / RawD2HGBps
	WakeVsRaw              float64 `json:"wake_vs_raw"`  // WakeGBps / RawH2DGBps
	// Rounds is how many warm rounds ran (SleepOptions.Rounds). Keep and discard: SleepSeconds,
	// WakeSeconds and the raw copy rates are the medians of the rounds, and each round's sleep ÷
	// its raw copy out and wake ÷ its raw copy in are listed, in the order run, with their medians.
	Rounds                 int       `json:"rounds"`
	SleepVsRawRounds       []float64 `json:"sleep_vs_raw_rounds,omitempty"`
	WakeVsRawRounds        []float64 `json:"wake_vs_raw_rounds,omitempty"`
	SleepVsRawRoundsMedian float64   `json:"sleep_vs_raw_rounds_median,omitempty"`
	WakeVsRawRoundsMedian  float64   `json:"wake_vs_raw_rounds_median,omitempty"`
	// The sleeps' steps (offload.Stats.LastSleepSteps), medians of the rounds (in file mode, of
	// the file rounds): waiting for the buffers' queued work, copying their content out (Keep
	// chunks released on the way; File: writing the file), and releasing the rest of their GPU
	// memory (about nothing for a kept buffer).
	SleepWaitSeconds    float64 `json:"sleep_wait_seconds"`
	SleepCopySeconds    float64 `json:"sleep_copy_seconds"`
	SleepReleaseSeconds float64 `json:"sleep_release_seconds"`
	// The warm wake (WakeSeconds) follows AsleepPauseSeconds asleep: the driver clears released
	// memory in the background for some tens of milliseconds, and a wake meanwhile is slower. The
	// wake right after a warm sleep, and its ratio to the raw H2D copy. Not in file mode, whose
	// WakeSeconds comes from the file rounds, each wake after an fsync.
	AsleepPauseSeconds float64 `json:"asleep_pause_seconds,omitempty"`
	WakeAtOnceSeconds  float64 `json:"wake_at_once_seconds,omitempty"`
	WakeAtOnceGBps     float64 `json:"wake_at_once_gbps,omitempty"`
	WakeAtOnceVsRaw    float64 `json:"wake_at_once_vs_raw,omitempty"`
	// The usual approach on the first device: cuMemHostAlloc a backup, then copy the buffer into it.
	BaselineSleepSeconds float64 `json:"baseline_sleep_seconds"`
	BaselineAllocSeconds float64 `json:"baseline_alloc_seconds"`
	// FirstSleepSpeedup is BaselineSleepSeconds / FirstSleepOneSeconds: with one device the
	// process's first sleep (with Prepare, Prepare's time and the first sleep's together, as the
	// usual backup's allocation and copy), with several the first device's alone after TrimPool.
	FirstSleepSpeedup    float64 `json:"first_sleep_speedup"`
	FirstSleepOneSeconds float64 `json:"first_sleep_one_device_seconds"`
	// FirstSleep is SleepOptions.FirstSleep; the staged bytes are what the first sleep, and with
	// several devices the first device's cold sleep, staged (offload.SleepSteps.StagedBytes): their
	// backup was registered in the background after the sleep, and the wake that follows (the
	// first wake) waited for that registration.
	FirstSleep               string `json:"first_sleep"`
	FirstSleepStagedBytes    uint64 `json:"first_sleep_staged_bytes"`
	FirstSleepOneStagedBytes uint64 `json:"first_sleep_one_device_staged_bytes"`
	// Several devices: the warm sleep of the first device alone, and the aggregate's ratio to it.
	OneDeviceSleepGBps float64 `json:"one_device_sleep_gbps,omitempty"`
	OneDeviceWakeGBps  float64 `json:"one_device_wake_gbps,omitempty"`
	AggregateSleepX    float64 `json:"aggregate_sleep_x,omitempty"`
	AggregateWakeX     float64 `json:"aggregate_wake_x,omitempty"`
	// File mode: the file, and raw writes and reads of the same bytes over the same file the way the
	// set does them (os.File.WriteAt / ReadAt of parts of FilePart bytes through the staging buffers
	// the set's plan gives each goroutine, IOWorkersUsed goroutines for each device), each timed
	// phase, raw or not, starting after an fsync so that no dirty pages are pending. Each of
	// Rounds rounds times a raw write, a sleep of the set, a raw read, a wake and a raw read
	// again; a round's raw read is the mean of its two. The raw figures and, in file mode,
	// SleepSeconds and WakeSeconds are the medians of the rounds.
	File        string `json:"file,omitempty"`
	IOWorkers   int    `json:"io_workers,omitempty"`
	FilePart    uint64 `json:"file_part_bytes,omitempty"`
	FileBuffers int    `json:"file_buffers,omitempty"`
	// IOWorkersUsed and FileBuffersUsed are what the set's staging plan makes of IOWorkers and
	// FileBuffers on each device (at most two slots of buffers, no more than the parts), and so
	// what the raw file figures use: the goroutines per device, and the most buffers one has.
	IOWorkersUsed    int     `json:"io_workers_used,omitempty"`
	FileBuffersUsed  int     `json:"file_buffers_used,omitempty"`
	RawFileWriteGBps float64 `json:"raw_file_write_gbps,omitempty"`
	RawFileReadGBps  float64 `json:"raw_file_read_gbps,omitempty"`
	SleepVsRawFile   float64 `json:"sleep_vs_raw_file,omitempty"`
	WakeVsRawFile    float64 `json:"wake_vs_raw_file,omitempty"`
	// Each round's sleep ÷ its raw write and wake ÷ its raw read, in the order run: how far the
	// host moved between rounds.
	SleepVsRawFileRounds []float64 `json:"sleep_vs_raw_file_rounds,omitempty"`
	WakeVsRawFileRounds  []float64 `json:"wake_vs_raw_file_rounds,omitempty"`
	// The medians of those: the middle round's ratio, where SleepVsRawFile and WakeVsRawFile
	// divide the medians of the speeds.
	SleepVsRawFileRoundsMedian float64 `json:"sleep_vs_raw_file_rounds_median,omitempty"`
	WakeVsRawFileRoundsMedian  float64 `json:"wake_vs_raw_file_rounds_median,omitempty"`
	// WakeFirstCopySeconds is how long the rounds' wakes took to queue their first copy (their
	// first chunks created and mapped, their first parts read), the median of the rounds.
	WakeFirstCopySeconds float64 `json:"wake_first_copy_seconds,omitempty"`
	// A file sleep can go no faster than the slower of the raw write and the raw D2H copy, a file
	// wake than the slower of the raw read and the raw H2D copy: those limits, and the set's
	// ratios to them.
	FileSleepLimitGBps float64       `json:"file_sleep_limit_gbps,omitempty"`
	FileWakeLimitGBps  float64       `json:"file_wake_limit_gbps,omitempty"`
	SleepVsFileLimit   float64       `json:"sleep_vs_file_limit,omitempty"`
	WakeVsFileLimit    float64       `json:"wake_vs_file_limit,omitempty"`
	PerDevice          []SleepDevice `json:"per_device"`
	Note               string        `json:"note,omitempty"`
	Failure            string        `json:"failure,omitempty"`
}

// Check reports a failed verification as an error.
func (r *SleepResult) Check() error {
	if !r.Verified || !r.PtrUnchanged {
		return fmt.Errorf("verification failed: %s", r.Failure)
	}
	return nil
}

func (o *SleepOptions) check() (offload.Policy, error) {
	if err := o.Env.check(); err != nil {
		return 0, err
	}
	if o.Mode == "" {
		o.Mode = "keep"
	}
	policy, err := offload.ParsePolicy(o.Mode)
	if err != nil {
		return 0, fmt.Errorf("--mode %q: want keep, discard or file: %w", o.Mode, ErrInvalidOption)
	}
	if o.File != "" && policy != offload.File {
		return 0, fmt.Errorf("--file is for --mode file: %w", ErrInvalidOption)
	}
	if o.Prepare && policy != offload.Keep {
		return 0, fmt.Errorf("--prepare is for --mode keep (Set.Prepare pins a Keep buffer's backup): %w", ErrInvalidOption)
	}
	if _, err := offload.ParseFirstSleep(cmp.Or(o.FirstSleep, "auto")); err != nil {
		return 0, fmt.Errorf("--first-sleep %q: want auto, pin or stage: %w", o.FirstSleep, ErrInvalidOption)
	}
	if o.Size == 0 || o.Size%(2<<20) != 0 {
		return 0, fmt.Errorf("--size %s: want a non-zero multiple of 2 MiB: %w", units.FormatSize(o.Size), ErrInvalidOption)
	}
	// offload would round a slot up to 2 MiB, and the raw copies must use the pieces the set uses:
	// refused instead, like --size and --chunk.
	if o.SlotSize%(2<<20) != 0 {
		return 0, fmt.Errorf("--slot %s: want a multiple of 2 MiB: %w", units.FormatSize(o.SlotSize), ErrInvalidOption)
	}
	o.SlotSize = cmp.Or(o.SlotSize, offload.DefaultSlotSize)
	if err := o.checkIOWorkers(policy); err != nil {
		return 0, err
	}
	if err := o.checkFileParts(policy); err != nil {
		return 0, err
	}
	if err := o.checkRounds(policy); err != nil {
		return 0, err
	}
	if len(o.Devices) == 0 {
		o.Devices = []int{0}
	}
	if o.Chunk == 0 {
		o.Chunk = min(o.Size, 512<<20)
	}
	if o.Chunk%(2<<20) != 0 {
		return 0, fmt.Errorf("--chunk %s: want a multiple of 2 MiB: %w", units.FormatSize(o.Chunk), ErrInvalidOption)
	}
	return policy, nil
}

// maxIOWorkers bounds IOWorkers: more goroutines than that only contend.
const maxIOWorkers = 64

// maxFileBuffers bounds FileBuffers: a goroutine reads into one at a time.
const maxFileBuffers = 64

func (o *SleepOptions) checkIOWorkers(policy offload.Policy) error {
	return checkFileCount("io-workers", &o.IOWorkers, maxIOWorkers, offload.DefaultIOWorkers, policy)
}

// maxRounds bounds Rounds: each file round writes the whole file to the disk twice.
const maxRounds = 50

// defaultRounds and defaultFileRounds: copy and file speeds on the measured hosts moved by up to
// a quarter between phases of one run (the page cache, and memory the host provides as it is
// touched), so medians of interleaved rounds compare like with like. A keep round of 16 GiB on each
// of two GPUs takes about 1.5 s; a file round about a minute, where the file is on a disk.
const (
	defaultRounds     = 5
	defaultFileRounds = 3
)

// checkRounds checks Rounds (and its older name FileRounds, file mode only) and sets its default.
func (o *SleepOptions) checkRounds(policy offload.Policy) error {
	if o.FileRounds != 0 {
		if err := checkFileCount("file-rounds", &o.FileRounds, maxRounds, defaultFileRounds, policy); err != nil {
			return err
		}
		if o.Rounds != 0 && o.Rounds != o.FileRounds {
			return fmt.Errorf("--rounds %d and --file-rounds %d: give one (--file-rounds is the older name): %w", o.Rounds, o.FileRounds, ErrInvalidOption)
		}
		o.Rounds = o.FileRounds
	}
	if o.Rounds < 0 || o.Rounds > maxRounds {
		return fmt.Errorf("--rounds %d: want 1 to %d: %w", o.Rounds, maxRounds, ErrInvalidOption)
	}
	def := defaultRounds
	if policy == offload.File {
		def = defaultFileRounds
	}
	o.Rounds = cmp.Or(o.Rounds, def)
	return nil
}

// checkFileCount checks a count that only file mode takes (1 to most, or 0 for def) and sets def.
func checkFileCount(flag string, v *int, most, def int, policy offload.Policy) error {
	switch {
	case *v < 0 || *v > most:
		return fmt.Errorf("--%s %d: want 1 to %d: %w", flag, *v, most, ErrInvalidOption)
	case *v != 0 && policy != offload.File:
		return fmt.Errorf("--%s is for --mode file: %w", flag, ErrInvalidOption)
	case *v == 0:
		*v = def
	}
	return nil
}

// checkFileParts checks FilePart and FileBuffers and sets their defaults.
func (o *SleepOptions) checkFileParts(policy offload.Policy) error {
	if (o.FilePart != 0 || o.FileBuffers != 0) && policy != offload.File {
		return fmt.Errorf("--file-part and --file-buffers are for --mode file: %w", ErrInvalidOption)
	}
	// The set would cut a larger part to its slots (a buffer smaller than a slot has smaller ones),
	// and the raw figures must use the part the set uses: refused instead.
	most := min(o.SlotSize, o.Size)
	if o.FilePart%4096 != 0 || o.FilePart > most {
		return fmt.Errorf("--file-part %s: want a multiple of 4 KiB up to the slot and the buffer (%s): %w",
			units.FormatSize(o.FilePart), units.FormatSize(most), ErrInvalidOption)
	}
	if o.FileBuffers < 0 || o.FileBuffers > maxFileBuffers {
		return fmt.Errorf("--file-buffers %d: want 1 to %d: %w", o.FileBuffers, maxFileBuffers, ErrInvalidOption)
	}
	o.FilePart = cmp.Or(o.FilePart, min(offload.DefaultFilePart, most)) // the part the set uses
	o.FileBuffers = cmp.Or(o.FileBuffers, offload.DefaultFileBuffers)
	return nil
}

// sleepRun is the state of one Sleep measurement.
type sleepRun struct {
	opts   *SleepOptions
	policy offload.Policy
	res    *SleepResult
	devs   []*vmm.Device
	bufs   []*growbuf.Buffer
	ptrs   []driver.DevicePtr
	graphs []*sleepGraph
	set    *offload.Set
	file   *os.File
	bar    Bar
	// firstCopy is the time from the start of the phase timed last to the set's first progress
	// report in it (a File wake reports a part once its copy is queued), 0 when it made none.
	firstCopy time.Duration
	phase     time.Time    // when the phase timed now began
	first     atomic.Int64 // its first progress report, in nanoseconds after phase (0: none yet)
}

// Sleep fills one buffer of Size bytes per device and adds them to an offload set with the Mode's
// policy. It then times, verifying content and address after each wake: a first sleep, which pins
// its backup on the way (after Set.Prepare with Prepare), and its wake; Rounds warm rounds, each
// beside raw copies (in file mode, raw file I/O) of the same bytes; a wake right after a sleep;
// a cold sleep after TrimPool gave the backup back; with several devices, the first device
// alone. Last it times the usual backup (cuMemHostAlloc, then copy) on the first device.
func Sleep(opts SleepOptions) (res *SleepResult, err error) {
	policy, err := opts.check()
	if err != nil {
		return nil, err
	}
	r := &sleepRun{opts: &opts, policy: policy, res: &SleepResult{Backend: opts.Backend.Name, Mode: opts.Mode,
		FirstSleep: cmp.Or(opts.FirstSleep, "auto"), Devices: slices.Clone(opts.Devices), SizeBytes: opts.Size, ChunkBytes: opts.Chunk, Verified: true, PtrUnchanged: true}}
	r.res.TotalBytes = opts.Size * uint64(len(opts.Devices))
	if opts.Backend.Sim() {
		r.res.Note = "simulator: times are of the Go simulation, not of a GPU"
	}
	defer func() { err = errors.Join(err, r.close()) }()
	if err := r.setup(); err != nil {
		return nil, err
	}
	if err := r.measureOffload(); err != nil {
		return nil, err
	}
	if err := r.measureBaselines(); err != nil {
		return nil, err
	}
	r.ratios()
	return r.res, nil
}

func (r *sleepRun) setup() error {
	for _, o := range r.opts.Devices {
		d, err := r.opts.Backend.Sys.Device(o)
		if err != nil {
			if errors.Is(err, vmm.ErrNoDevice) {
				return fmt.Errorf("--devices %d: the %s backend has %d devices: %w", o, r.opts.Backend.Name, r.opts.Backend.Sys.DeviceCount(), ErrInvalidOption)
			}
			return err
		}
		if err := d.LoadKernels(); err != nil {
			return err
		}
		r.devs = append(r.devs, d)
	}
	if err := r.makeBuffers(); err != nil {
		return err
	}
	so := r.opts.setOptions()
	so.Progress = func(done, total uint64) {
		if r.first.Load() == 0 {
			r.first.CompareAndSwap(0, int64(max(time.Since(r.phase), 1)))
		}
		if r.bar != nil {
			r.bar.Update(done)
		}
	}
	r.set = offload.NewSet(r.opts.Backend.Sys, so)
	return r.addBuffers()
}

func (r *sleepRun) makeBuffers() error {
	for i, d := range r.devs {
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: r.opts.Size, Chunk: growbuf.FixedChunks(r.opts.Chunk)})
		if err != nil {
			return err
		}
		r.bufs = append(r.bufs, buf)
		if err := buf.Grow(r.opts.Size); err != nil {
			return err
		}
		if err := d.Fill(buf.Ptr(), r.opts.Size, 0, sleepSeed+uint64(i)); err != nil {
			return err
		}
		r.ptrs = append(r.ptrs, buf.Ptr())
		g, err := captureSleepGraph(d, buf.Ptr(), r.opts.Size, sleepSeed+uint64(i))
		if err != nil {
			return fmt.Errorf("capture a graph on %s: %w", d, err)
		}
		r.graphs = append(r.graphs, g)
	}
	return nil
}

func (r *sleepRun) addBuffers() error {
	if r.policy == offload.File {
		path := r.opts.File
		var err error
		if path == "" {
			r.file, err = r.opts.createTemp("vmmdemo-sleep-*.bin")
		} else if r.file, err = os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644); err != nil {
			err = fmt.Errorf("--file: %w", err)
		}
		if err != nil {
			return err
		}
		r.res.File = r.file.Name()
	}
	for i, buf := range r.bufs {
		eo := offload.EntryOptions{}
		if r.file != nil {
			eo.File, eo.FileOffset = r.file, int64(i)*int64(r.opts.Size)
		}
		if err := r.set.Add(fmt.Sprintf("dev%d", r.opts.Devices[i]), buf, r.policy, eo); err != nil {
			return err
		}
	}
	return nil
}

func (r *sleepRun) close() error {
	var errs []error
	for _, g := range r.graphs {
		errs = append(errs, g.close())
	}
	for _, b := range r.bufs { // first: a buffer left asleep by a failure frees its backup
		errs = append(errs, b.Close())
	}
	if r.set != nil {
		errs = append(errs, r.set.Close())
	}
	if r.file != nil {
		errs = append(errs, r.file.Close())
		if r.opts.File == "" {
			errs = append(errs, os.Remove(r.file.Name()))
		}
	}
	return errors.Join(errs...)
}

// timed runs fn (a Sleep or Wake of tags) under a progress bar and returns its duration, up to
// the completion of all work queued on every device of the set (a Discard wake zeroes with an
// asynchronous memset). In file mode the file is fsynced first, outside the window.
func (r *sleepRun) timed(label string, total uint64, fn func(context.Context, ...string) error, tags ...string) (float64, error) {
	if err := r.syncFile(); err != nil {
		return 0, fmt.Errorf("%s: fsync first: %w", label, err)
	}
	r.bar = begin(r.opts.Progress, label, total)
	start := time.Now()
	r.phase = start
	r.first.Store(0)
	err := fn(context.Background(), tags...)
	r.firstCopy = time.Duration(r.first.Load())
	for _, d := range r.devs {
		err = errors.Join(err, d.Synchronize())
	}
	el := time.Since(start).Seconds()
	r.bar.Done()
	r.bar = nil
	if err != nil {
		return 0, fmt.Errorf("%s: %w", label, err)
	}
	return el, nil
}

func sleepGBps(bytes uint64, seconds float64) float64 {
	if seconds <= 0 {
		return 0
	}
	return float64(bytes) / seconds / 1e9
}

func sleepRatio(a, b float64) float64 {
	if b <= 0 {
		return 0
	}
	return a / b
}
