package main

import "github.com/cuvmm/cuvmm/measure"

func init() {
	register(&command{name: "info", summary: "driver version, devices, VMM features, granularity, peer matrix",
		run: runInfo, tour: []string{}})
}

func runInfo(e *env, args []string) error {
	var c common
	fs := newFlags(e, "info")
	c.register(fs, 1)
	if err := parse(fs, args); err != nil {
		return err
	}
	return measureAndShow(e, &c, func(me measure.Env) (*measure.InfoResult, error) {
		return measure.Info(measure.InfoOptions{Env: me})
	})
}
