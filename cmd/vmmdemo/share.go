package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/kernels"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

func init() {
	register(&command{name: "share", summary: "share a buffer of N chunks with a second process over a Unix socket (export, import, map, both sides verify)",
		run: runShare, tour: []string{"--size", "16MiB", "--chunks", "4"}})
	// The second process of share; not in the tour.
	register(&command{name: "share-child", summary: "(internal) the second process of share", run: runShareChild})
}

// Messages between share and share-child, besides the buffer itself (ipc.Send).
const (
	kindReady  = ipc.KindUser + 1 // child → parent: backend open, kernels loaded
	kindRound  = ipc.KindUser + 2 // parent → child: the seeds of the next round (JSON shareRound)
	kindMapped = ipc.KindUser + 3 // child → parent: the buffer is mapped (JSON shareMapped)
	kindDone   = ipc.KindUser + 4 // child → parent: verified and written (JSON shareDone)
	kindBye    = ipc.KindUser + 5 // parent → child: no more rounds
	kindFailed = ipc.KindUser + 6 // child → parent: the error text
	kindVerify = ipc.KindUser + 7 // parent → child: timing done, verify and write now
)

type shareRound struct {
	ParentSeed uint64 `json:"parent_seed"`
	ChildSeed  uint64 `json:"child_seed"`
}

type shareMapped struct {
	ImportMapUS float64 `json:"import_map_us"`
}

type shareDone struct {
	Mismatches uint64 `json:"mismatches"`
}

type shareResult struct {
	Backend    string `json:"backend"`
	Location   string `json:"location"`
	SizeBytes  uint64 `json:"size_bytes"`
	Chunks     int    `json:"chunks"`
	HandleType string `json:"handle_type"`
	// FabricSupported is the device attribute; handle_type says whether the driver granted it.
	FabricSupported bool `json:"fabric_supported"`
	// The times of the round with the median round trip.
	ExportUS    float64 `json:"export_us"`
	SendUS      float64 `json:"send_us"`
	ImportMapUS float64 `json:"import_map_us"`
	RoundTripUS float64 `json:"round_trip_us"`
	// FirstRoundTripUS includes one-time costs (the driver's first export in this process).
	FirstRoundTripUS float64 `json:"first_round_trip_us"`
	Rounds           int     `json:"rounds"`
	Verified         bool    `json:"verified"`
	// ChildPID is the second process's pid.
	ChildPID int `json:"child_pid"`
	// ChildAccess is what the child mapped the buffer for: "device" (read-write for its GPU) or
	// "cpu" (host memory granted to the CPU only).
	ChildAccess string `json:"child_access"`
}

type shareTimes struct{ export, send, importMap, roundTrip time.Duration }

func us(d time.Duration) float64 { return float64(d.Nanoseconds()/100) / 10 }

