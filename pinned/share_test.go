package pinned_test

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// Messages between the test and its child process.
const (
	kindChildResult = ipc.KindUser + 0x70
	kindChildDone   = ipc.KindUser + 0x71
)

// Environment of the child process (TestChildRegion).
const (
	envChild      = "CUVMM_PINNED_CHILD"       // "1" in the child
	envBackend    = "CUVMM_PINNED_BACKEND"     // "sim" or "cuda"
	envSimDevices = "CUVMM_PINNED_SIM_DEVICES" // devices of the child's simulator
	envGrant      = "CUVMM_PINNED_GRANT"       // "1": grant device 0; else CPU only
	envNoDevice   = "CUVMM_PINNED_NO_DEVICE"   // "1": open without a device (shared memory, CPU only)
)

const shareSize = 8 * mib

// childResult is what the child reports after opening the region.
type childResult struct {
	Error    string   `json:"error,omitempty"`
	Kind     string   `json:"kind"`
	CPUBad   int      `json:"cpu_bad"`
	GPUBad   uint64   `json:"gpu_bad"`
	Used     []int64  `json:"used"`     // device memory the open took, per device
	Estimate []uint64 `json:"estimate"` // the region's own estimate
	Context  bool     `json:"context"`  // whether the child made a CUDA context at all
}

// socketPair is a connected Unix stream pair: one end for this process, one (a file) for a child.
func socketPair(t testing.TB) (*net.UnixConn, *os.File) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	mine := os.NewFile(uintptr(fds[0]), "parent")
	defer mine.Close()
	c, err := net.FileConn(mine)
	require.NoError(t, err)
	return c.(*net.UnixConn), os.NewFile(uintptr(fds[1]), "child")
}

// Another process opens a region from its descriptor, granting device 0 or nothing: it sees the
// creator's bytes, its writes reach the creator, and a CPU-only opener costs no GPU memory.
func TestShareAcrossProcesses(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		kinds := []pinned.Kind{pinned.SharedMemory}
		if pinned.SupportsHostNUMA(d) {
			kinds = append([]pinned.Kind{pinned.HostNUMA}, kinds...)
		}
		for _, kind := range kinds {
			for _, grant := range []bool{true, false} {
				name := fmt.Sprintf("%s/grant=%v", kind, grant)
				t.Run(name, func(t *testing.T) {
					res := shareWithChild(t, b, d, kind, grant)
					require.Empty(t, res.Error)
					require.Equal(t, kind.String(), res.Kind)
					require.Zero(t, res.CPUBad, "the child's CPU sees the creator's bytes")
					require.Zero(t, res.GPUBad, "the child's GPU sees the creator's bytes")
					// One estimate per device of the child's system: the device it opened with is
					// device 0.
					est := pinned.PageTableCost(shareSize)
					want := make([]uint64, len(res.Estimate))
					require.NotEmpty(t, want)
					switch {
					case !grant:
						// CPU only: no device pays.
					case kind == pinned.HostNUMA:
						want[0] = est // granted to its device only
					default:
						for i := range want {
							want[i] = est // registered: every device
						}
					}
					require.Equal(t, want, res.Estimate)
					for i, u := range res.Used {
						if b.IsSim() {
							require.Equal(t, int64(res.Estimate[i]), u, "device %d: measured = estimated", i)
						} else if !grant {
							require.LessOrEqual(t, u, int64(2*mib), "device %d: a CPU-only opener costs nothing", i)
						}
					}
				})
			}
		}
	})
}

