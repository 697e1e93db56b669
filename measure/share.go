package measure

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/internal/worker"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// ShareOptions are Share's options.
type ShareOptions struct {
	Env
	// Device is the device's ordinal (the same in both processes).
	Device int
	// Size is the buffer's size, made of Chunks allocations (1 to ipc.MaxChunks); each chunk,
	// Size/Chunks, must be a whole multiple of the allocation granularity.
	Size   uint64
	Chunks int
	// Location is "device" memory or "host" (host NUMA memory next to the device).
	Location string
	// Rounds is how many times the buffer is shared (the times are the median round's).
	Rounds int
	// ChildAccess is what the second process maps the buffer for: "device" (its GPU) or "cpu"
	// (host memory only: the CPU reads and writes it, no GPU page tables).
	ChildAccess string
}

// ShareResult is a buffer's round trip to a second process: export, send, import and map there.
type ShareResult struct {
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

// Check reports a failed verification as an error.
func (r *ShareResult) Check() error {
	if !r.Verified {
		return errors.New("verification failed: the two processes do not see the same memory")
	}
	return nil
}

func (o *ShareOptions) check() error {
	if err := o.Env.check(); err != nil {
		return err
	}
	switch {
	case o.ChildAccess != "device" && o.ChildAccess != "cpu":
		return fmt.Errorf("--child-access %q: want device or cpu: %w", o.ChildAccess, ErrInvalidOption)
	case o.ChildAccess == "cpu" && o.Location != "host":
		return fmt.Errorf("--child-access cpu needs --location host (the CPU cannot map device memory): %w", ErrInvalidOption)
	case o.Location != "device" && o.Location != "host":
		return fmt.Errorf("--location %q: want device or host: %w", o.Location, ErrInvalidOption)
	case o.Chunks < 1 || o.Chunks > ipc.MaxChunks:
		return fmt.Errorf("--chunks %d: want 1 to %d: %w", o.Chunks, ipc.MaxChunks, ErrInvalidOption)
	case o.Rounds < 1:
		return fmt.Errorf("--rounds %d: want at least 1: %w", o.Rounds, ErrInvalidOption)
	}
	return nonZeroSize("size", o.Size)
}

// shareBuffer is the parent's buffer: one reservation, one allocation per chunk.
type shareBuffer struct {
	dev       *vmm.Device
	loc       driver.Location
	types     driver.HandleType
	res       *vmm.Reservation
	chunk, n  uint64
	total     uint64
	allocLoc  driver.Location
	fabricDev bool
}

// newShareBuffer checks the location and the size against the granularity, then reserves and maps
// the chunks.
func newShareBuffer(o *ShareOptions) (*shareBuffer, error) {
	dev, err := device(o.Backend, o.Device, "device")
	if err != nil {
		return nil, err
	}
	sb := &shareBuffer{dev: dev, loc: dev.Location(), n: uint64(o.Chunks), fabricDev: dev.Supports(driver.AttrHandleTypeFabricSupported)}
	if o.Location == "host" {
		node := dev.HostNUMAID()
		if node < 0 || !dev.Supports(driver.AttrHostNUMAVirtualMemoryManagementSupported) {
			return nil, fmt.Errorf("--location host: device %d reports no host-NUMA VMM support (host NUMA id %d): %w", o.Device, node, driver.ErrNotSupported)
		}
		sb.loc = driver.HostNUMALocation(node)
		sb.allocLoc = sb.loc
	}
	// Handle types: FABRIC with POSIX_FD where the driver grants it, else POSIX_FD alone.
	if sb.types, err = ipc.HandleTypes(dev, sb.allocLoc); err != nil {
		return nil, err
	}
	gran, err := dev.Granularity(sb.loc, driver.GranularityMinimum)
	if err != nil {
		return nil, err
	}
	if unit := gran * sb.n; unit/sb.n != gran || o.Size%unit != 0 {
		want, _ := units.RoundUp(o.Size, unit)
		return nil, fmt.Errorf("--size %s in %d chunks: each chunk must be a whole multiple of the granularity %s (try --size %s): %w",
			units.FormatSize(o.Size), sb.n, units.FormatSize(gran), strings.ReplaceAll(units.FormatSize(want), " ", ""), ErrInvalidOption)
	}
	sb.chunk, sb.total = o.Size/sb.n, o.Size
	if sb.res, err = o.Backend.Sys.Reserve(sb.total, vmm.ReserveOptions{}); err != nil {
		return nil, err
	}
	for i := uint64(0); i < sb.n; i++ {
		if _, err := sb.res.MapNew(i*sb.chunk, sb.chunk, dev, vmm.AllocOptions{Location: sb.allocLoc, HandleTypes: sb.types}, vmm.ReadWrite(dev)); err != nil {
			return nil, errors.Join(err, sb.close())
		}
	}
	return sb, nil
}

func (sb *shareBuffer) close() error {
	var errs []error
	for _, m := range sb.res.Mappings() {
		errs = append(errs, m.Close())
	}
	return errors.Join(append(errs, sb.res.Close())...)
}

// Share shares a buffer of Chunks allocations with a second process over a Unix socket, Rounds
// times: export, send, import, map and set access there. Both sides verify what the other wrote.
func Share(opts ShareOptions) (res *ShareResult, err error) {
	if err := opts.check(); err != nil {
		return nil, err
	}
	opts.syncLog()
	sb, err := newShareBuffer(&opts)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, sb.close()) }()
	if err := sb.dev.LoadKernels(); err != nil {
		return nil, err
	}
	child, err := startWorker(&opts.Env, roleShare, shareSetup{workerSetup: newWorkerSetup(opts.Backend), Device: opts.Device, CPU: opts.ChildAccess == "cpu"})
	if err != nil {
		return nil, err
	}
	defer func() { err = stopWorker(child, err) }()
	if err := child.Conn.Receive(nil); err != nil { // the child's backend is up
		return nil, err
	}
	res = &ShareResult{Backend: opts.Backend.Name, Location: sb.loc.String(), SizeBytes: sb.total, Chunks: opts.Chunks,
		HandleType: sb.types.String(), FabricSupported: sb.fabricDev, Rounds: opts.Rounds, ChildPID: child.Pid(),
		ChildAccess: opts.ChildAccess, Verified: true}
	var times []shareTimes
	for round := 0; round < opts.Rounds; round++ {
		t, err := shareRound(&opts, sb, child.Conn, round, res)
		if err != nil {
			return nil, err
		}
		times = append(times, t)
	}
	if err := child.Conn.Send(shareCall{Op: "bye"}); err != nil {
		return nil, err
	}
	if err := child.Wait(); err != nil {
		return nil, err
	}
	res.times(times)
	return res, nil
}

