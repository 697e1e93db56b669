package worker_test

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/worker"
)

type call struct {
	Op string `json:"op"`
	N  int    `json:"n"`
}

type report struct {
	N   int    `json:"n"`
	Env string `json:"env"`
}

func init() {
	// echo answers each call with n+1 and the value of CUVMM_WORKER_TEST_VAR until op is "exit";
	// op "fail" reports an error and ends with it.
	worker.Register("echo", func(c *worker.Conn) error {
		for {
			var in call
			if err := c.Next(&in); err != nil {
				return err
			}
			switch in.Op {
			case "exit":
				return nil
			case "fail":
				return c.Report(nil, errors.New("asked to fail"))
			}
			if err := c.Report(report{N: in.N + 1, Env: os.Getenv("CUVMM_WORKER_TEST_VAR")}, nil); err != nil {
				return err
			}
		}
	})
	worker.Register("sleep", func(c *worker.Conn) error {
		time.Sleep(time.Minute)
		return nil
	})
	// spawner starts a grandchild that holds its output for 20 s, then sleeps.
	worker.Register("spawner", func(c *worker.Conn) error {
		cmd := exec.Command("sleep", "20")
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Start(); err != nil {
			return err
		}
		if err := c.Report("started", nil); err != nil {
			return err
		}
		time.Sleep(time.Minute)
		return nil
	})
	// badreport reports a value JSON cannot encode, and ends with Report's error.
	worker.Register("badreport", func(c *worker.Conn) error {
		return c.Report(make(chan int), nil)
	})
	worker.Register("stdout", func(*worker.Conn) error {
		_, err := os.Stdout.WriteString("hello from the child\n")
		return err
	})
}

func TestMain(m *testing.M) {
	worker.Main()
	os.Exit(m.Run())
}

var testArgs = worker.Options{Args: []string{"-test.run=^$"}}

func TestCallReport(t *testing.T) {
	t.Setenv("CUVMM_WORKER_TEST_VAR", "inherited")
	p, err := worker.Start("echo", testArgs)
	require.NoError(t, err)
	var r report
	require.NoError(t, p.Conn.Call(call{N: 41}, &r))
	require.Equal(t, report{N: 42, Env: "inherited"}, r, "the child inherits the environment")
	require.NoError(t, p.Conn.Send(call{Op: "exit"}))
	require.NoError(t, p.Wait())
	require.NoError(t, p.Wait(), "Wait is idempotent")
}

func TestRemoteError(t *testing.T) {
	p, err := worker.Start("echo", testArgs)
	require.NoError(t, err)
	err = p.Conn.Call(call{Op: "fail"}, nil)
	require.ErrorIs(t, err, worker.ErrRemote)
	require.Contains(t, err.Error(), "asked to fail")
	err = p.Wait()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, "the role's error is the exit status")
}

func TestUnknownRole(t *testing.T) {
	p, err := worker.Start("no-such-role", testArgs)
	require.NoError(t, err)
	err = p.Conn.Receive(nil)
	require.ErrorIs(t, err, worker.ErrRemote)
	require.Contains(t, err.Error(), "unknown role")
	require.Error(t, p.Wait())
}

func TestKill(t *testing.T) {
	p, err := worker.Start("sleep", testArgs)
	require.NoError(t, err)
	t0 := time.Now()
	err = p.Kill()
	require.Less(t, time.Since(t0), 30*time.Second)
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee)
	require.Equal(t, syscall.SIGKILL, ee.Sys().(syscall.WaitStatus).Signal())
	require.Equal(t, err, p.Kill(), "a second Kill only reports")
}

func TestOutputAndNoControl(t *testing.T) {
	var out bytes.Buffer
	p, err := worker.Start("stdout", worker.Options{Args: []string{"-test.run=^$"}, Stdout: &out, NoControl: true})
	require.NoError(t, err)
	require.Nil(t, p.Conn)
	require.NoError(t, p.Wait())
	require.True(t, strings.Contains(out.String(), "hello from the child"), out.String())
}

func init() {
	worker.Register("env", func(c *worker.Conn) error {
		return c.Report(map[string]string{"role": os.Getenv(worker.EnvRole), "fd": os.Getenv(worker.EnvFD)}, nil)
	})
}

// TestRoleNotInherited: a worker's own children do not inherit its role.
func TestRoleNotInherited(t *testing.T) {
	p, err := worker.Start("env", testArgs)
	require.NoError(t, err)
	var got map[string]string
	require.NoError(t, p.Conn.Receive(&got))
	require.Equal(t, map[string]string{"role": "", "fd": ""}, got)
	require.NoError(t, p.Wait())
}

// Kill returns within a few seconds even when a process the child started still holds the child's
// output pipe (it waited for that grandchild to exit).
func TestKillWithAGrandchildHoldingTheOutput(t *testing.T) {
	if _, err := exec.LookPath("sleep"); err != nil {
		t.Skipf("no sleep command: %v", err)
	}
	var out bytes.Buffer // Start serializes the writes of stdout's and stderr's copiers
	p, err := worker.Start("spawner", worker.Options{Args: testArgs.Args, Stdout: &out, Stderr: &out})
	require.NoError(t, err)
	require.NoError(t, p.Conn.Receive(nil))
	t0 := time.Now()
	require.Error(t, p.Kill(), "killed")
	require.Less(t, time.Since(t0), 10*time.Second, "Kill waited for the grandchild")
	require.NotNil(t, p.ExitState())
}

// Kill while another goroutine reaps the child is race-free, and ExitState is nil until the reap.
func TestKillWhileAnotherGoroutineWaits(t *testing.T) {
	p, err := worker.Start("stdout", worker.Options{Args: testArgs.Args, NoControl: true})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- p.Wait() }()
	time.Sleep(200 * time.Millisecond)
	require.NoError(t, p.Kill(), "the child had exited cleanly")
	require.NoError(t, <-done)
	require.NotNil(t, p.ExitState())
}

// A report whose value cannot be encoded reaches the parent as an error, and Report returns it to
// the child too, whose role then fails.
func TestReportOfAnUnencodableValue(t *testing.T) {
	p, err := worker.Start("badreport", testArgs)
	require.NoError(t, err)
	err = p.Conn.Receive(nil)
	require.ErrorIs(t, err, worker.ErrRemote)
	require.ErrorContains(t, err, "unsupported type")
	require.Error(t, p.Wait(), "the role ended with Report's error")
}

// Send to a child that never reads fails within the Conn's timeout once the socket is full, instead
// of blocking the parent for ever.
func TestSendToAChildThatStopsReading(t *testing.T) {
	p, err := worker.Start("sleep", testArgs)
	require.NoError(t, err)
	defer func() { _ = p.Kill() }()
	p.Conn.Timeout = 200 * time.Millisecond
	big := call{Op: strings.Repeat("x", 256<<10)}
	t0 := time.Now()
	for i := 0; i < 1000 && err == nil; i++ {
		err = p.Conn.Send(big)
	}
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.Less(t, time.Since(t0), 5*time.Second)
}