func shareWithChild(t *testing.T, b *testutil.Backend, d *vmm.Device, kind pinned.Kind, grant bool) childResult {
	r, err := pinned.New(d, shareSize, pinned.Options{Kind: kind})
	require.NoError(t, err)
	defer func() { require.NoError(t, r.Close()) }()
	fillCPU(r.Bytes()[:shareSize/2], 0, 21)

	// On a GPU the child's context (~524 MiB) is freed after it exits, not always before Wait
	// returns: wait for it, so that testutil's leak check does not count it.
	if !b.IsSim() {
		idle := freeMemory(t, b.Sys)
		defer waitFreeMemory(t, b.Sys, idle)
	}
	conn, childEnd := socketPair(t)
	defer conn.Close()
	exe, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.Command(exe, "-test.run=^TestChildRegion$", "-test.count=1")
	// GORACE: a race-enabled child otherwise sleeps a second at exit.
	cmd.Env = append(os.Environ(), "GORACE=atexit_sleep_ms=0", envChild+"=1", envBackend+"="+b.Name, envSimDevices+"=1",
		envGrant+"="+boolEnv(grant), envNoDevice+"="+boolEnv(kind == pinned.SharedMemory && !grant))
	var out lockedBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.ExtraFiles = []*os.File{childEnd}
	require.NoError(t, cmd.Start())
	require.NoError(t, childEnd.Close())
	waited := false
	defer func() {
		if !waited {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			t.Logf("child output:\n%s", out.String())
		}
	}()

	require.NoError(t, r.Share(conn))
	require.NoError(t, conn.SetDeadline(time.Now().Add(60*time.Second)))
	k, payload, files, err := ipc.ReadMessage(conn)
	require.NoError(t, err, "child output:\n%s", out.String())
	require.Empty(t, files)
	require.Equal(t, kindChildResult, k)
	var res childResult
	require.NoError(t, json.Unmarshal(payload, &res))
	if res.Error == "" {
		require.Zero(t, badWords(r.Bytes()[shareSize/2:], shareSize/2, 22), "the creator sees the child's writes")
	}
	require.NoError(t, ipc.WriteMessage(conn, kindChildDone, nil, nil))
	err = cmd.Wait()
	waited = true
	require.NoError(t, err, "child output:\n%s", out.String())
	return res
}

