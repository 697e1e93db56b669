package broker

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// The multi-process tests re-execute this test binary as the other process (so they run on a GPU
// host without Go): CUVMM_BROKER_CHILD names its role and TestMain runs it instead of the tests.
const (
	envChild      = "CUVMM_BROKER_CHILD"
	envBackend    = "CUVMM_BROKER_BACKEND"
	envSimDevices = "CUVMM_BROKER_SIM_DEVICES"
	envSocket     = "CUVMM_BROKER_SOCKET"
)

func TestMain(m *testing.M) {
	if role := os.Getenv(envChild); role != "" {
		if err := childMain(role); err != nil {
			fmt.Fprintf(os.Stderr, "broker test child (%s): %v\n", role, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// childSystem opens the backend the parent names: its own simulator (whose memfd-backed memory the
// parent's simulator imports) or the real driver.
func childSystem() (*vmm.Device, func() error, error) {
	var api driver.API
	var closeSim func() error
	switch b := os.Getenv(envBackend); b {
	case "sim":
		n, _ := strconv.Atoi(os.Getenv(envSimDevices))
		s := sim.New(sim.Devices(n))
		api, closeSim = s, s.Close
	case "cuda":
		var err error
		if api, err = driver.Open(); err != nil {
			return nil, nil, err
		}
	default:
		return nil, nil, fmt.Errorf("%s=%q", envBackend, b)
	}
	sys, err := vmm.Open(api)
	if err != nil {
		return nil, nil, err
	}
	dev, err := sys.Device(0)
	if err != nil {
		return nil, nil, err
	}
	return dev, func() error {
		err := sys.Close()
		if closeSim != nil {
			err = errors.Join(err, closeSim())
		}
		return err
	}, nil
}

func childMain(role string) error {
	dev, closeSys, err := childSystem()
	if err != nil {
		return err
	}
	defer closeSys()
	path := os.Getenv(envSocket)
	switch role {
	case "worker":
		// Register a buffer and keep copies in flight both ways until killed.
		res, err := dev.System().Reserve(4*mib, vmm.ReserveOptions{})
		if err != nil {
			return err
		}
		for off := uint64(0); off < 4*mib; off += 2 * mib {
			if _, err := res.MapNew(off, 2*mib, dev, vmm.AllocOptions{HandleTypes: driver.HandleTypePosixFD}, vmm.ReadWrite(dev)); err != nil {
				return err
			}
		}
		c, err := Dial(path)
		if err != nil {
			return err
		}
		ctx := context.Background()
		rb, err := c.Register(ctx, ipc.FromReservation(res))
		if err != nil {
			return err
		}
		fmt.Println("registered")
		var inflight []*Completion
		for i := 0; ; i++ {
			if len(inflight) == 8 {
				if err := inflight[0].Wait(ctx); err != nil {
					return err
				}
				inflight = inflight[1:]
			}
			if i == 16 {
				fmt.Println("busy")
			}
			cp, err := c.CopyAsync(Request{Buffer: rb.ID(), Dir: Direction(1 + i%2), HostOffset: uint64(i%2) * 4 * mib, Length: 4 * mib})
			if err != nil {
				return err
			}
			inflight = append(inflight, cp)
		}

	case "broker":
		// Serve a region until stdin closes (or until killed).
		region, err := pinned.New(dev, 8*mib, pinned.Options{})
		if err != nil {
			return err
		}
		defer region.Close()
		srv, err := NewServer(region, path, Options{})
		if err != nil {
			return err
		}
		go srv.Serve()
		fmt.Println("ready")
		_, _ = io.Copy(io.Discard, os.Stdin)
		return srv.Close()
	}
	return fmt.Errorf("unknown role %q", role)
}

// child is a running child process of this test binary.
type child struct {
	t      *testing.T
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string
	stderr *bytes.Buffer
}

func startChild(t *testing.T, b *testutil.Backend, role, socket string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChild+"="+role, envBackend+"="+b.Name,
		fmt.Sprintf("%s=%d", envSimDevices, b.Sys.DeviceCount()), envSocket+"="+socket)
	if os.Getenv("GORACE") == "" {
		cmd.Env = append(cmd.Env, "GORACE=atexit_sleep_ms=0")
	}
	c := &child{t: t, cmd: cmd, lines: make(chan string, 16), stderr: &bytes.Buffer{}}
	cmd.Stderr = c.stderr
	var err error
	c.stdin, err = cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		close(c.lines)
	}()
	t.Cleanup(func() {
		if c.cmd.ProcessState == nil {
			_ = c.cmd.Process.Kill()
			_ = c.cmd.Wait()
		}
	})
	return c
}

func (c *child) line() string {
	c.t.Helper()
	select {
	case l, ok := <-c.lines:
		if !ok {
			_ = c.cmd.Wait()
			c.t.Fatalf("the child ended without a line; stderr:\n%s", c.stderr)
		}
		return l
	case <-time.After(2 * time.Minute):
		c.t.Fatalf("no line from the child in 2 minutes; stderr:\n%s", c.stderr)
	}
	return ""
}

// kill sends SIGKILL and reaps the child.
func (c *child) kill() {
	c.t.Helper()
	require.NoError(c.t, c.cmd.Process.Signal(syscall.SIGKILL))
	err := c.cmd.Wait()
	var ee *exec.ExitError
	require.ErrorAs(c.t, err, &ee)
	require.Equal(c.t, syscall.SIGKILL, ee.Sys().(syscall.WaitStatus).Signal())
	for range c.lines {
	}
}

// stop closes the child's stdin and waits for a clean exit.
func (c *child) stop() {
	c.t.Helper()
	c.stdin.Close()
	for range c.lines {
	}
	require.NoError(c.t, c.cmd.Wait(), "child stderr:\n%s", c.stderr)
}

// A worker process killed with SIGKILL while its copies are in flight: the broker drains them,
// releases its buffer and goes on serving the other worker.
func TestWorkerKilled(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 8*mib, pinned.Options{})
		srv, path := startServer(t, region, Options{})
		stay := dial(t, path)
		stayBuf := newDevBuffer(t, dev, 1, 2*mib)
		srb, err := stay.Register(ctx, stayBuf)
		require.NoError(t, err)

		w := startChild(t, b, "worker", path)
		require.Equal(t, "registered", w.line())
		require.Equal(t, "busy", w.line())
		require.Equal(t, 2, srv.Stats().Buffers)
		sawInFlight := false
		for i := 0; i < 1000 && !sawInFlight; i++ {
			sawInFlight = srv.Stats().InFlight > 0
		}
		t.Logf("copies in flight seen before the kill: %v", sawInFlight)
		w.kill()
		eventually(t, "the broker to drain the killed worker", func() bool {
			st := srv.Stats()
			return st.Workers == 1 && st.Buffers == 1 && st.InFlight == 0 && st.Drained == 1
		})
		require.GreaterOrEqual(t, srv.Stats().Copies, uint64(8), "the worker waited for 8 copies before it said busy")

		fillHost(region.Bytes()[:2*mib], 0, 51)
		require.NoError(t, stay.Copy(ctx, Request{Buffer: srb.ID(), Dir: ToDevice, Length: 2 * mib}))
		requireDevicePattern(t, dev, stayBuf.Ptr(), 2*mib, 0, 51)
	})
}