func runShare(e *env, args []string) error {
	var c common
	size := sizeFlag{256 << 20}
	fs := newFlags(e, "share")
	c.register(fs, 1)
	fs.Var(&size, "size", "buffer size (rounded up to whole chunks of the granularity)")
	chunks := fs.Int("chunks", 8, "number of chunks (allocations) in the buffer")
	location := fs.String("location", "device", "memory: device or host (host NUMA memory next to the device)")
	ordinal := fs.Int("device", 0, "device ordinal")
	rounds := fs.Int("rounds", 3, "how many times to share the buffer (times are of the median round)")
	childAccess := fs.String("child-access", "device", "what the child maps the buffer for: device (its GPU) or cpu (host memory only: the CPU reads and writes it, no GPU page tables)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *childAccess != "device" && *childAccess != "cpu" {
		return fmt.Errorf("--child-access %q: want device or cpu: %w", *childAccess, errUsage)
	}
	if *childAccess == "cpu" && *location != "host" {
		return fmt.Errorf("--child-access cpu needs --location host (the CPU cannot map device memory): %w", errUsage)
	}
	if *chunks < 1 || *chunks > ipc.MaxChunks {
		return fmt.Errorf("--chunks %d: want 1 to %d: %w", *chunks, ipc.MaxChunks, errUsage)
	}
	if *rounds < 1 {
		return fmt.Errorf("--rounds %d: want at least 1: %w", *rounds, errUsage)
	}
	if size.v == 0 {
		return fmt.Errorf("--size 0: %w", errUsage)
	}
	b, err := c.openLegacy(e)
	if err != nil {
		return err
	}
	defer b.Close()
	dev, err := b.sys.Device(*ordinal)
	if err != nil {
		return err
	}
	var loc, allocLoc driver.Location
	switch *location {
	case "device":
		loc = dev.Location()
	case "host":
		node := dev.HostNUMAID()
		if node < 0 || !dev.Supports(driver.AttrHostNUMAVirtualMemoryManagementSupported) {
			return fmt.Errorf("--location host: device %d reports no host-NUMA VMM support (host NUMA id %d): %w", *ordinal, node, driver.ErrNotSupported)
		}
		loc = driver.HostNUMALocation(node)
		allocLoc = loc
	default:
		return fmt.Errorf("--location %q: want device or host: %w", *location, errUsage)
	}

	// Handle types: FABRIC with POSIX_FD where the driver grants it, else POSIX_FD alone.
	types, err := ipc.HandleTypes(dev, allocLoc)
	if err != nil {
		return err
	}
	gran, err := dev.Granularity(loc, driver.GranularityMinimum)
	if err != nil {
		return err
	}
	n := uint64(*chunks)
	chunk, ok := units.RoundUp((size.v+n-1)/n, gran)
	if !ok || chunk > ^uint64(0)/n {
		return fmt.Errorf("--size %s in %d chunks overflows: %w", units.FormatSize(size.v), n, errUsage)
	}
	total := chunk * n

	// The buffer: one reservation, one allocation per chunk.
	res, err := b.sys.Reserve(total, vmm.ReserveOptions{})
	if err != nil {
		return err
	}
	defer func() {
		for _, m := range res.Mappings() {
			_ = m.Close()
		}
		_ = res.Close()
	}()
	for i := uint64(0); i < n; i++ {
		if _, err := res.MapNew(i*chunk, chunk, dev, vmm.AllocOptions{Location: allocLoc, HandleTypes: types}, vmm.ReadWrite(dev)); err != nil {
			return err
		}
	}
	if err := dev.LoadKernels(); err != nil {
		return err
	}

	// A private directory (0700) for the socket.
	dir, err := os.MkdirTemp("", "vmmdemo-share-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "share.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return err
	}
	defer ln.Close()

	childArgs := []string{"share-child", "--socket", sock, "--backend", b.name, "--sim-devices", strconv.Itoa(b.sys.DeviceCount()), "--device", strconv.Itoa(*ordinal), "--access", *childAccess}
	child, err := startShareChild(e, childArgs)
	if err != nil {
		return err
	}
	defer child.stop()

	conn, err := acceptChild(ln, child)
	if err != nil {
		return err
	}
	defer conn.Close()
	if err := expectChild(conn, kindReady, nil, 2*time.Minute); err != nil {
		return err
	}

	result := &shareResult{Backend: b.name, Location: loc.String(), SizeBytes: total, Chunks: *chunks, HandleType: types.String(),
		FabricSupported: dev.Supports(driver.AttrHandleTypeFabricSupported), Rounds: *rounds, ChildPID: child.pid(), ChildAccess: *childAccess, Verified: true}
	var times []shareTimes
	for round := 0; round < *rounds; round++ {
		seeds := shareRound{ParentSeed: 0x5eed0000 + uint64(round), ChildSeed: 0xc41d0000 + uint64(round)}
		if err := dev.Fill(res.Ptr(), total, 0, seeds.ParentSeed); err != nil {
			return err
		}
		payload, _ := json.Marshal(seeds)
		if err := ipc.WriteMessage(conn, kindRound, payload, nil); err != nil {
			return err
		}

		t0 := time.Now()
		exp, err := ipc.Export(ipc.FromReservation(res))
		if err != nil {
			return err
		}
		t1 := time.Now()
		err = ipc.Send(conn, exp)
		t2 := time.Now()
		var mapped shareMapped
		if err == nil {
			err = expectChild(conn, kindMapped, &mapped, time.Minute)
		}
		t3 := time.Now()
		// Closing the exported descriptors costs about 80 µs each on the H200: after the timing.
		if cerr := exp.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
		times = append(times, shareTimes{export: t1.Sub(t0), send: t2.Sub(t1), importMap: time.Duration(mapped.ImportMapUS * 1e3), roundTrip: t3.Sub(t0)})
		// The child verifies only now, so that its kernels do not compete with the timing above.
		if err := ipc.WriteMessage(conn, kindVerify, nil, nil); err != nil {
			return err
		}

		var done shareDone
		if err := expectChild(conn, kindDone, &done, 10*time.Minute); err != nil {
			return err
		}
		bad, err := dev.Verify(res.Ptr(), total, 0, seeds.ChildSeed)
		if err != nil {
			return err
		}
		if done.Mismatches != 0 || bad != 0 {
			result.Verified = false
			fmt.Fprintf(e.stderr, "vmmdemo share: round %d: the child found %d words of %d not matching the parent's pattern; the parent found %d not matching the child's\n",
				round+1, done.Mismatches, total/8, bad)
		}
	}
	if err := ipc.WriteMessage(conn, kindBye, nil, nil); err != nil {
		return err
	}
	if err := child.wait(); err != nil {
		return err
	}

	result.FirstRoundTripUS = us(times[0].roundTrip)
	sorted := slices.Clone(times)
	slices.SortFunc(sorted, func(a, b shareTimes) int { return int(a.roundTrip - b.roundTrip) })
	med := sorted[len(sorted)/2]
	result.ExportUS, result.SendUS, result.ImportMapUS, result.RoundTripUS = us(med.export), us(med.send), us(med.importMap), us(med.roundTrip)

	if c.json {
		if err := writeJSON(e.stdout, result); err != nil {
			return err
		}
	} else {
		printShare(e, result, chunk, child)
	}
	if !result.Verified {
		return errors.New("verification failed: the two processes do not see the same memory")
	}
	return nil
}

