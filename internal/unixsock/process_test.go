package unixsock

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// The descriptor-limit tests run the server in a second process (this test binary re-executed) so
// that lowering RLIMIT_NOFILE does not starve the test process.
const (
	envRole     = "CUVMM_UNIXSOCK_CHILD"
	envPath     = "CUVMM_UNIXSOCK_PATH"
	envMaxConns = "CUVMM_UNIXSOCK_MAXCONNS"
	childNoFile = 120
	childIdle   = 500 * time.Millisecond
)

func TestMain(m *testing.M) {
	if os.Getenv(envRole) != "" {
		if err := childServer(); err != nil {
			fmt.Fprintln(os.Stderr, "unixsock child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// childReport is what the server process says when its stdin closes.
type childReport struct {
	MaxActive int    `json:"max_active"`
	Refused   uint64 `json:"refused"`
	Backoffs  uint64 `json:"backoffs"`
	LogLines  int64  `json:"log_lines"`
	Seconds   float64
}

func childServer() error {
	lim := unix.Rlimit{Cur: childNoFile, Max: childNoFile}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return err
	}
	maxConns, _ := strconv.Atoi(os.Getenv(envMaxConns))
	var lines atomic.Int64
	l, err := Listen(os.Getenv(envPath), Options{MaxConns: maxConns, MaxConnsPerUID: maxConns, IdleTimeout: childIdle,
		Refuse: func(c *Conn, err error) { _ = c.Write(0xffff, []byte(err.Error()), nil) },
		Logf:   func(string, ...any) { lines.Add(1) }})
	if err != nil {
		return err
	}
	start := time.Now()
	go l.Serve(echo(nil))
	var maxActive atomic.Int64
	go func() {
		for {
			maxActive.Store(max(maxActive.Load(), int64(l.Stats().Active)))
			time.Sleep(2 * time.Millisecond)
		}
	}()
	fmt.Println("ready")
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	st := l.Stats()
	rep := childReport{MaxActive: int(maxActive.Load()), Refused: st.Refused, Backoffs: st.Backoffs, LogLines: lines.Load(),
		Seconds: time.Since(start).Seconds()}
	_ = l.Close()
	return json.NewEncoder(os.Stdout).Encode(rep)
}

// startServerProcess runs childServer with maxConns and returns its socket path, a function that
// ends it and returns its report.
func startServerProcess(t *testing.T, maxConns int) (string, func() childReport) {
	path := filepath.Join(privateDir(t), "s.sock")
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envRole+"=1", envPath+"="+path, envMaxConns+"="+strconv.Itoa(maxConns), "GORACE=atexit_sleep_ms=0")
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	out := bufio.NewReader(stdout)
	line, err := out.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "ready\n", line)
	return path, func() childReport {
		stdin.Close()
		var rep childReport
		require.NoError(t, json.NewDecoder(out).Decode(&rep))
		require.NoError(t, cmd.Wait())
		return rep
	}
}

// flood opens n connections that never send anything.
func flood(t *testing.T, path string, n int) {
	for range n {
		c, err := net.Dial("unix", path)
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
	}
}

// served dials until the server answers a ping (a refusal or a drop means try again) and reports
// how long it took.
func served(t *testing.T, path string, within time.Duration) time.Duration {
	start := time.Now()
	for time.Since(start) < within {
		c, err := Dial(context.Background(), path, DialOptions{})
		require.NoError(t, err)
		_ = c.Write(9, []byte("ping"), nil)
		_ = c.Unix().SetReadDeadline(time.Now().Add(within))
		f, err := c.Read()
		c.Close()
		if err == nil && f.Kind == 9 {
			return time.Since(start)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("not served within %v", within)
	return 0
}

// With RLIMIT_NOFILE at 120 and 200 idle peers, the cap (50) holds, the server never runs out of
// descriptors, and a real client is served once the idle timeout has dropped the silent ones.
func TestConnectionCapUnderLowDescriptorLimit(t *testing.T) {
	path, end := startServerProcess(t, 50)
	flood(t, path, 200)
	took := served(t, path, 5*time.Second)
	rep := end()
	t.Logf("served after %v; %+v", took, rep)
	require.LessOrEqual(t, rep.MaxActive, 50)
	require.GreaterOrEqual(t, rep.Refused, uint64(150))
	require.Zero(t, rep.Backoffs, "the cap keeps the server below its descriptor limit")
	require.Less(t, took, 4*childIdle)
	require.LessOrEqual(t, rep.LogLines, int64(rep.Seconds)+2, "refusals are logged at most once a second")
}

// With a cap above the descriptor limit, accept fails with EMFILE: the loop pauses and logs about
// once a second instead of spinning, and serves again once the idle peers are dropped.
func TestAcceptBacksOffUnderRealEMFILE(t *testing.T) {
	path, end := startServerProcess(t, 1000)
	flood(t, path, 200)
	served(t, path, 5*time.Second)
	time.Sleep(500 * time.Millisecond)
	rep := end()
	t.Logf("%+v", rep)
	require.NotZero(t, rep.Backoffs, "the flood ran the server out of descriptors")
	require.LessOrEqual(t, rep.LogLines, int64(rep.Seconds)+2, "at most one accept line a second")
	require.Less(t, rep.Backoffs, uint64(100*rep.Seconds), "no busy loop")
}
