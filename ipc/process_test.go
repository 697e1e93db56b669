package ipc_test

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// The two-process tests re-execute this test binary as the child (so they run on a GPU host that
// has no Go toolchain). The child's role is in CUVMM_IPC_CHILD; TestMain runs it instead of the tests.
const (
	envChild     = "CUVMM_IPC_CHILD"
	envHost      = "CUVMM_IPC_HOST"
	envSocket    = "CUVMM_IPC_SOCKET"
	envSeed      = "CUVMM_IPC_SEED"
	envChildSeed = "CUVMM_IPC_CHILD_SEED"
)

// TestMain runs the child's role when one is named, and otherwise the tests, followed in builds with
// the cuvmmleak tag by the report of objects that were never closed.
func TestMain(m *testing.M) {
	if role := os.Getenv(envChild); role != "" {
		if err := childMain(role); err != nil {
			fmt.Fprintf(os.Stderr, "ipc test child (%s): %v\n", role, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(testutil.Main(m))
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
	dev, closeSys, err := testutil.ChildDevice()
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

// startChild runs this test binary as a child in role, with b's backend, extra environment and
// extra files (descriptor 3 onwards).
func startChild(t *testing.T, b *testutil.Backend, role string, env []string, files ...*os.File) *testutil.Child {
	t.Helper()
	return testutil.StartChild(t, b, append([]string{envChild + "=" + role}, env...), files...)
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
				require.NoError(t, err, "child stderr:\n%s", c.Stderr())
				require.Equal(t, ipc.KindUser, kind)
				require.Empty(t, files)
				var res childResult
				require.NoError(t, json.Unmarshal(payload, &res))
				require.Equal(t, childResult{Chunks: 4, Size: 8 * mib, CPUWordOK: host}, res)
				c.Wait()
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
		require.Equal(t, "ready", c.Line())
		cl, err := ipc.Dial(path)
		require.NoError(t, err)
		require.Equal(t, int32(c.Pid()), cl.Server().Pid)
		_, err = cl.Fetch("other")
		require.ErrorIs(t, err, ipc.ErrNotFound)
		buf, err := cl.Open(dev, "child-buffer")
		require.NoError(t, err)
		require.NoError(t, cl.Close())
		verifyChunks(t, dev, buf, 51)

		c.Send("close")
		require.Equal(t, "closed", c.Line())
		verifyChunks(t, dev, buf, 51)
		c.Wait()
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
		require.NoError(t, json.Unmarshal([]byte(c.Line()), &pub))
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
		c.Send("check 62")
		require.Equal(t, "mismatches 0", c.Line())
		require.NoError(t, buf.Close())
		c.Wait()

		// The process is gone now.
		_, err = ipc.ReceiveFromPID(pub.PID, pub.FDs, desc)
		require.ErrorIs(t, err, ipc.ErrNoProcess)
	})
}
