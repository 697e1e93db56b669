package main

import (
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The private temporary directories of a run (the broker's socket lives in one) are named
// vmmdemo-<pid>-<random> in the system's temporary directory. They are removed when the subcommand
// ends, on SIGINT and SIGTERM, and, after a run that could not clean up (SIGKILL), by the next run,
// which removes those of this user whose process is gone.
const tempPrefix = "vmmdemo-"

// tempDir makes a private (0700) temporary directory for this run, removed when the subcommand
// ends or the process is interrupted. Its error names the directory it was to be made in and TMPDIR,
// which chooses it.
func (e *env) tempDir() (string, error) {
	dir, err := os.MkdirTemp("", fmt.Sprintf("%s%d-", tempPrefix, os.Getpid()))
	if err != nil {
		return "", fmt.Errorf("temporary directory in %s (TMPDIR): %w", os.TempDir(), err)
	}
	e.mu.Lock()
	e.dirs = append(e.dirs, dir)
	e.mu.Unlock()
	return dir, nil
}

// removeTempDirs removes the run's temporary directories.
func (e *env) removeTempDirs() {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, d := range e.dirs {
		_ = os.RemoveAll(d)
	}
	e.dirs = nil
}

// cleanUpOnSignal removes the run's temporary directories on SIGINT or SIGTERM, then lets the
// signal end the process as it would have. The returned function stops watching.
func (e *env) cleanUpOnSignal() (stop func()) {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		select {
		case sig := <-ch:
			e.removeTempDirs()
			signal.Reset(sig)
			_ = unix.Kill(os.Getpid(), sig.(syscall.Signal))
			time.Sleep(time.Second) // the signal is on its way; exit with its status should it not end us
			os.Exit(128 + int(sig.(syscall.Signal)))
		case <-done:
		}
	}()
	return func() {
		signal.Stop(ch)
		close(done)
	}
}

// removeStale removes the temporary directories in dir that runs of this user left behind: those
// named for a process that no longer exists.
func removeStale(dir string) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, ent := range entries {
		rest, ok := strings.CutPrefix(ent.Name(), tempPrefix)
		pidText, _, found := strings.Cut(rest, "-")
		if !ok || !found || !ent.IsDir() {
			continue
		}
		pid, err := strconv.Atoi(pidText)
		if err != nil || pid <= 0 || unix.Kill(pid, 0) != unix.ESRCH {
			continue // not ours by name, or the process is still there (or not ours to ask)
		}
		path := filepath.Join(dir, ent.Name())
		var st unix.Stat_t
		if unix.Lstat(path, &st) == nil && int(st.Uid) == os.Getuid() {
			_ = os.RemoveAll(path)
		}
	}
}
