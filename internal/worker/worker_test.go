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