// The broker process killed under a connected worker: pending and later requests fail with
// ErrBrokerGone wrapping the I/O error, and the worker reconnects to a new broker on the same path.
func TestBrokerKilled(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		buf := newDevBuffer(t, dev, 2, 2*mib)
		path := filepath.Join(t.TempDir(), "broker.sock")
		br := startChild(t, b, "broker", path)
		require.Equal(t, "ready", br.line())

		c, err := Dial(path)
		require.NoError(t, err)
		require.Equal(t, int32(br.cmd.Process.Pid), c.Info().Server.Pid)
		rb, err := c.Register(ctx, buf)
		require.NoError(t, err)
		require.NoError(t, dev.Fill(buf.Ptr(), 4*mib, 0, 61))
		require.NoError(t, c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToHost, Length: 4 * mib}))

		br.kill()
		err = c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToDevice, Length: 4 * mib})
		require.ErrorIs(t, err, ErrBrokerGone)
		require.True(t, errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE),
			"the I/O error is wrapped too: %v", err)
		require.ErrorIs(t, c.Ping(ctx), ErrBrokerGone)
		_, err = c.Register(ctx, buf)
		require.ErrorIs(t, err, ErrBrokerGone)
		require.NoError(t, c.Close())

		// A new broker on the same path (the dead one's socket file is replaced).
		br2 := startChild(t, b, "broker", path)
		dctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		c2, err := DialContext(dctx, path, DialOptions{Retry: true})
		require.NoError(t, err)
		require.Equal(t, "ready", br2.line())
		require.Equal(t, int32(br2.cmd.Process.Pid), c2.Info().Server.Pid)
		rb2, err := c2.Register(ctx, buf)
		require.NoError(t, err)
		view, err := c2.Region(ctx, dev, pinned.OpenOptions{})
		require.NoError(t, err)
		fillHost(view.Bytes()[4*mib:8*mib], 0, 62)
		require.NoError(t, c2.Copy(ctx, Request{Buffer: rb2.ID(), Dir: ToDevice, HostOffset: 4 * mib, Length: 4 * mib}))
		requireDevicePattern(t, dev, buf.Ptr(), 4*mib, 0, 62)
		require.NoError(t, dev.Fill(buf.Ptr(), 4*mib, 0, 63))
		require.NoError(t, c2.Copy(ctx, Request{Buffer: rb2.ID(), Dir: ToHost, Length: 4 * mib}))
		require.Zero(t, badHost(view.Bytes()[:4*mib], 0, 63))
		require.NoError(t, view.Close())
		require.NoError(t, rb2.Close())
		require.NoError(t, c2.Close())
		br2.stop()
	})
}