// lockedBuffer collects a child's output while the test may read it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// waitFreeMemory waits (up to 10 s) until every device has at least the free memory it had in idle,
// less 2 MiB.
func waitFreeMemory(t testing.TB, sys *vmm.System, idle []uint64) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		now := freeMemory(t, sys)
		ok := true
		for i := range idle {
			if now[i]+2*mib < idle[i] {
				ok = false
			}
		}
		if ok || time.Now().After(deadline) {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func boolEnv(b bool) string {
	if b {
		return "1"
	}
	return "0"
}

// TestChildRegion is the child process of TestShareAcrossProcesses; it skips when run directly.
func TestChildRegion(t *testing.T) {
	if os.Getenv(envChild) != "1" {
		t.Skip("helper process of TestShareAcrossProcesses")
	}
	f := os.NewFile(3, "parent")
	c, err := net.FileConn(f)
	require.NoError(t, err)
	f.Close()
	conn := c.(*net.UnixConn)
	defer conn.Close()
	reported, err := childOpen(conn)
	if err != nil && !reported {
		payload, _ := json.Marshal(childResult{Error: err.Error()})
		_ = ipc.WriteMessage(conn, kindChildResult, payload, nil)
	}
	require.NoError(t, err)
}

// childOpen opens the region the parent shares, checks it and waits for the parent's done message.
func childOpen(conn *net.UnixConn) (reported bool, err error) {
	var res childResult
	fail := func(err error) (bool, error) { return reported, err }
	var api driver.API
	if os.Getenv(envBackend) == "sim" {
		n, _ := strconv.Atoi(os.Getenv(envSimDevices))
		s := sim.New(sim.Devices(n))
		defer s.Close()
		api = s
	} else {
		var err error
		if api, err = driver.Open(); err != nil {
			return fail(err)
		}
	}
	var sys *vmm.System
	sys, err = vmm.Open(api)
	if err != nil {
		return fail(err)
	}
	defer sys.Close()
	grant := os.Getenv(envGrant) == "1"
	var d *vmm.Device
	var before []uint64
	if os.Getenv(envNoDevice) != "1" {
		res.Context = true
		if d, err = sys.Device(0); err != nil {
			return fail(err)
		}
		if err := d.LoadKernels(); err != nil {
			return fail(err)
		}
		if before, err = freeAll(sys); err != nil {
			return fail(err)
		}
	}
	opts := pinned.OpenOptions{}
	if grant {
		opts.Grant = []*vmm.Device{d}
	}
	r, err := pinned.Receive(conn, d, opts)
	if err != nil {
		return fail(err)
	}
	defer r.Close()
	res.Kind = r.Kind().String()
	if d != nil {
		after, err := freeAll(sys)
		if err != nil {
			return fail(err)
		}
		res.Used = used(before, after)
		res.Estimate = r.PageTableCost()
	} else {
		res.Used, res.Estimate = []int64{0}, []uint64{0}
		if r.PageTableCost() != nil {
			return fail(fmt.Errorf("a region opened without a driver reports a cost: %v", r.PageTableCost()))
		}
	}
	res.CPUBad = badWords(r.Bytes()[:shareSize/2], 0, 21)
	if grant {
		if res.GPUBad, err = d.Verify(r.Ptr(), shareSize/2, 0, 21); err != nil {
			return fail(err)
		}
		if err := d.Fill(r.Ptr()+shareSize/2, shareSize/2, shareSize/2, 22); err != nil {
			return fail(err)
		}
	} else {
		fillCPU(r.Bytes()[shareSize/2:], shareSize/2, 22)
	}
	// Report, then hold the region until the parent has checked the writes.
	payload, _ := json.Marshal(res)
	if err := ipc.WriteMessage(conn, kindChildResult, payload, nil); err != nil {
		return fail(err)
	}
	reported = true
	if k, _, _, err := ipc.ReadMessage(conn); err != nil || k != kindChildDone {
		return fail(fmt.Errorf("waiting for the parent: kind %d, %v", k, err))
	}
	return true, r.Close()
}

func freeAll(sys *vmm.System) ([]uint64, error) {
	devs, err := sys.Devices()
	if err != nil {
		return nil, err
	}
	out := make([]uint64, len(devs))
	for i, d := range devs {
		if err := d.Synchronize(); err != nil {
			return nil, err
		}
		if out[i], _, err = d.MemInfo(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// Receive refuses malformed messages, closing every descriptor that came with them (the leak check
// of testutil counts open descriptors).
func TestReceiveBadInput(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		conn, other := socketPair(t)
		defer conn.Close()
		peerConn, err := net.FileConn(other)
		require.NoError(t, err)
		require.NoError(t, other.Close())
		peer := peerConn.(*net.UnixConn)
		defer peer.Close()

		header := func(kind pinned.Kind, size uint64) []byte {
			h := make([]byte, 16)
			binary.LittleEndian.PutUint32(h, uint32(kind))
			binary.LittleEndian.PutUint64(h[8:], size)
			return h
		}
		memfd := func(size int64) *os.File {
			fd, err := unix.MemfdCreate("bad", unix.MFD_CLOEXEC)
			require.NoError(t, err)
			require.NoError(t, unix.Ftruncate(fd, size))
			return os.NewFile(uintptr(fd), "bad")
		}
		small := memfd(4096)
		defer small.Close()
		for _, c := range []struct {
			name    string
			kind    uint16
			payload []byte
			files   []*os.File
		}{
			{"another message kind", ipc.KindUser + 1, header(pinned.SharedMemory, 4096), []*os.File{small}},
			{"short header", pinned.KindRegion, []byte{1, 2, 3}, nil},
			{"reserved field set", pinned.KindRegion, append(header(pinned.SharedMemory, 4096)[:4], 1, 0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0), []*os.File{small}},
			{"size 0", pinned.KindRegion, header(pinned.SharedMemory, 0), []*os.File{small}},
			{"shared memory without its memfd", pinned.KindRegion, header(pinned.SharedMemory, 4096), nil},
			{"a memfd smaller than the region", pinned.KindRegion, header(pinned.SharedMemory, 8192), []*os.File{small}},
			{"an unaligned size", pinned.KindRegion, header(pinned.SharedMemory, 100), []*os.File{small}},
			{"registered memory", pinned.KindRegion, header(pinned.Registered, 4096), nil},
			{"host-NUMA with a file in the header", pinned.KindRegion, header(pinned.HostNUMA, 2*mib), []*os.File{small}},
		} {
			require.NoError(t, ipc.WriteMessage(peer, c.kind, c.payload, c.files), c.name)
			_, err := pinned.Receive(conn, d, pinned.OpenOptions{})
			require.ErrorIs(t, err, ipc.ErrProtocol, c.name)
		}

		// A well-formed shared-memory region opened in the same process: same bytes, new view.
		r, err := pinned.New(d, 64*kib, pinned.Options{Kind: pinned.SharedMemory})
		require.NoError(t, err)
		fillCPU(r.Bytes(), 0, 31)
		require.NoError(t, r.Share(peer))
		r2, err := pinned.Receive(conn, nil, pinned.OpenOptions{})
		require.NoError(t, err)
		require.True(t, r2.Imported())
		require.Nil(t, r2.Device(), "opened for the CPU without a device")
		require.NotEqual(t, r.Ptr(), r2.Ptr())
		require.Zero(t, badWords(r2.Bytes(), 0, 31))
		require.Empty(t, r2.Devices())
		err = r2.Grant(d)
		require.ErrorIs(t, err, pinned.ErrNotSupported, "only host-NUMA access is granted, also with no System")
		require.NoError(t, r2.Share(peer), "an opened region can be shared on")
		r3, err := pinned.Receive(conn, nil, pinned.OpenOptions{})
		require.NoError(t, err)
		require.Zero(t, badWords(r3.Bytes(), 0, 31))
		require.NoError(t, r3.Close())
		require.NoError(t, r2.Close())

		if pinned.SupportsHostNUMA(d) {
			h, err := pinned.New(d, 2*mib, pinned.Options{Kind: pinned.HostNUMA})
			require.NoError(t, err)
			// Without a device to import through: refused, and the stream stays in step.
			require.NoError(t, h.Share(peer))
			_, err = pinned.Receive(conn, nil, pinned.OpenOptions{})
			require.ErrorIs(t, err, pinned.ErrInvalidValue)
			require.NoError(t, h.Share(peer))
			h2, err := pinned.Receive(conn, nil, pinned.OpenOptions{Grant: []*vmm.Device{d}})
			require.NoError(t, err)
			require.Equal(t, pinned.HostNUMA, h2.Kind())
			require.Equal(t, []int{0}, h2.Devices())
			require.Len(t, h2.Chunks(), 1)
			require.NoError(t, d.Fill(h2.Ptr(), h2.Len(), 0, 32))
			require.Zero(t, badWords(h.Bytes(), 0, 32), "the same memory")
			require.NoError(t, h2.Revoke(d))
			require.Empty(t, h2.Devices())
			require.NoError(t, h2.Close())
			require.Empty(t, h2.Chunks(), "a closed region has none")
			_, err = ipc.Export(h2)
			require.ErrorIs(t, err, pinned.ErrInvalidValue, "nothing to export once closed")
			chunked := make(chan []vmm.Chunk)
			go func() { chunked <- h.Chunks() }() // with -race: Chunks against Close
			require.NoError(t, h.Close())
			<-chunked
		}

		require.NoError(t, r.Close())
		require.ErrorIs(t, r.Share(peer), pinned.ErrClosed)
		require.NoError(t, peer.Close())
		_, err = pinned.Receive(conn, d, pinned.OpenOptions{})
		require.ErrorIs(t, err, io.EOF, "the peer went away")
	})
}
