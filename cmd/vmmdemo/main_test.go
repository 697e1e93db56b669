package main

import (
	"os"
	"testing"
)

// TestMain lets the test binary stand in for vmmdemo when a demo re-executes itself for its second
// process (share-child, pinned-worker): run with a subcommand as its first argument, it runs that
// subcommand instead of the tests.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && commands[os.Args[1]] != nil {
		os.Exit(run(&env{stdout: os.Stdout, stderr: os.Stderr}, os.Args[1:]))
	}
	os.Exit(m.Run())
}
