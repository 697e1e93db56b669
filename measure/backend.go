package measure

import (
	"errors"
	"fmt"
	"io"
	"os"
	"slices"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/vmm"
)

// ErrInvalidOption is wrapped by every error about a measurement's options.
var ErrInvalidOption = errors.New("invalid option")

// MaxSimDevices is the most devices a simulated backend may have. The measurements that look at
// every pair of devices (Info's peer matrix) grow with the square of the count.
const MaxSimDevices = 64

// Backend is an opened driver: the real one ("cuda") or the simulator ("sim").
type Backend struct {
	Name string // "cuda" or "sim"
	Sys  *vmm.System

	sim    *sim.Sim
	closed bool
}

// Sim reports whether the backend is the simulator. Its times are of Go code, and each process
// has its own simulated devices (so per-process figures are added up).
func (b *Backend) Sim() bool { return b.Name == "sim" }

// Ordinals lists every device of the backend, in order.
func (b *Backend) Ordinals() []int { return b.OrdinalsBut(nil) }

// OrdinalsBut lists, in order, the devices of the backend that skip does not.
func (b *Backend) OrdinalsBut(skip []int) []int {
	var out []int
	for o := range b.Sys.DeviceCount() {
		if !slices.Contains(skip, o) {
			out = append(out, o)
		}
	}
	return out
}

// OpenBackend opens the backend kind names: "cuda", "sim" (with simDevices devices), or "auto",
// the real driver when it loads and has devices, else the simulator; fallback, when not nil, is
// told why the real driver was not used.
func OpenBackend(kind string, simDevices int, fallback func(error)) (*Backend, error) {
	switch kind {
	case "cuda", "auto":
		b, err := openCUDA()
		if err == nil {
			return b, nil
		}
		if kind == "cuda" {
			return nil, fmt.Errorf("real driver: %w", err)
		}
		if fallback != nil {
			fallback(err)
		}
		return OpenSim(simDevices)
	case "sim":
		return OpenSim(simDevices)
	}
	return nil, fmt.Errorf("--backend %q: want auto, cuda or sim: %w", kind, ErrInvalidOption)
}

func openCUDA() (*Backend, error) {
	api, err := driver.Open()
	if err != nil {
		return nil, err
	}
	sys, err := vmm.Open(api)
	if err != nil {
		return nil, err
	}
	if sys.DeviceCount() == 0 {
		return nil, errors.Join(fmt.Errorf("the driver reports no devices: %w", driver.ErrNoDevice), sys.Close())
	}
	return &Backend{Name: "cuda", Sys: sys}, nil
}

// OpenSim opens a simulator with n devices (1 to MaxSimDevices).
func OpenSim(n int) (*Backend, error) {
	if n < 1 || n > MaxSimDevices {
		return nil, fmt.Errorf("--sim-devices %d: want 1 to %d: %w", n, MaxSimDevices, ErrInvalidOption)
	}
	s := sim.New(sim.Devices(n))
	sys, err := vmm.Open(s)
	if err != nil {
		return nil, errors.Join(err, s.Close())
	}
	return &Backend{Name: "sim", Sys: sys, sim: s}, nil
}

// Close closes the system (and the simulator). A second Close does nothing.
func (b *Backend) Close() error {
	if b == nil || b.closed {
		return nil
	}
	b.closed = true
	err := b.Sys.Close()
	if b.sim != nil {
		err = errors.Join(err, b.sim.Close())
	}
	return err
}

// Progress is told about long work: Begin starts a bar of total units (bytes, or steps), the bar
// follows. A nil Progress reports nothing. A Progress that is also a StepProgress is given the
// bars counted in steps through BeginSteps, so that it can show them as counts.
type Progress interface {
	Begin(label string, total uint64) Bar
}

// StepProgress is a Progress that tells bars of steps (sizes measured, phases, allocations
// replayed) from bars of bytes: BeginSteps starts one of total steps.
type StepProgress interface {
	Progress
	BeginSteps(label string, total uint64) Bar
}

// Bar is one piece of long work in progress.
type Bar interface {
	Update(done uint64)
	Done()
}

type noBar struct{}

func (noBar) Update(uint64) {}
func (noBar) Done()         {}

func begin(p Progress, label string, total uint64) Bar {
	if p == nil {
		return noBar{}
	}
	return p.Begin(label, total)
}

// lazyBar is a bar for a package's progress callback (update: bytes done of total): it begins
// with the total the first call reports, which is the size asked for rounded up to the memory's
// granularity, so that the bar never shows more done than its total; end ends it.
func lazyBar(p Progress, label string) (update func(done, total uint64), end func()) {
	var bar Bar
	update = func(done, total uint64) {
		if bar == nil {
			bar = begin(p, label, total)
		}
		bar.Update(done)
	}
	end = func() {
		if bar != nil {
			bar.Done()
		}
	}
	return update, end
}

// beginSteps starts a bar of total steps: through BeginSteps where p has it, else Begin.
func beginSteps(p Progress, label string, total uint64) Bar {
	if sp, ok := p.(StepProgress); ok {
		return sp.BeginSteps(label, total)
	}
	return begin(p, label, total)
}

// Env is what every measurement runs with.
type Env struct {
	// Backend is the opened driver (required).
	Backend *Backend
	// Progress, when not nil, is told about long work.
	Progress Progress
	// Log, when not nil, receives notes (a device the measurement cannot use fully, a mismatch)
	// and the output of worker processes (the measurements serialise their writes); nil means the
	// process's standard error for workers and nothing for notes.
	Log io.Writer
	// TempDir, when not nil, makes a private temporary directory for the files a measurement
	// writes without being given a path (Sleep's --mode file backup, Pool's trace for the peer);
	// the caller removes it (vmmdemo does at the end and on SIGINT and SIGTERM). Nil means the
	// system's temporary directory.
	TempDir func() (string, error)
}

// createTemp creates a temporary file named by pattern (os.CreateTemp) in TempDir's directory, or
// the system's.
func (e *Env) createTemp(pattern string) (*os.File, error) {
	dir := ""
	if e.TempDir != nil {
		var err error
		if dir, err = e.TempDir(); err != nil {
			return nil, err
		}
	}
	return os.CreateTemp(dir, pattern)
}

func (e *Env) logf(format string, args ...any) {
	if e.Log != nil {
		fmt.Fprintf(e.Log, format, args...)
	}
}

func (e *Env) check() error {
	if e.Backend == nil || e.Backend.Sys == nil {
		return fmt.Errorf("no backend: %w", ErrInvalidOption)
	}
	return nil
}

// yesNo is how the text output writes a bool.
func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
