package main

import (
	"fmt"
	"sort"
)

func init() {
	register(&command{name: "tour", summary: "run every subcommand with small sizes (make demo)", run: runTour})
}

// tourOrder puts the subcommands in the order a newcomer meets the ideas.
var tourOrder = []string{"info", "grow", "stripe", "share", "xfer", "bandwidth", "pinned", "broker"}

func runTour(e *env, args []string) error {
	var c common
	fs := newFlags(e, "tour")
	c.register(fs, 2)
	if err := parse(fs, args); err != nil {
		return err
	}
	// Resolve auto once, so the fallback notice is printed once and every subcommand uses the same
	// backend.
	if c.backend == "auto" {
		b, err := c.open(e)
		if err != nil {
			return err
		}
		c.backend = b.Name
		if err := b.Close(); err != nil {
			return err
		}
	}
	rank := map[string]int{}
	for i, n := range tourOrder {
		rank[n] = i
	}
	var names []string
	for n, cmd := range commands {
		if cmd.tour != nil {
			names = append(names, n)
		}
	}
	sort.Slice(names, func(i, j int) bool {
		ri, iok := rank[names[i]]
		rj, jok := rank[names[j]]
		if iok != jok {
			return iok
		}
		if ri != rj {
			return ri < rj
		}
		return names[i] < names[j]
	})
	// With --json, stdout holds only the subcommands' JSON documents: the headers go to stderr.
	headers := e.stdout
	if c.json {
		headers = e.stderr
	}
	for _, n := range names {
		cmd := commands[n]
		args := append([]string{"--backend", c.backend, "--sim-devices", fmt.Sprint(c.simDevices)}, cmd.tour...)
		if c.json {
			args = append(args, "--json")
		}
		fmt.Fprintf(headers, "\n== vmmdemo %s %v\n", n, cmd.tour)
		if err := cmd.run(e, args); err != nil {
			return fmt.Errorf("%s: %w", n, err)
		}
	}
	fmt.Fprintln(headers, "\ntour complete")
	return nil
}
