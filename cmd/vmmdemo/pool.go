package main

import (
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/cuvmm/cuvmm/measure"
	"github.com/cuvmm/cuvmm/pool"
)

func init() {
	register(&command{
		name:    "pool",
		summary: "replay an allocation trace on the cuvmm pool, cuMemAlloc, cuMemAllocAsync (and PyTorch): memory, failures, latency",
		run:     runPool,
		tour:    []string{"--synthetic", "serving", "--memory", "256MiB", "--fill-fraction", "0.6", "--cache-iters", "200"},
	})
}

func runPool(e *env, args []string) error {
	var c common
	fs := newFlags(e, "pool")
	c.register(fs, 1)
	traceFile := fs.String("trace", "", "trace file to replay (format: docs/pool.md)")
	synthetic := fs.String("synthetic", "", "built-in trace instead of --trace: serving")
	streams := fs.Int("streams", 0, "streams the trace's stream indexes map onto (default: the trace's)")
	fill := fs.Float64("fill-fraction", 0, "scale the trace so its peak in use is this fraction of --memory, 0 to 1; 0 keeps the trace's own sizes (left out: 0.95 for --synthetic, the trace's own sizes for --trace)")
	var memory sizeFlag
	fs.Var(&memory, "memory", "memory to size the trace against and the cuvmm pools' limit, at least 128MiB (default: the device's free memory; 2 GiB at most on the simulator)")
	device := fs.Int("device", 0, "device ordinal")
	verify := fs.Int("verify-every", 16, "fill and verify every Nth block (at least 1)")
	allocators := fs.String("allocators", strings.Join(measure.PoolAllocators, ","), "allocators to replay on")
	peer := fs.String("peer", "", "also replay in a peer process: torch (PyTorch's caching allocator, expandable segments)")
	peerScript := fs.String("peer-script", "", "the peer's script (default "+measure.PoolPeerScript+", under the working directory or a directory above the executable)")
	python := fs.String("python", "python3", "the Python interpreter for the peer")
	cacheIters := fs.Int("cache-iters", 20000, "alloc+free pairs timed from each allocator's cache (at least 1)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := zeroFlags(fs, "cache-iters", "verify-every", "memory"); err != nil {
		return err
	}
	tr, defFill, err := loadPoolTrace(*traceFile, *synthetic)
	if err != nil {
		return err
	}
	if !isSet(fs, "fill-fraction") {
		*fill = defFill
	}
	return measureAndShow(e, &c, func(me measure.Env) (*measure.PoolResult, error) {
		return measure.Pool(measure.PoolOptions{Env: me, Device: *device, Trace: tr, Streams: *streams, Memory: memory.v,
			FillFraction: *fill, VerifyEvery: *verify, Allocators: strings.Split(*allocators, ","), CacheIters: *cacheIters,
			Peer: *peer, PeerScript: *peerScript, Python: *python})
	})
}

// isSet reports whether the flag name was given on the command line.
func isSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// loadPoolTrace reads --trace or makes --synthetic (exactly one), and the default fill fraction.
func loadPoolTrace(file, synthetic string) (*pool.Trace, float64, error) {
	switch {
	case file != "" && synthetic != "":
		return nil, 0, fmt.Errorf("--trace and --synthetic: give one: %w", errUsage)
	case synthetic == "serving":
		return pool.SyntheticServing(1), 0.95, nil
	case synthetic != "":
		return nil, 0, fmt.Errorf("--synthetic %q: want serving: %w", synthetic, errUsage)
	case file == "":
		return nil, 0, fmt.Errorf("give --trace FILE or --synthetic serving: %w", errUsage)
	}
	f, err := os.Open(file)
	if err != nil {
		return nil, 0, fmt.Errorf("--trace: %w", err)
	}
	defer f.Close()
	tr, err := pool.ParseTrace(f)
	if err != nil {
		return nil, 0, fmt.Errorf("--trace %s: %w", file, err)
	}
	return tr, 0, nil
}
