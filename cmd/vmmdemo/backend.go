package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// common holds the flags every subcommand takes.
type common struct {
	backend    string
	simDevices int
	json       bool
}

func (c *common) register(fs *flag.FlagSet, defaultSimDevices int) {
	fs.StringVar(&c.backend, "backend", "auto", "driver: auto (the real one if it loads, else the simulator), cuda, or sim")
	fs.IntVar(&c.simDevices, "sim-devices", defaultSimDevices, "number of simulated devices")
	fs.BoolVar(&c.json, "json", false, "print the result as JSON")
}

// newFlags makes a flag set that reports errors instead of exiting.
func newFlags(e *env, name string) *flag.FlagSet {
	fs := flag.NewFlagSet("vmmdemo "+name, flag.ContinueOnError)
	fs.SetOutput(e.stderr)
	return fs
}

func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return err
		}
		return fmt.Errorf("%v: %w", err, errUsage)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q: %w", fs.Args(), errUsage)
	}
	return nil
}

// sizeFlag is a flag.Value holding a byte size such as 256MiB.
type sizeFlag struct{ v uint64 }

func (s *sizeFlag) String() string { return units.FormatSize(s.v) }
func (s *sizeFlag) Set(v string) error {
	n, err := units.ParseSize(v)
	if err != nil {
		return err
	}
	s.v = n
	return nil
}

// backend is an opened driver.
type backend struct {
	name string // "cuda" or "sim"
	sys  *vmm.System
	sim  *sim.Sim
}

// open opens the backend the flags ask for. auto falls back to the simulator with a notice on stderr.
func (c *common) open(e *env) (*backend, error) {
	switch c.backend {
	case "cuda", "auto":
		api, err := driver.Open()
		var sys *vmm.System
		if err == nil {
			sys, err = vmm.Open(api)
			if err == nil && sys.DeviceCount() == 0 {
				err = fmt.Errorf("the driver reports no devices: %w", driver.ErrNoDevice)
			}
		}
		if err == nil {
			return &backend{name: "cuda", sys: sys}, nil
		}
		if c.backend == "cuda" {
			return nil, fmt.Errorf("real driver: %w", err)
		}
		fmt.Fprintf(e.stderr, "vmmdemo: no usable CUDA driver (%v); using the simulator\n", err)
		fallthrough
	case "sim":
		if c.simDevices < 1 {
			return nil, fmt.Errorf("--sim-devices %d: need at least 1: %w", c.simDevices, errUsage)
		}
		s := sim.New(sim.Devices(c.simDevices))
		sys, err := vmm.Open(s)
		if err != nil {
			s.Close()
			return nil, err
		}
		return &backend{name: "sim", sys: sys, sim: s}, nil
	}
	return nil, fmt.Errorf("--backend %q: want auto, cuda or sim: %w", c.backend, errUsage)
}

// Close closes the system (and the simulator).
func (b *backend) Close() error {
	err := b.sys.Close()
	if b.sim != nil {
		if serr := b.sim.Close(); err == nil {
			err = serr
		}
	}
	return err
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
