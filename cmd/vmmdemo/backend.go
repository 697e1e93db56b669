package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/measure"
)

// common holds the flags every subcommand takes.
type common struct {
	backend    string
	simDevices int
	json       bool
}

func (c *common) register(fs *flag.FlagSet, defaultSimDevices int) {
	fs.StringVar(&c.backend, "backend", "auto", "driver: auto (the real one if it loads, else the simulator), cuda, or sim")
	fs.IntVar(&c.simDevices, "sim-devices", defaultSimDevices, fmt.Sprintf("number of simulated devices (at most %d)", measure.MaxSimDevices))
	fs.BoolVar(&c.json, "json", false, "print the result as JSON")
}

// flagOut is a flag set's output: silent while flags are parsed (a parse error is returned and
// printed once, with the subcommand's name and a hint), the help text when asked for.
type flagOut struct {
	w     io.Writer
	quiet bool
}

func (o *flagOut) Write(p []byte) (int, error) {
	if o.quiet {
		return len(p), nil
	}
	return o.w.Write(p)
}

// newFlags makes a flag set that reports errors instead of exiting.
func newFlags(e *env, name string) *flag.FlagSet {
	fs := flag.NewFlagSet("vmmdemo "+name, flag.ContinueOnError)
	fs.SetOutput(&flagOut{w: e.stderr})
	fs.Usage = func() {}
	return fs
}

// parse parses args; -h prints the flags, an error comes back with a hint instead of the usage.
func parse(fs *flag.FlagSet, args []string) error {
	out, _ := fs.Output().(*flagOut)
	if out != nil {
		out.quiet = true
	}
	err := fs.Parse(args)
	if out != nil {
		out.quiet = false
	}
	if err == flag.ErrHelp {
		fmt.Fprintf(fs.Output(), "usage: %s [flags]\n", fs.Name())
		fs.PrintDefaults()
		return err
	}
	if err != nil {
		return fmt.Errorf("%v (%s -h lists its flags): %w", err, fs.Name(), errUsage)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q (%s -h lists its flags): %w", fs.Args(), fs.Name(), errUsage)
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

// open opens the backend the flags ask for. auto falls back to the simulator with a notice on stderr.
func (c *common) open(e *env) (*measure.Backend, error) {
	return measure.OpenBackend(c.backend, c.simDevices, func(err error) {
		fmt.Fprintf(e.stderr, "vmmdemo: no usable CUDA driver (%v); using the simulator\n", err)
	})
}

// measureEnv is what a measurement runs with: the backend, a progress bar on a terminal (not with
// --json), notes on stderr, and the run's temporary directories for its temporary files (removed
// at the end and on SIGINT and SIGTERM).
func (c *common) measureEnv(e *env, b *measure.Backend) measure.Env {
	me := measure.Env{Backend: b, Log: e.stderr, TempDir: e.tempDir}
	if e.interactive && !c.json {
		me.Progress = e
	}
	return me
}

// textResult is a measurement's result: its JSON is what --json prints, Text what is printed
// otherwise.
type textResult interface{ Text(w io.Writer) }

// checked is a result that can report a failed verification as an error.
type checked interface{ Check() error }

// measureAndShow opens the backend, runs fn on it, closes it and renders the result.
func measureAndShow[T any, P interface {
	*T
	textResult
}](e *env, c *common, fn func(measure.Env) (P, error)) error {
	b, err := c.open(e)
	if err != nil {
		return err
	}
	res, runErr := fn(c.measureEnv(e, b))
	// Both errors count: a Close that fails after a failed run is how a leak on an error path shows.
	return show(e, c, res, errors.Join(runErr, b.Close()))
}

// show renders res (JSON or text; nothing when it is nil) and returns runErr, or else the
// verification failure the result reports.
func show[T any, P interface {
	*T
	textResult
}](e *env, c *common, res P, runErr error) error {
	if res == nil {
		return runErr
	}
	if c.json {
		if err := writeJSON(e.stdout, res); err != nil && runErr == nil {
			runErr = err
		}
	} else {
		res.Text(e.stdout)
	}
	if ch, ok := any(res).(checked); ok && runErr == nil {
		runErr = ch.Check()
	}
	return runErr
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
