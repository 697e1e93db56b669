package main

import "github.com/cuvmm/cuvmm/measure"

func init() {
	register(&command{name: "share", summary: "share a buffer of N chunks with a second process over a Unix socket (export, import, map, both sides verify)",
		run: runShare, tour: []string{"--size", "16MiB", "--chunks", "4"}})
}

func runShare(e *env, args []string) error {
	var c common
	size := sizeFlag{256 << 20}
	fs := newFlags(e, "share")
	c.register(fs, 1)
	fs.Var(&size, "size", "buffer size: whole chunks, each a multiple of the granularity")
	chunks := fs.Int("chunks", 8, "number of chunks (allocations) in the buffer")
	location := fs.String("location", "device", "memory: device or host (host NUMA memory next to the device)")
	ordinal := fs.Int("device", 0, "device ordinal")
	rounds := fs.Int("rounds", 3, "how many times to share the buffer (times are of the median round)")
	childAccess := fs.String("child-access", "device", "what the child maps the buffer for: device (its GPU) or cpu (host memory only: the CPU reads and writes it, no GPU page tables)")
	if err := parse(fs, args); err != nil {
		return err
	}
	return measureAndShow(e, &c, func(me measure.Env) (*measure.ShareResult, error) {
		return measure.Share(measure.ShareOptions{Env: me, Device: *ordinal, Size: size.v, Chunks: *chunks,
			Location: *location, Rounds: *rounds, ChildAccess: *childAccess})
	})
}