func printShare(e *env, r *shareResult, chunk uint64, child *shareChild) {
	w := e.stdout
	who := fmt.Sprintf("a second process (pid %d)", child.pid())
	fmt.Fprintf(w, "share: %s in %d chunks of %s at %s with %s, backend %s\n", units.FormatSize(r.SizeBytes), r.Chunks, units.FormatSize(chunk), r.Location, who, r.Backend)
	note := ""
	if r.FabricSupported && !strings.Contains(r.HandleType, "fabric") {
		note = " (the device reports fabric support; the driver refused it, so posix-fd alone)"
	}
	fmt.Fprintf(w, "  handle type %s%s\n", r.HandleType, note)
	fmt.Fprintf(w, "  export %.0f µs, send %.0f µs, import+map+access in the child %.0f µs: round trip %.0f µs (median of %d rounds; first round %.0f µs)\n",
		r.ExportUS, r.SendUS, r.ImportMapUS, r.RoundTripUS, r.Rounds, r.FirstRoundTripUS)
	status := "ok: the child saw the parent's pattern, the parent saw the child's"
	if !r.Verified {
		status = "FAILED"
	}
	fmt.Fprintf(w, "  verified: %s\n", status)
}

// expectChild reads the child's next message, which must be of kind want (kindFailed carries the
// child's error); its JSON payload goes into v.
func expectChild(conn *net.UnixConn, want uint16, v any, timeout time.Duration) error {
	_ = conn.SetReadDeadline(time.Now().Add(timeout))
	defer conn.SetReadDeadline(time.Time{})
	kind, payload, files, err := ipc.ReadMessage(conn)
	if err != nil {
		return fmt.Errorf("waiting for the child: %w", err)
	}
	for _, f := range files {
		f.Close()
	}
	if kind == kindFailed {
		return fmt.Errorf("child: %s", payload)
	}
	if kind != want || len(files) > 0 {
		return fmt.Errorf("child sent message kind %d with %d descriptors, want kind %d: %w", kind, len(files), want, ipc.ErrProtocol)
	}
	if v != nil {
		if err := json.Unmarshal(payload, v); err != nil {
			return fmt.Errorf("child message kind %d: %w", kind, err)
		}
	}
	return nil
}

// shareChild is the second process: this executable run as `vmmdemo share-child`. (Under go test
// the test binary's TestMain runs the subcommand, so the child is a real second process there too.)
type shareChild struct {
	cmd *exec.Cmd
}

// startShareChild starts `vmmdemo share-child` from this executable.
func startShareChild(e *env, args []string) (*shareChild, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("finding this executable to start the child: %w", err)
	}
	cmd := exec.Command(exe, args...)
	cmd.Stdout = e.stderr
	cmd.Stderr = e.stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting the child %s: %w", exe, err)
	}
	return &shareChild{cmd: cmd}, nil
}

func (c *shareChild) pid() int { return c.cmd.Process.Pid }

// wait waits for the child to finish after kindBye.
func (c *shareChild) wait() error {
	if err := c.cmd.Wait(); err != nil {
		return fmt.Errorf("child: %w", err)
	}
	return nil
}

// stop kills a child still running (after an error).
func (c *shareChild) stop() {
	if c.cmd.Process != nil && c.cmd.ProcessState == nil {
		_ = c.cmd.Process.Kill()
		_ = c.cmd.Wait()
	}
}

// acceptChild accepts the child's connection and checks, with SO_PEERCRED, that it is the child.
func acceptChild(ln *net.UnixListener, child *shareChild) (*net.UnixConn, error) {
	_ = ln.SetDeadline(time.Now().Add(2 * time.Minute))
	conn, err := ln.AcceptUnix()
	if err != nil {
		return nil, fmt.Errorf("waiting for the child to connect: %w", err)
	}
	rc, err := conn.SyscallConn()
	var cred *unix.Ucred
	if err == nil {
		cerr := rc.Control(func(fd uintptr) { cred, err = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) })
		if err == nil {
			err = cerr
		}
	}
	if err == nil && int(cred.Pid) != child.pid() {
		err = fmt.Errorf("the peer is pid %d, not the child (pid %d): %w", cred.Pid, child.pid(), ipc.ErrPermission)
	}
	if err != nil {
		conn.Close()
		return nil, err
	}
	return conn, nil
}