type shareTimes struct{ export, send, importMap, roundTrip time.Duration }

func us(d time.Duration) float64 { return float64(d.Nanoseconds()/100) / 10 }

// times sets the median round's times and the first round trip.
func (r *ShareResult) times(times []shareTimes) {
	r.FirstRoundTripUS = us(times[0].roundTrip)
	sorted := slices.Clone(times)
	slices.SortFunc(sorted, func(a, b shareTimes) int { return int(a.roundTrip - b.roundTrip) })
	med := sorted[len(sorted)/2]
	r.ExportUS, r.SendUS, r.ImportMapUS, r.RoundTripUS = us(med.export), us(med.send), us(med.importMap), us(med.roundTrip)
}

// shareRound fills the buffer, shares it (timed: export, send, the child's import and map), then
// lets the child verify and write its own pattern, and verifies that.
func shareRound(o *ShareOptions, sb *shareBuffer, conn *worker.Conn, round int, res *ShareResult) (shareTimes, error) {
	seeds := shareCall{Op: "round", ParentSeed: 0x5eed0000 + uint64(round), ChildSeed: 0xc41d0000 + uint64(round)}
	if err := sb.dev.Fill(sb.res.Ptr(), sb.total, 0, seeds.ParentSeed); err != nil {
		return shareTimes{}, err
	}
	if err := conn.Send(seeds); err != nil {
		return shareTimes{}, err
	}
	t0 := time.Now()
	exp, err := ipc.Export(ipc.FromReservation(sb.res))
	if err != nil {
		return shareTimes{}, err
	}
	t1 := time.Now()
	err = ipc.Send(conn.Unix(), exp)
	t2 := time.Now()
	var mapped shareReport
	if err == nil {
		err = conn.Receive(&mapped)
	}
	t3 := time.Now()
	// Closing the exported descriptors costs about 80 µs each on the H200: after the timing.
	if err := errors.Join(err, exp.Close()); err != nil {
		return shareTimes{}, err
	}
	t := shareTimes{export: t1.Sub(t0), send: t2.Sub(t1), importMap: time.Duration(mapped.ImportMapUS * 1e3), roundTrip: t3.Sub(t0)}
	// The child verifies only now, so that its kernels do not compete with the timing above.
	var done shareReport
	if err := conn.Call(shareCall{Op: "verify"}, &done); err != nil {
		return t, err
	}
	bad, err := sb.dev.Verify(sb.res.Ptr(), sb.total, 0, seeds.ChildSeed)
	if err != nil {
		return t, err
	}
	if done.Mismatches != 0 || bad != 0 {
		res.Verified = false
		o.logf("vmmdemo share: round %d: the child found %d words of %d not matching the parent's pattern; the parent found %d not matching the child's\n",
			round+1, done.Mismatches, sb.total/8, bad)
	}
	return t, nil
}

// Text writes the result for people.
func (r *ShareResult) Text(w io.Writer) {
	who := fmt.Sprintf("a second process (pid %d)", r.ChildPID)
	fmt.Fprintf(w, "share: %s in %d chunks of %s at %s with %s, backend %s\n", units.FormatSize(r.SizeBytes), r.Chunks,
		units.FormatSize(r.SizeBytes/uint64(max(r.Chunks, 1))), r.Location, who, r.Backend)
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
