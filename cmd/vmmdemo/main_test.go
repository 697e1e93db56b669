package main

import (
	"os"
	"testing"

	"github.com/cuvmm/cuvmm/measure"
)

// TestMain lets the test binary stand in for vmmdemo: started as a measurement's worker process
// (share, pinned, broker re-execute the binary) it runs the worker's role, and run with a subcommand
// as its first argument it runs that subcommand as vmmdemo would, instead of the tests.
func TestMain(m *testing.M) {
	measure.RunWorker() // a measurement's worker process (share, pinned, broker) runs its role here
	if len(os.Args) > 1 && commands[os.Args[1]] != nil {
		os.Exit(runProcess(os.Args[1:]))
	}
	os.Exit(m.Run())
}
