package testutil

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/worker"
	"github.com/cuvmm/cuvmm/vmm"
)

// Multi-process tests re-execute their own test binary as the second process, so they run on a GPU
// host without a Go toolchain. The child learns the parent's backend from these variables; the
// package's TestMain runs the child's role (named in a variable of the package's own) instead of the
// tests.
const (
	EnvChildBackend    = "CUVMM_TEST_CHILD_BACKEND"     // "sim" or "cuda"
	EnvChildSimDevices = "CUVMM_TEST_CHILD_SIM_DEVICES" // devices of the child's simulator
)

// Child is this test binary running as a second process (started with internal/worker). It talks
// line by line: the parent reads the child's stdout with Line and writes to its stdin with Send.
type Child struct {
	t      testing.TB
	proc   *worker.Process
	stdin  io.WriteCloser
	lines  chan string
	stderr *lockedBuffer
}

// lockedBuffer is a bytes.Buffer safe for the exec package's copying goroutine and the test reading
// it at once.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// StartChild starts this test binary (running no tests) with b's backend, the extra environment
// env (the child's role among it) and files as descriptors 3 onwards. The child inherits the
// environment. It is killed at the end of the test if it is still running.
func StartChild(t testing.TB, b *Backend, env []string, files ...*os.File) *Child {
	t.Helper()
	inR, inW, err := os.Pipe()
	require.NoError(t, err)
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		require.NoError(t, err)
	}
	c := &Child{t: t, stdin: inW, lines: make(chan string, 16), stderr: &lockedBuffer{}}
	env = append([]string{EnvChildBackend + "=" + b.Name, EnvChildSimDevices + "=" + strconv.Itoa(b.Sys.DeviceCount())}, env...)
	c.proc, err = worker.Start("", worker.Options{Args: []string{"-test.run=^$"}, Env: env,
		Stdin: inR, Stdout: outW, Stderr: c.stderr, Files: files, NoControl: true})
	inR.Close()
	outW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		require.NoError(t, err)
	}
	go func() {
		sc := bufio.NewScanner(outR)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		// Close the pipe before lines is closed: whoever saw lines end (Wait, Kill, the clean-up)
		// may check for leaked descriptors at once.
		outR.Close()
		close(c.lines)
	}()
	t.Cleanup(func() {
		_ = c.proc.Kill()
		inW.Close()
		for range c.lines { // the reader has closed its end of the pipe when lines ends
		}
	})
	return c
}

// Pid is the child's process id.
func (c *Child) Pid() int { return c.proc.Pid() }

// Stderr is what the child wrote to its stderr so far.
func (c *Child) Stderr() string { return c.stderr.String() }

// Line waits (up to 2 minutes) for the child's next stdout line.
func (c *Child) Line() string {
	c.t.Helper()
	select {
	case l, ok := <-c.lines:
		if !ok {
			_ = c.proc.Wait()
			c.t.Fatalf("the child ended without a line; stderr:\n%s", c.stderr)
		}
		return l
	case <-time.After(2 * time.Minute):
		c.t.Fatalf("no line from the child in 2 minutes; stderr:\n%s", c.stderr)
	}
	return ""
}

// Send writes one line to the child's stdin.
func (c *Child) Send(line string) {
	c.t.Helper()
	_, err := fmt.Fprintln(c.stdin, line)
	require.NoError(c.t, err)
}

// Wait closes the child's stdin and waits for it to exit successfully.
func (c *Child) Wait() {
	c.t.Helper()
	c.stdin.Close()
	for range c.lines {
	}
	require.NoError(c.t, c.proc.Wait(), "child stderr:\n%s", c.stderr)
}

// Kill sends SIGKILL and reaps the child, checking that the signal is what ended it.
func (c *Child) Kill() {
	c.t.Helper()
	err := c.proc.Kill()
	var ee *exec.ExitError
	require.ErrorAs(c.t, err, &ee)
	require.Equal(c.t, syscall.SIGKILL, ee.Sys().(syscall.WaitStatus).Signal())
	for range c.lines {
	}
}

// ChildDevice opens, in a child, the backend its parent named (its own simulator, whose
// memfd-backed memory the parent's simulator shares, or the real driver) and returns device 0 and a
// function that closes everything.
func ChildDevice() (*vmm.Device, func() error, error) {
	var api driver.API
	var closeSim func() error
	switch b := os.Getenv(EnvChildBackend); b {
	case "sim":
		n, err := strconv.Atoi(os.Getenv(EnvChildSimDevices))
		if err != nil || n < 1 {
			n = 1
		}
		s := sim.New(sim.Devices(n))
		api, closeSim = s, s.Close
	case "cuda":
		var err error
		if api, err = driver.Open(); err != nil {
			return nil, nil, err
		}
	default:
		return nil, nil, fmt.Errorf("%s=%q: want sim or cuda", EnvChildBackend, b)
	}
	closeAll := func(sys *vmm.System) error {
		var err error
		if sys != nil {
			err = sys.Close()
		}
		if closeSim != nil {
			err = errors.Join(err, closeSim())
		}
		return err
	}
	sys, err := vmm.Open(api)
	if err != nil {
		return nil, nil, errors.Join(err, closeAll(nil))
	}
	dev, err := sys.Device(0)
	if err != nil {
		return nil, nil, errors.Join(err, closeAll(sys))
	}
	return dev, func() error { return closeAll(sys) }, nil
}
