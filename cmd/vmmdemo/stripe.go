package main

import (
	"fmt"

	"github.com/cuvmm/cuvmm/measure"
)

func init() {
	register(&command{
		name:    "stripe",
		summary: "one virtual range striped over several GPUs: build, fill, verify from every GPU, read bandwidth vs plain and raw",
		run:     runStripe,
		// "all" is every device the backend has: the simulator's two in the tour, or the one GPU of a
		// one-GPU host (a plain range there, with a notice), so the tour never asks for a missing device.
		tour: []string{"--devices", "all", "--size", "64MiB", "--stripe", "8MiB"},
	})
}

func runStripe(e *env, args []string) error {
	var c common
	fs := newFlags(e, "stripe")
	c.register(fs, 2)
	devs := deviceList{all: true}
	accessOnly := deviceList{allowEmpty: true}
	size := sizeFlag{1 << 30}
	stripeSize := sizeFlag{128 << 20}
	fs.Var(&devs, "devices", "devices that hold the range, in layout order: a list such as 0,1, or all")
	fs.Var(&accessOnly, "access-only", "devices that access the range without holding any of it: a list, or all (every device --devices does not list)")
	fs.Var(&size, "size", "size of the range (rounded up to the granularity)")
	fs.Var(&stripeSize, "stripe", "stripe size for --layout interleaved (a multiple of the granularity; not with --layout blocked)")
	layout := fs.String("layout", "interleaved", "interleaved (round-robin stripes) or blocked (one slab per device)")
	readOnly := fs.Bool("read-only-peers", false, "devices get read-only access to the stripes they do not hold")
	builds := fs.Int("builds", 5, "timed builds of the range and of the raw baseline; the fastest of each is reported")
	reads := fs.Int("reads", 10, "timed passes of each bandwidth measurement, after one untimed; the best is reported (1 on the simulator)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *layout == "blocked" && isSet(fs, "stripe") {
		return fmt.Errorf("--stripe is for --layout interleaved (blocked gives each device one slab): leave it out: %w", errUsage)
	}
	return measureAndShow(e, &c, func(me measure.Env) (*measure.StripeResult, error) {
		return measure.Stripe(measure.StripeOptions{Env: me, Devices: devs.list(), AccessOnly: accessOnlyList(accessOnly, devs, me.Backend),
			Size: size.v, Layout: *layout, Stripe: stripeSize.v, ReadOnlyPeers: *readOnly, Builds: *builds, Reads: *reads})
	})
}

// accessOnlyList is --access-only for package measure: the list given (nil for none), or for all
// every device of the backend that --devices does not list (none with --devices all).
func accessOnlyList(accessOnly, devs deviceList, b *measure.Backend) []int {
	switch {
	case accessOnly.all && devs.all:
		return nil
	case accessOnly.all:
		return b.OrdinalsBut(devs.ordinals)
	}
	return accessOnly.ordinals
}
