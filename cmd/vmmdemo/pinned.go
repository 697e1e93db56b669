package main

import (
	"fmt"
	"strings"

	"github.com/cuvmm/cuvmm/measure"
)

func init() {
	register(&command{
		name:    "pinned",
		summary: "N processes share one pinned region: GPU page-table overhead naive vs shared vs cpu-only; time to ready vs cuMemHostAlloc",
		run:     runPinned,
		tour:    []string{"--size", "64MiB", "--procs", "2"},
	})
}

func runPinned(e *env, args []string) error {
	var c common
	fs := newFlags(e, "pinned")
	c.register(fs, 2)
	size := sizeFlag{v: 1 << 30}
	fs.Var(&size, "size", "region size")
	procs := fs.Int("procs", 4, fmt.Sprintf("worker processes (at most %d)", measure.MaxWorkers))
	devs := deviceList{all: true}
	fs.Var(&devs, "devices", "devices the workers use, round robin (comma-separated ordinals, or all)")
	modes := fs.String("modes", "naive,shared,cpu-only", "modes to run: naive, shared, cpu-only")
	noBaseline := fs.Bool("no-baseline", false, "skip timing cuMemHostAlloc of the same size")
	workerContexts := fs.String("worker-contexts", "all", "devices each worker holds a context on: all (a worker that uses every GPU, as multi-GPU services do) or own (its device only, as with one visible GPU per worker); a registration costs page tables on every device where its process has a context")
	if err := parse(fs, args); err != nil {
		return err
	}
	var runModes []string
	for _, m := range strings.Split(*modes, ",") {
		runModes = append(runModes, strings.TrimSpace(m))
	}
	return measureAndShow(e, &c, func(me measure.Env) (*measure.PinnedResult, error) {
		return measure.Pinned(measure.PinnedOptions{Env: me, Size: size.v, Procs: *procs, Devices: devs.list(),
			Modes: runModes, NoBaseline: *noBaseline, WorkerContexts: *workerContexts})
	})
}
