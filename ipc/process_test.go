package ipc_test

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// The two-process tests re-execute this test binary as the child (so they run on a GPU host that
// has no Go toolchain). The child's role is in CUVMM_IPC_CHILD; TestMain runs it instead of the tests.
const (
	envChild      = "CUVMM_IPC_CHILD"
	envBackend    = "CUVMM_IPC_BACKEND"
	envSimDevices = "CUVMM_IPC_SIM_DEVICES"
	envHost       = "CUVMM_IPC_HOST"
	envSocket     = "CUVMM_IPC_SOCKET"
	envSeed       = "CUVMM_IPC_SEED"
	envChildSeed  = "CUVMM_IPC_CHILD_SEED"
)

func TestMain(m *testing.M) {
	if role := os.Getenv(envChild); role != "" {
		if err := childMain(role); err != nil {
			fmt.Fprintf(os.Stderr, "ipc test child (%s): %v\n", role, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// childResult is what the receiving child reports to its parent.
type childResult struct {
	Chunks     int    `json:"chunks"`
	Size       uint64 `json:"size"`
	Mismatches uint64 `json:"mismatches"`
	CPUWordOK  bool   `json:"cpu_word_ok"`
}

func envUint(name string) uint64 {
	v, _ := strconv.ParseUint(os.Getenv(name), 10, 64)
	return v
}

// childSystem opens the backend the parent names: its own simulator (whose memfd-backed memory
// makes the parent's FDs importable) or the real driver.
func childSystem() (*vmm.Device, func() error, error) {
	var sys *vmm.System
	var closeSim func() error
	switch b := os.Getenv(envBackend); b {
	case "sim":
		s := sim.New(sim.Devices(int(envUint(envSimDevices))))
		var err error
		if sys, err = vmm.Open(s); err != nil {
			return nil, nil, err
		}
		closeSim = s.Close
	case "cuda":
		api, err := driver.Open()
		if err != nil {
			return nil, nil, err
		}
		if sys, err = vmm.Open(api); err != nil {
			return nil, nil, err
		}
	default:
		return nil, nil, fmt.Errorf("%s=%q", envBackend, b)
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

// childBuffer maps three 2 MiB chunks of the device's memory and fills them with seed.
func childBuffer(dev *vmm.Device, seed uint64) (*vmm.Reservation, error) {
	res, err := dev.System().Reserve(6*mib, vmm.ReserveOptions{})
	if err != nil {
		return nil, err
	}
	for off := uint64(0); off < 6*mib; off += 2 * mib {
		if _, err := res.MapNew(off, 2*mib, dev, vmm.AllocOptions{HandleTypes: driver.HandleTypePosixFD}, vmm.ReadWrite(dev)); err != nil {
			return nil, err
		}
	}
	return res, dev.Fill(res.Ptr(), 6*mib, 0, seed)
}

func closeChildBuffer(res *vmm.Reservation) error {
	if err := res.UnmapRange(0, 6*mib); err != nil {
		return err
	}
	return res.Close()
}

func childMain(role string) error {
	dev, closeSys, err := childSystem()
	if err != nil {
		return err
	}
	defer func() {
		if cerr := closeSys(); cerr != nil {
			fmt.Fprintf(os.Stderr, "ipc test child: close: %v\n", cerr)
			os.Exit(1)
		}
	}()
	stdin := bufio.NewScanner(os.Stdin)
	switch role {
	case "receive":
		// Receive over the socket the parent passed as descriptor 3, open, check, write, report.
		f := os.NewFile(3, "socket")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			return err
		}
		conn := c.(*net.UnixConn)
		defer conn.Close()
		r, err := ipc.Receive(conn)
		if err != nil {
			return err
		}
		access := []vmm.Access{vmm.ReadWrite(dev)}
		if os.Getenv(envHost) == "1" {
			access = append(access, vmm.HostReadWrite())
		}
		buf, err := ipc.Open(dev, r, access...)
		r.Close()
		if err != nil {
			return err
		}
		defer buf.Close()
		res := childResult{Chunks: len(buf.Chunks()), Size: buf.Len()}
		for _, ch := range buf.Chunks() {
			bad, err := dev.Verify(buf.Ptr()+driver.DevicePtr(ch.Offset), ch.Allocation.Size(), ch.Offset, envUint(envSeed))
			if err != nil {
				return err
			}
			res.Mismatches += bad
		}
		if os.Getenv(envHost) == "1" {
			res.CPUWordOK = hostWord(buf.Ptr()+8) == expectWord(1, envUint(envSeed))
		}
		for _, ch := range buf.Chunks() {
			if err := dev.Fill(buf.Ptr()+driver.DevicePtr(ch.Offset), ch.Allocation.Size(), ch.Offset, envUint(envChildSeed)); err != nil {
				return err
			}
		}
		payload, _ := json.Marshal(res)
		if err := ipc.WriteMessage(conn, ipc.KindUser, payload, nil); err != nil {
			return err
		}
		return buf.Close()

	case "serve":
		// Export a buffer through a server; on "close", unpublish and free everything, then wait.
		res, err := childBuffer(dev, envUint(envSeed))
		if err != nil {
			return err
		}
		s, err := ipc.Listen(os.Getenv(envSocket), ipc.ServerOptions{})
		if err != nil {
			return err
		}
		go s.Serve()
		if err := s.Publish("child-buffer", ipc.FromReservation(res)); err != nil {
			return err
		}
		fmt.Println("ready")
		if !stdin.Scan() || stdin.Text() != "close" {
			return fmt.Errorf("want close on stdin, got %q", stdin.Text())
		}
		if err := errors.Join(s.Unpublish("child-buffer"), closeChildBuffer(res), s.Close()); err != nil {
			return err
		}
		fmt.Println("closed")
		for stdin.Scan() {
		}
		return nil

	case "publish-pid":
		// Publish (pid, fds) and the descriptor on stdout; check the parent's writes on request.
		res, err := childBuffer(dev, envUint(envSeed))
		if err != nil {
			return err
		}
		e, err := ipc.Export(ipc.FromReservation(res))
		if err != nil {
			return err
		}
		desc, err := e.Desc.MarshalBinary()
		if err != nil {
			return err
		}
		line, _ := json.Marshal(map[string]any{"pid": os.Getpid(), "fds": e.FDs(), "desc": base64.StdEncoding.EncodeToString(desc)})
		fmt.Println(string(line))
		for stdin.Scan() {
			var seed uint64
			if _, err := fmt.Sscanf(stdin.Text(), "check %d", &seed); err != nil {
				return fmt.Errorf("stdin %q: %w", stdin.Text(), err)
			}
			bad, err := dev.Verify(res.Ptr(), 6*mib, 0, seed)
			if err != nil {
				return err
			}
			fmt.Printf("mismatches %d\n", bad)
		}
		return errors.Join(e.Close(), closeChildBuffer(res))
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

// startChild runs this test binary as a child in role, with b's backend, extra environment and
// extra files (descriptor 3 onwards).
func startChild(t *testing.T, b *testutil.Backend, role string, env []string, files ...*os.File) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChild+"="+role, envBackend+"="+b.Name, fmt.Sprintf("%s=%d", envSimDevices, b.Sys.DeviceCount()))
	cmd.Env = append(cmd.Env, env...)
	if os.Getenv("GORACE") == "" {
		// Under -race the child would otherwise sleep a second at exit (TSan's atexit_sleep_ms).
		cmd.Env = append(cmd.Env, "GORACE=atexit_sleep_ms=0")
	}
	cmd.ExtraFiles = files
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

// line waits for the child's next stdout line.
func (c *child) line() string {
	c.t.Helper()
	select {
	case l, ok := <-c.lines:
		if !ok {
			c.t.Fatalf("the child ended without a line; stderr:\n%s", c.stderr)
		}
		return l
	case <-time.After(2 * time.Minute):
		c.t.Fatalf("no line from the child in 2 minutes; stderr:\n%s", c.stderr)
	}
	return ""
}

func (c *child) send(line string) {
	c.t.Helper()
	_, err := fmt.Fprintln(c.stdin, line)
	require.NoError(c.t, err)
}

// wait closes the child's stdin and waits for it to exit successfully.
func (c *child) wait() {
	c.t.Helper()
	c.stdin.Close()
	for range c.lines {
	}
	require.NoError(c.t, c.cmd.Wait(), "child stderr:\n%s", c.stderr)
}

// The parent exports, the child imports, checks the parent's pattern and writes its own, which the
// parent then sees: device and host-NUMA memory.
func TestTwoProcessShare(t *testing.T) {
	for _, host := range []bool{false, true} {
		name := map[bool]string{false: "device", true: "host"}[host]
		t.Run(name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				dev := b.Device(t, 0)
				loc := driver.Location{}
				if host {
					if dev.HostNUMAID() < 0 || !dev.Supports(driver.AttrHostNUMAVirtualMemoryManagementSupported) {
						t.Skip("device reports no host-NUMA VMM support")
					}
					loc = driver.HostNUMALocation(dev.HostNUMAID())
				}
				src := newBuffer(t, dev, 4, 2*mib, loc, 41)
				fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
				require.NoError(t, err)
				conn := fileConn(t, fds[0])
				defer conn.Close()
				theirs := os.NewFile(uintptr(fds[1]), "child-socket")
				env := []string{envSeed + "=41", envChildSeed + "=42"}
				if host {
					env = append(env, envHost+"=1")
				}
				c := startChild(t, b, "receive", env, theirs)
				require.NoError(t, theirs.Close())

				e, err := ipc.Export(src)
				require.NoError(t, err)
				require.NoError(t, ipc.Send(conn, e))
				require.NoError(t, e.Close())
				require.NoError(t, conn.SetReadDeadline(time.Now().Add(2*time.Minute)))
				kind, payload, files, err := ipc.ReadMessage(conn)
				require.NoError(t, err, "child stderr:\n%s", c.stderr)
				require.Equal(t, ipc.KindUser, kind)
				require.Empty(t, files)
				var res childResult
				require.NoError(t, json.Unmarshal(payload, &res))
				require.Equal(t, childResult{Chunks: 4, Size: 8 * mib, CPUWordOK: host}, res)
				c.wait()
				// The child has unmapped and exited; its writes are in the memory.
				verifyChunks(t, dev, src, 42)
			})
		})
	}
}

// The exporter (a child with a Server) closes its buffer and exits: the importer's mapping stays
// valid with the same content until it closes it.
func TestTwoProcessExporterCloses(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		path := filepath.Join(t.TempDir(), "child.sock")
		c := startChild(t, b, "serve", []string{envSocket + "=" + path, envSeed + "=51"})
		require.Equal(t, "ready", c.line())
		cl, err := ipc.Dial(path)
		require.NoError(t, err)
		require.Equal(t, int32(c.cmd.Process.Pid), cl.Server().Pid)
		_, err = cl.Fetch("other")
		require.ErrorIs(t, err, ipc.ErrNotFound)
		buf, err := cl.Open(dev, "child-buffer")
		require.NoError(t, err)
		require.NoError(t, cl.Close())
		verifyChunks(t, dev, buf, 51)

		c.send("close")
		require.Equal(t, "closed", c.line())
		verifyChunks(t, dev, buf, 51)
		c.wait()
		verifyChunks(t, dev, buf, 51)
		fillChunks(t, dev, buf, 52)
		verifyChunks(t, dev, buf, 52)
		require.NoError(t, buf.Close())
	})
}

// The pidfd path: the child publishes (pid, fds) and the parent takes the descriptors itself.
func TestTwoProcessPidfd(t *testing.T) {
	requirePidfd(t)
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		c := startChild(t, b, "publish-pid", []string{envSeed + "=61"})
		var pub struct {
			PID  int    `json:"pid"`
			FDs  []int  `json:"fds"`
			Desc string `json:"desc"`
		}
		require.NoError(t, json.Unmarshal([]byte(c.line()), &pub))
		raw, err := base64.StdEncoding.DecodeString(pub.Desc)
		require.NoError(t, err)
		var desc ipc.Descriptor
		require.NoError(t, desc.UnmarshalBinary(raw))
		r, err := ipc.ReceiveFromPID(pub.PID, pub.FDs, desc)
		if errors.Is(err, ipc.ErrPtrace) {
			scope, _ := os.ReadFile("/proc/sys/kernel/yama/ptrace_scope")
			t.Skipf("ptrace access to our own child is refused here (yama ptrace_scope %q): %v", strings.TrimSpace(string(scope)), err)
		}
		require.NoError(t, err)
		buf, err := ipc.Open(dev, r)
		require.NoError(t, r.Close())
		require.NoError(t, err)
		verifyChunks(t, dev, buf, 61)
		fillChunks(t, dev, buf, 62)
		c.send("check 62")
		require.Equal(t, "mismatches 0", c.line())
		require.NoError(t, buf.Close())
		c.wait()

		// The process is gone now.
		_, err = ipc.ReceiveFromPID(pub.PID, pub.FDs, desc)
		require.ErrorIs(t, err, ipc.ErrNoProcess)
	})
}
