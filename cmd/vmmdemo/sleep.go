package main

import (
	"github.com/cuvmm/cuvmm/measure"
)

func init() {
	register(&command{
		name:    "sleep",
		summary: "put buffers to sleep (GPU memory released, content in pinned host memory or a file) and wake them at the same addresses; against raw pinned copies and cuMemHostAlloc-then-copy",
		run:     runSleep,
		tour:    []string{"--size", "64MiB"},
	})
}

func runSleep(e *env, args []string) error {
	var c common
	fs := newFlags(e, "sleep")
	c.register(fs, 1)
	size := sizeFlag{1 << 30}
	var chunk, slot, part sizeFlag
	var devs deviceList
	fs.Var(&size, "size", "buffer size on each device (a multiple of 2 MiB)")
	fs.Var(&devs, "devices", "devices, one buffer each: a list such as 0,1, or all (default 0)")
	mode := fs.String("mode", "keep", "what happens to the content while asleep: keep (pinned host memory), discard, or file")
	file := fs.String("file", "", "file of --mode file (default: a temporary file, removed at the end)")
	fs.Var(&chunk, "chunk", "the buffers' chunk size (default 512MiB, or --size when smaller)")
	fs.Var(&slot, "slot", "the backup's slot size, a multiple of 2 MiB (default 256MiB)")
	ioWorkers := fs.Int("io-workers", 0, "--mode file: goroutines that move parts to or from the file, for the set and the raw figures (default 8)")
	fs.Var(&part, "file-part", "--mode file: bytes each goroutine moves at once (default 4MiB, or --size or --slot when smaller)")
	fileBuffers := fs.Int("file-buffers", 0, "--mode file: staging buffers each goroutine cycles through (default 2)")
	rounds := fs.Int("rounds", 0, "rounds of warm sleeps and wakes, each against raw transfers in the same round, whose medians are reported (default 5, --mode file 3): keep and discard time a raw copy out, a sleep, a raw copy in and a wake; file a raw write, a sleep, a raw read, a wake and a raw read")
	fileRounds := fs.Int("file-rounds", 0, "--mode file: the older name of --rounds")
	prepare := fs.Bool("prepare", false, "--mode keep: pin the backup with Set.Prepare before the first sleep, as a service does at start, and report how long that took")
	firstSleep := fs.String("first-sleep", "auto", "--mode keep, the backup's first making: pin (fault in and register each slot, then copy into it), stage (copy through a small pinned ring into plain memory, registered in the background after the sleep), or auto (stage where the process holds several GPUs)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := zeroFlags(fs, "chunk", "slot", "file-part"); err != nil {
		return err
	}
	return measureAndShow(e, &c, func(me measure.Env) (*measure.SleepResult, error) {
		ordinals := devs.list()
		if ordinals == nil { // all
			ordinals = me.Backend.Ordinals()
		}
		return measure.Sleep(measure.SleepOptions{Env: me, Size: size.v, Devices: ordinals, Mode: *mode, File: *file,
			Chunk: chunk.v, SlotSize: slot.v, IOWorkers: *ioWorkers, FilePart: part.v, FileBuffers: *fileBuffers,
			Rounds: *rounds, FileRounds: *fileRounds, Prepare: *prepare, FirstSleep: *firstSleep})
	})
}
