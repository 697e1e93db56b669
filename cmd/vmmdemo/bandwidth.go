package main

import (
	"flag"
	"fmt"

	"github.com/cuvmm/cuvmm/measure"
)

func init() {
	register(&command{
		name:    "bandwidth",
		summary: "host↔device copy bandwidth: pageable, cuMemHostAlloc, registered, host-NUMA and shared-memory regions; async staging",
		run:     runBandwidth,
		tour:    []string{"--max-size", "16MiB", "--staging", "64MiB"},
	})
}

func runBandwidth(e *env, args []string) error {
	var c common
	fs := newFlags(e, "bandwidth")
	c.register(fs, 1)
	device := fs.Int("device", 0, "device ordinal")
	var maxSize, staging, chunk sizeFlag
	fs.Var(&maxSize, "max-size", "largest copy measured, 64KiB to 1GiB (default 1GiB on a GPU, 64MiB on the simulator)")
	fs.Var(&staging, "staging", "bytes moved through async staging to a discarding writer and from a non-copying reader (default 8GiB on a GPU, 64MiB on the simulator; not with --no-staging)")
	fs.Var(&chunk, "staging-chunk", "staging buffer size (default 32MiB)")
	buffers := fs.Int("staging-buffers", 2, "staging buffers (at least 2; not with --no-staging)")
	noStaging := fs.Bool("no-staging", false, "skip the staging measurement")
	spin := fs.Bool("staging-spin", false, "staging waits spin on a core instead of sleeping")
	iters := fs.Int("iters", 0, "timed iterations per size (default: 5 to 50, fewer for large sizes)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := noStagingFlags(fs, *noStaging); err != nil {
		return err
	}
	if err := zeroFlags(fs, "max-size", "staging", "staging-chunk"); err != nil {
		return err
	}
	return measureAndShow(e, &c, func(me measure.Env) (*measure.BandwidthResult, error) {
		return measure.Bandwidth(measure.BandwidthOptions{Env: me, Device: *device, MaxSize: maxSize.v,
			Staging: staging.v, StagingChunk: chunk.v, StagingBuffers: *buffers, NoStaging: *noStaging, StagingSpin: *spin, Iters: *iters})
	})
}

// noStagingFlags refuses --no-staging with any flag of the staging measurement, whatever its value
// (package measure cannot tell --staging 0 or --staging-buffers 2 from flags left out).
func noStagingFlags(fs *flag.FlagSet, noStaging bool) error {
	if !noStaging {
		return nil
	}
	for _, n := range []string{"staging", "staging-chunk", "staging-buffers", "staging-spin"} {
		if isSet(fs, n) {
			return fmt.Errorf("--no-staging skips the staging measurement that --staging, --staging-chunk, --staging-buffers and --staging-spin set up: leave out --%s: %w", n, errUsage)
		}
	}
	return nil
}

// zeroFlags refuses a size or count flag among names that was given as 0: left out, it takes its
// default, while measure takes 0 for its own default, which is not always the flag's. A negative
// count is measure's to refuse.
func zeroFlags(fs *flag.FlagSet, names ...string) error {
	for _, n := range names {
		if !isSet(fs, n) {
			continue
		}
		switch v := fs.Lookup(n).Value; {
		case isZeroSize(v):
			return fmt.Errorf("--%s 0: want a size above 0 (leave the flag out for its default): %w", n, errUsage)
		case v.String() == "0":
			return fmt.Errorf("--%s 0: want at least 1: %w", n, errUsage)
		}
	}
	return nil
}

func isZeroSize(v flag.Value) bool {
	s, ok := v.(*sizeFlag)
	return ok && s.v == 0
}
