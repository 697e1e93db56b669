package main

import (
	"fmt"
	"math"

	"github.com/cuvmm/cuvmm/measure"
	"github.com/cuvmm/cuvmm/pinned/broker"
)

func init() {
	register(&command{
		name:    "broker",
		summary: "a pinned copy broker and N worker processes: bandwidth by request size vs raw pinned copies, round trip, GPU memory vs every worker mapping the region",
		run:     runBroker,
		tour:    []string{"--size", "64MiB", "--workers", "2", "--max-request", "16MiB"},
	})
}

func runBroker(e *env, args []string) error {
	var c common
	fs := newFlags(e, "broker")
	c.register(fs, 2)
	size := sizeFlag{v: 1 << 30}
	fs.Var(&size, "size", "the broker's pinned region")
	workers := fs.Int("workers", 4, fmt.Sprintf("worker processes (at most %d)", measure.MaxWorkers))
	devs := deviceList{all: true}
	fs.Var(&devs, "devices", "devices the broker serves and the workers use, round robin (comma-separated ordinals, or all)")
	maxReq := sizeFlag{v: 256 << 20}
	fs.Var(&maxReq, "max-request", "largest request size measured: 1MiB, 16MiB or 256MiB")
	var perWorker sizeFlag
	fs.Var(&perWorker, "bytes", "bytes each worker moves per request size and direction (default 2GiB on a GPU, 64MiB on the simulator; at least 4 requests)")
	depth := fs.Int("depth", 8, "requests each worker keeps in flight")
	streams := fs.Int("streams", 4, "copy streams per device in the broker")
	samples := fs.Int("rtt-samples", 200, "round trips timed per worker")
	spin := sizeFlag{v: broker.DefaultSpinMax}
	fs.Var(&spin, "spin-max", "the broker waits for copies up to this size by spinning, for larger ones sleeping (0: every copy sleeps)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := zeroFlags(fs, "max-request", "bytes"); err != nil {
		return err
	}
	return measureAndShow(e, &c, func(me measure.Env) (*measure.BrokerResult, error) {
		dir, err := e.tempDir() // for the broker's socket; removed on SIGINT and SIGTERM too
		if err != nil {
			return nil, err
		}
		return measure.Broker(measure.BrokerOptions{Env: me, SocketDir: dir, Size: size.v, Workers: *workers, Devices: devs.list(),
			MaxRequest: maxReq.v, BytesPerWorker: perWorker.v, Depth: *depth, Streams: *streams, RTTSamples: *samples,
			SpinMax: spinOption(spin.v)})
	})
}

// spinOption is measure's SpinMax for --spin-max: 0 (every copy sleeps) is negative there, whose 0
// is the default.
func spinOption(v uint64) int64 {
	if v == 0 {
		return -1
	}
	return int64(min(v, math.MaxInt64))
}