// runShareChild is `vmmdemo share-child`: it connects, then per round receives the buffer, opens it
// (import, map, access), reports, verifies the parent's pattern, writes its own, and unmaps.
func runShareChild(e *env, args []string) error {
	var c common
	fs := newFlags(e, "share-child")
	c.register(fs, 1)
	socket := fs.String("socket", "", "the parent's socket")
	ordinal := fs.Int("device", 0, "device ordinal")
	access := fs.String("access", "device", "device or cpu")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *socket == "" {
		return fmt.Errorf("--socket is required (share-child is started by vmmdemo share): %w", errUsage)
	}
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: *socket, Net: "unix"})
	if err != nil {
		return err
	}
	defer conn.Close()
	if err := shareChildRounds(e, &c, conn, *ordinal, *access == "cpu"); err != nil {
		_ = ipc.WriteMessage(conn, kindFailed, []byte(err.Error()), nil)
		return err
	}
	return nil
}

func shareChildRounds(e *env, c *common, conn *net.UnixConn, ordinal int, cpu bool) error {
	b, err := c.openLegacy(e)
	if err != nil {
		return err
	}
	defer b.Close()
	dev, err := b.sys.Device(ordinal)
	if err != nil {
		return err
	}
	if err := dev.LoadKernels(); err != nil {
		return err
	}
	if err := ipc.WriteMessage(conn, kindReady, nil, nil); err != nil {
		return err
	}
	for {
		kind, payload, files, err := ipc.ReadMessage(conn)
		if err != nil {
			return err
		}
		for _, f := range files {
			f.Close()
		}
		if kind == kindBye {
			return nil
		}
		var seeds shareRound
		if kind != kindRound || json.Unmarshal(payload, &seeds) != nil {
			return fmt.Errorf("unexpected message kind %d from the parent: %w", kind, ipc.ErrProtocol)
		}
		if err := shareChildRound(dev, conn, seeds, cpu); err != nil {
			return err
		}
	}
}

func shareChildRound(dev *vmm.Device, conn *net.UnixConn, seeds shareRound, cpu bool) error {
	r, err := ipc.Receive(conn)
	if err != nil {
		return err
	}
	defer r.Close()
	access := vmm.ReadWrite(dev)
	if cpu {
		access = vmm.HostReadWrite()
	}
	t0 := time.Now()
	buf, err := ipc.Open(dev, r, access)
	el := time.Since(t0)
	if err != nil {
		return err
	}
	defer buf.Close()
	payload, _ := json.Marshal(shareMapped{ImportMapUS: us(el)})
	if err := ipc.WriteMessage(conn, kindMapped, payload, nil); err != nil {
		return err
	}
	// The files are closed only now: closing a CUDA handle's descriptor costs time the buffer does
	// not need to wait for.
	if err := r.Close(); err != nil {
		return err
	}
	if kind, _, files, err := ipc.ReadMessage(conn); err != nil || kind != kindVerify || len(files) > 0 {
		for _, f := range files {
			f.Close()
		}
		return fmt.Errorf("waiting for the parent's go-ahead (kind %d): %v: %w", kind, err, ipc.ErrProtocol)
	}
	var bad uint64
	if cpu {
		// The CPU checks and writes the pattern through the same virtual address.
		bad = hostVerifyFill(vmm.HostView(buf.Ptr(), buf.Len()), seeds.ParentSeed, seeds.ChildSeed)
	} else {
		if bad, err = dev.Verify(buf.Ptr(), buf.Len(), 0, seeds.ParentSeed); err != nil {
			return err
		}
		if err := dev.Fill(buf.Ptr(), buf.Len(), 0, seeds.ChildSeed); err != nil {
			return err
		}
	}
	if err := buf.Close(); err != nil {
		return err
	}
	payload, _ = json.Marshal(shareDone{Mismatches: bad})
	return ipc.WriteMessage(conn, kindDone, payload, nil)
}

// hostVerifyFill counts the words of mem that differ from the pattern under verifySeed, then writes
// the pattern under fillSeed, with the CPU.
func hostVerifyFill(mem []byte, verifySeed, fillSeed uint64) (bad uint64) {
	words := unsafe.Slice((*uint64)(unsafe.Pointer(unsafe.SliceData(mem))), len(mem)/8)
	for i, w := range words {
		if w != kernels.Pattern(uint64(i), verifySeed) {
			bad++
		}
		words[i] = kernels.Pattern(uint64(i), fillSeed)
	}
	return bad
}
