package main

import "github.com/cuvmm/cuvmm/measure"

func init() {
	register(&command{
		name:    "grow",
		summary: "grow a buffer in place step by step, verifying all content each step; compare with realloc-and-copy",
		run:     runGrow,
		tour:    []string{"--to", "64MiB", "--step", "8MiB"},
	})
}

func runGrow(e *env, args []string) error {
	var c common
	fs := newFlags(e, "grow")
	c.register(fs, 1)
	to := sizeFlag{1 << 30}
	step := sizeFlag{64 << 20}
	var chunk sizeFlag
	fs.Var(&to, "to", "final size of the buffer (a multiple of 8 bytes)")
	fs.Var(&step, "step", "bytes added per step (a multiple of 8 bytes)")
	fs.Var(&chunk, "chunk", "growbuf chunk size, a multiple of the granularity (default: --step when it is one, else the package's geometric policy)")
	device := fs.Int("device", 0, "device ordinal")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := zeroFlags(fs, "chunk"); err != nil {
		return err
	}
	return measureAndShow(e, &c, func(me measure.Env) (*measure.GrowResult, error) {
		return measure.Grow(measure.GrowOptions{Env: me, Device: *device, To: to.v, Step: step.v, Chunk: chunk.v})
	})
}
