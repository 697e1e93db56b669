package main

import (
	"os"
	"testing"

	"github.com/cuvmm/cuvmm/internal/worker"
)

// TestMain lets the test binary stand in for vmmdemo when a demo re-executes itself for its second
// process (share-child, pinned-worker): run with a subcommand as its first argument, it runs that
// subcommand instead of the tests.
func TestMain(m *testing.M) {
	worker.Main() // a measurement's worker process (share, pinned, broker) runs its role here
	if len(os.Args) > 1 && commands[os.Args[1]] != nil {
		os.Exit(run(&env{stdout: os.Stdout, stderr: os.Stderr}, os.Args[1:]))
	}
	os.Exit(m.Run())
}
