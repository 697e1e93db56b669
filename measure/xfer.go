package measure

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/internal/worker"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/nccl"
	"github.com/cuvmm/cuvmm/nccl/ncclsim"
	"github.com/cuvmm/cuvmm/vmm"
)

// Xfer moves a growable buffer of KV-cache-like blocks from one process and GPU to another through
// NCCL, and beside it through cuvmm's own path on one host (the buffer shared once over ipc, then
// pulled with peer copies over NVLink); with XferOptions.Peer "torch" it also runs PyTorch's
// torch.distributed send/recv over the same NCCL, in the same run, timed the same way.
//
// Timing, identical for every path and for the PyTorch script: the receiver does Warmup transfers,
// waits for its stream, reads the clock, queues Iters transfers, waits for its stream, reads the
// clock; GB/s = Size × Iters / elapsed / 1e9. The receiver's last copy is verified against the
// pattern.

const roleXfer = "measure-xfer"

func init() { worker.Register(roleXfer, xferChild) }

// XferOptions configures Xfer.
type XferOptions struct {
	Env
	// Devices are the sender's and the receiver's device ordinals (default 0 and 1; the simulator
	// gets two devices at least).
	Devices [2]int
	// Size is the buffer's length in bytes (required).
	Size uint64
	// Block is the size of one KV block: the sender grows its buffer block by block, filling each,
	// as a KV cache fills (default 2 MiB).
	Block uint64
	// Transport is "auto" (NCCL picks: NVLink between two GPUs of a host) or "socket" (NCCL's
	// network path over loopback TCP: NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1, and
	// NCCL_SOCKET_IFNAME=lo unless set). Xfer sets these in its own environment while it runs, and
	// the receiver and the PyTorch script inherit them.
	Transport string
	// Register registers both buffers with NCCL, every chunk (nccl.Comm.Register), and moves them
	// chunk by chunk so that each operation lies inside one registration.
	Register bool
	// ByChunks moves the buffers chunk by chunk, as Register does, without registering them: what
	// the chunking costs apart from the registration (Register implies it).
	ByChunks bool
	// Warmup and Iters are the untimed and timed transfers (0: 3 and 10). A negative Warmup means
	// none; a negative Iters is refused.
	Warmup, Iters int
	// Peer "torch" runs PyTorch's send/recv (PeerScript with Python) after cuvmm's paths.
	Peer string
	// PeerScript is the PyTorch script (default scripts/peers/torch_sendrecv.py, looked up from the
	// working directory and from the executable's directory upwards); Python runs it (default
	// python3).
	PeerScript, Python string
	// Timeout bounds each step that waits on the other process (default 2 minutes).
	Timeout time.Duration
}

// XferResult is what Xfer measured; its JSON is what vmmdemo xfer --json prints.
type XferResult struct {
	Backend     string `json:"backend"`
	NCCLVersion string `json:"nccl_version"`
	Transport   string `json:"transport"`
	Registered  bool   `json:"registered"`
	ByChunks    bool   `json:"by_chunks"`
	SizeBytes   uint64 `json:"size_bytes"`
	BlockBytes  uint64 `json:"block_bytes"`
	Chunks      int    `json:"chunks"`
	Devices     [2]int `json:"devices"`
	Warmup      int    `json:"warmup"`
	Iters       int    `json:"iters"`
	// InitSeconds is the slower rank's NewComm, both ranks starting together.
	InitSeconds float64 `json:"init_seconds"`
	NCCLGBps    float64 `json:"nccl_gbps"`
	// NativeGBps is cuvmm's own path: the receiver imports the buffer once over ipc
	// (NativeShareSeconds) and pulls it with peer copies.
	NativeGBps         float64 `json:"native_gbps"`
	NativeShareSeconds float64 `json:"native_share_seconds"`
	// Verified: the receiver found the pattern after the NCCL transfers and after the peer copies
	// (and the PyTorch script verified its own, when it ran).
	Verified bool `json:"verified"`
	// NCCLEnv is the NCCL_* environment the run had.
	NCCLEnv map[string]string `json:"nccl_env"`
	// The PyTorch peer, when it ran: its figures, and nccl_gbps / pytorch_gbps.
	PyTorchGBps        float64   `json:"pytorch_gbps,omitempty"`
	NCCLVsPyTorch      float64   `json:"nccl_vs_pytorch,omitempty"`
	PyTorchInitSeconds float64   `json:"pytorch_init_seconds,omitempty"`
	PyTorch            *XferPeer `json:"pytorch,omitempty"`
	Sim                bool      `json:"simulated,omitempty"`
}

// XferPeer is the PyTorch script's JSON.
type XferPeer struct {
	GBps         float64 `json:"gbps"`
	Seconds      float64 `json:"seconds"`
	SizeBytes    uint64  `json:"size_bytes"`
	Warmup       int     `json:"warmup"`
	Iters        int     `json:"iters"`
	Verified     bool    `json:"verified"`
	InitSeconds  float64 `json:"init_seconds"`
	TorchVersion string  `json:"torch_version"`
	NCCLVersion  string  `json:"nccl_version"`
}

// Check reports a failed verification as an error.
func (r *XferResult) Check() error {
	if !r.Verified {
		return errors.New("verification failed: the receiver did not get the sender's blocks")
	}
	return nil
}

func (o *XferOptions) check() error {
	if err := o.Env.check(); err != nil {
		return err
	}
	o.ByChunks = o.ByChunks || o.Register // registered buffers move chunk by chunk
	if o.Devices == [2]int{} {
		o.Devices = [2]int{0, 1}
	}
	if o.Devices[0] == o.Devices[1] {
		return fmt.Errorf("--devices %d,%d: NCCL needs two different devices: %w", o.Devices[0], o.Devices[1], ErrInvalidOption)
	}
	for _, d := range o.Devices {
		if n := o.Backend.Sys.DeviceCount(); d < 0 || d >= n {
			return fmt.Errorf("--devices %d,%d: the %s backend has %d devices: %w", o.Devices[0], o.Devices[1], o.Backend.Name, n, ErrInvalidOption)
		}
	}
	o.Block = cmp.Or(o.Block, 2<<20)
	if o.Size == 0 || o.Size%o.Block != 0 {
		return fmt.Errorf("--size %d: want a positive multiple of the block size %s: %w", o.Size, units.FormatSize(o.Block), ErrInvalidOption)
	}
	if err := o.checkFits(); err != nil {
		return err
	}
	if o.Transport == "" {
		o.Transport = "auto"
	}
	if o.Transport != "auto" && o.Transport != "socket" {
		return fmt.Errorf("--transport %q: want auto or socket: %w", o.Transport, ErrInvalidOption)
	}
	var err error
	if o.Python, o.PeerScript, err = findPeer(o.Peer, o.Python, o.PeerScript, XferPeerScript); err != nil {
		return err
	}
	if o.Iters < 0 {
		return fmt.Errorf("--iters %d: want at least 1: %w", o.Iters, ErrInvalidOption)
	}
	o.Warmup, o.Iters = max(cmp.Or(o.Warmup, 3), 0), cmp.Or(o.Iters, 10)
	o.Timeout = cmp.Or(o.Timeout, 2*time.Minute)
	return nil
}

// checkFits refuses a Size larger than the memory of either device (each holds a buffer of it).
func (o *XferOptions) checkFits() error {
	for _, ord := range o.Devices {
		d, err := o.Backend.Sys.Device(ord)
		if err != nil {
			return err
		}
		if total := d.TotalMemory(); o.Size > total {
			return fmt.Errorf("--size %s: more than device %d's memory (%s): %w", units.FormatSize(o.Size), ord,
				units.FormatSize(total), ErrInvalidOption)
		}
	}
	return nil
}

// XferTransportEnv is the environment a transport needs (NCCL reads it when a communicator is made).
func XferTransportEnv(transport string) map[string]string {
	if transport != "socket" {
		return nil
	}
	env := map[string]string{"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
	if os.Getenv("NCCL_SOCKET_IFNAME") == "" {
		env["NCCL_SOCKET_IFNAME"] = "lo"
	}
	return env
}

// xferSetEnv sets env in this process (NCCL reads it when a communicator is made; children inherit
// it) and returns what puts the previous values back.
func xferSetEnv(env map[string]string) (restore func(), err error) {
	type prev struct {
		v  string
		ok bool
	}
	saved := map[string]prev{}
	restore = func() {
		for k, p := range saved {
			if p.ok {
				os.Setenv(k, p.v)
			} else {
				os.Unsetenv(k)
			}
		}
	}
	for k, v := range env {
		p, ok := os.LookupEnv(k)
		saved[k] = prev{p, ok}
		if err := os.Setenv(k, v); err != nil {
			restore()
			return nil, err
		}
	}
	return restore, nil
}

// xferLibrary is the backend's NCCL: the real library, or the stand-in over the simulator.
func xferLibrary(b *Backend) (nccl.API, error) {
	if b.Sim() {
		return ncclsim.New(b.sim), nil
	}
	return nccl.Open()
}

// xferSetup is the receiver's setup.
type xferSetup struct {
	workerSetup
	Device   int           `json:"device"`
	Size     uint64        `json:"size"`
	Register bool          `json:"register"`
	ByChunks bool          `json:"by_chunks"`
	Warmup   int           `json:"warmup"`
	Iters    int           `json:"iters"`
	Seed     uint64        `json:"seed"`
	Timeout  time.Duration `json:"timeout"`
}

// xferJoined is the receiver's report once its communicator and buffer are ready.
type xferJoined struct {
	InitSeconds float64      `json:"init_seconds"`
	Layout      []nccl.Piece `json:"layout"`
}

// xferTimes is the receiver's report of one path.
type xferTimes struct {
	Seconds      float64 `json:"seconds"`
	ShareSeconds float64 `json:"share_seconds,omitempty"`
	Mismatches   uint64  `json:"mismatches"`
}

// xferSide is one rank's state.
type xferSide struct {
	dev  *vmm.Device
	lib  nccl.API
	buf  *growbuf.Buffer
	s    *vmm.Stream
	comm *nccl.Comm
	reg  *nccl.Registration
	// byChunks: move the buffer chunk by chunk (registered or not).
	byChunks bool
}

func (x *xferSide) close() error {
	if x == nil {
		return nil
	}
	return errors.Join(x.reg.Close(), x.comm.Close(), x.buf.Close(), x.s.Close())
}

// newXferSide opens the device's kernels, a stream and an empty buffer whose chunks can be shared.
func newXferSide(b *Backend, ordinal int) (*xferSide, error) {
	dev, err := device(b, ordinal, "devices")
	if err != nil {
		return nil, err
	}
	if err := dev.LoadKernels(); err != nil {
		return nil, err
	}
	lib, err := xferLibrary(b)
	if err != nil {
		return nil, err
	}
	x := &xferSide{dev: dev, lib: lib}
	if x.s, err = dev.NewStream(true); err != nil {
		return nil, err
	}
	x.buf, err = growbuf.New(dev, growbuf.Options{HandleTypes: driver.HandleTypePosixFD, Stream: x.s})
	if err != nil {
		return nil, errors.Join(err, x.s.Close())
	}
	return x, nil
}

// join makes the communicator (timed) and registers the buffer when asked.
func (x *xferSide) join(ctx context.Context, id nccl.UniqueID, rank int, register bool) (time.Duration, error) {
	start := time.Now()
	var err error
	if x.comm, err = nccl.NewComm(ctx, x.lib, id, rank, 2, x.dev); err != nil {
		return 0, err
	}
	took := time.Since(start)
	if register {
		if x.reg, err = x.comm.Register(ctx, x.buf); err != nil {
			return 0, err
		}
	}
	return took, nil
}

// transfer queues one transfer of the buffer to (send) or from the peer.
func (x *xferSide) transfer(ctx context.Context, send bool) error {
	g := x.comm.Group()
	peer := 1 - x.comm.Rank()
	switch {
	case send && x.byChunks:
		g.SendChunks(x.buf, peer, x.s)
	case send:
		g.SendBuffer(x.buf, peer, x.s)
	case x.byChunks:
		g.RecvChunks(x.buf, peer, x.s)
	default:
		g.RecvBuffer(x.buf, peer, x.s)
	}
	return g.Run(ctx)
}

// xferTimed runs step warmup times, waits, calls reset (when not nil, untimed), then runs step
// iters times and waits again, timing the second part. The receiver's reset zeroes its buffer, so
// that what it verifies afterwards is what the timed steps delivered, not the warm-up's.
func xferTimed(warmup, iters int, step, wait, reset func() error) (time.Duration, error) {
	for range warmup {
		if err := step(); err != nil {
			return 0, err
		}
	}
	if err := wait(); err != nil {
		return 0, err
	}
	if reset != nil {
		if err := reset(); err != nil {
			return 0, err
		}
	}
	start := time.Now()
	for range iters {
		if err := step(); err != nil {
			return 0, err
		}
	}
	if err := wait(); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

// Xfer runs the measurement (see the type's comment).
func Xfer(opts XferOptions) (res *XferResult, err error) {
	if err := opts.check(); err != nil {
		return nil, err
	}
	restore, err := xferSetEnv(XferTransportEnv(opts.Transport))
	if err != nil {
		return nil, err
	}
	defer restore()
	x, err := newXferSide(opts.Backend, opts.Devices[0])
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, x.close()) }()
	x.byChunks = opts.ByChunks
	const seed = 0x6b76 // "kv"
	if err := xferFillBlocks(&opts, x, seed); err != nil {
		return nil, err
	}
	setup := xferSetup{workerSetup: newWorkerSetup(opts.Backend), Device: opts.Devices[1], Size: opts.Size,
		Register: opts.Register, ByChunks: opts.ByChunks, Warmup: opts.Warmup, Iters: opts.Iters, Seed: seed, Timeout: opts.Timeout}
	child, err := startWorker(&opts.Env, roleXfer, setup)
	if err != nil {
		return nil, err
	}
	defer func() { err = stopWorker(child, err) }()
	res = &XferResult{Backend: opts.Backend.Name, NCCLVersion: nccl.FormatVersion(x.lib.Version()), Transport: opts.Transport,
		Registered: opts.Register, ByChunks: opts.ByChunks, SizeBytes: opts.Size, BlockBytes: opts.Block, Chunks: len(x.buf.Chunks()),
		Devices: opts.Devices, Warmup: opts.Warmup, Iters: opts.Iters, NCCLEnv: xferNCCLEnv(), Sim: opts.Backend.Sim()}
	if err := xferSender(&opts, x, child, res); err != nil {
		return nil, err
	}
	if err := xferFinish(x, child); err != nil {
		return nil, err
	}
	if opts.Peer == "torch" {
		if err := xferPeer(&opts, res); err != nil {
			return nil, err
		}
	}
	return res, nil
}

// xferFinish closes the sender's communicator while the worker closes its own and exits: NCCL's
// destroy waits for the other process's rank, so the two close together.
func xferFinish(x *xferSide, child *worker.Process) error {
	closed := make(chan error, 1)
	go func() { closed <- errors.Join(x.reg.Close(), x.comm.Close()) }()
	return errors.Join(child.Wait(), <-closed)
}

// xferFillBlocks grows the sender's buffer block by block, writing each block's part of the pattern.
func xferFillBlocks(o *XferOptions, x *xferSide, seed uint64) error {
	bar := begin(o.Progress, "filling KV blocks", o.Size)
	defer bar.Done()
	for off := uint64(0); off < o.Size; off += o.Block {
		if err := x.buf.Grow(off + o.Block); err != nil {
			return err
		}
		if err := x.dev.Fill(x.buf.Ptr()+driver.DevicePtr(off), o.Block, off, seed); err != nil {
			return err
		}
		bar.Update(off + o.Block)
	}
	return nil
}

// xferSender is rank 0's part: join, compare layouts, send, then share the buffer for the native
// path.
func xferSender(o *XferOptions, x *xferSide, child *worker.Process, res *XferResult) error {
	if err := child.Conn.Receive(nil); err != nil { // the receiver's backend is up
		return err
	}
	id, err := x.lib.GetUniqueID()
	if err != nil {
		return err
	}
	if err := nccl.ShareID(child.Conn.Unix(), id); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), o.Timeout)
	defer cancel()
	took, err := x.join(ctx, id, 0, o.Register)
	if err != nil {
		return err
	}
	var joined xferJoined
	if err := child.Conn.Receive(&joined); err != nil {
		return err
	}
	res.InitSeconds = max(took.Seconds(), joined.InitSeconds)
	if mine := nccl.Layout(x.buf); x.byChunks && !slices.Equal(mine, joined.Layout) {
		return fmt.Errorf("the two buffers' chunk layouts differ (%v and %v): chunk-by-chunk transfers would not match", mine, joined.Layout)
	}
	if err := child.Conn.Send("nccl"); err != nil {
		return err
	}
	if _, err := xferTimed(o.Warmup, o.Iters, func() error { return x.transfer(ctx, true) },
		func() error { return x.comm.Wait(ctx, x.s) }, nil); err != nil {
		return err
	}
	var t xferTimes
	if err := child.Conn.Receive(&t); err != nil {
		return err
	}
	res.NCCLGBps = gbps(o.Size, o.Iters, t.Seconds)
	res.Verified = t.Mismatches == 0
	return xferShare(o, x, child, res)
}

func gbps(size uint64, iters int, seconds float64) float64 {
	if seconds <= 0 {
		return 0
	}
	return float64(size) * float64(iters) / seconds / 1e9
}

// xferShare exports the buffer once over ipc for the receiver's peer copies.
func xferShare(o *XferOptions, x *xferSide, child *worker.Process, res *XferResult) error {
	exp, err := ipc.Export(x.buf)
	if err != nil {
		return err
	}
	defer exp.Close()
	if err := child.Conn.Send("native"); err != nil {
		return err
	}
	if err := ipc.Send(child.Conn.Unix(), exp); err != nil {
		return err
	}
	var t xferTimes
	if err := child.Conn.Receive(&t); err != nil {
		return err
	}
	res.NativeGBps = gbps(o.Size, o.Iters, t.Seconds)
	res.NativeShareSeconds = t.ShareSeconds
	res.Verified = res.Verified && t.Mismatches == 0
	return child.Conn.Send("bye")
}

// xferChild is the receiver (rank 1) in the worker process.
func xferChild(c *worker.Conn) error {
	var setup xferSetup
	b, err := childBackend(c, &setup)
	if b == nil {
		return err
	}
	defer b.Close()
	x, err := newXferSide(b, setup.Device)
	if err == nil {
		err = x.buf.Grow(setup.Size)
	}
	if err := c.Report(nil, err); err != nil {
		return errors.Join(err, x.close())
	}
	return errors.Join(xferReceive(c, x, setup), x.close())
}

// xferReceive joins, receives through NCCL, then pulls the shared buffer with peer copies,
// reporting each step's result or error to the parent.
func xferReceive(c *worker.Conn, x *xferSide, setup xferSetup) error {
	id, err := nccl.ReceiveID(c.Unix())
	if err != nil {
		return c.Report(nil, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), setup.Timeout)
	defer cancel()
	x.byChunks = setup.ByChunks
	took, err := x.join(ctx, id, 1, setup.Register)
	if err != nil {
		return c.Report(nil, err)
	}
	if err := c.Report(xferJoined{InitSeconds: took.Seconds(), Layout: nccl.Layout(x.buf)}, nil); err != nil {
		return err
	}
	for {
		var op string
		if err := c.Next(&op); err != nil {
			return err
		}
		var t xferTimes
		switch op {
		case "nccl":
			t, err = xferReceiveNCCL(ctx, x, setup)
		case "native":
			t, err = xferPull(c, x, setup)
		default:
			return nil
		}
		if err := c.Report(t, err); err != nil {
			return err
		}
	}
}

// xferZero zeroes the receiver's buffer and waits until it is done: the memset is not ordered
// with the non-blocking stream the transfers run on.
func xferZero(x *xferSide, size uint64) error {
	if err := x.dev.Memset(x.buf.Ptr(), 0, size); err != nil {
		return err
	}
	return x.dev.Synchronize()
}

func xferReceiveNCCL(ctx context.Context, x *xferSide, setup xferSetup) (xferTimes, error) {
	zero := func() error { return xferZero(x, setup.Size) }
	if err := zero(); err != nil {
		return xferTimes{}, err
	}
	took, err := xferTimed(setup.Warmup, setup.Iters, func() error { return x.transfer(ctx, false) },
		func() error { return x.comm.Wait(ctx, x.s) }, zero)
	if err != nil {
		return xferTimes{}, err
	}
	bad, err := x.dev.Verify(x.buf.Ptr(), setup.Size, 0, setup.Seed)
	return xferTimes{Seconds: took.Seconds(), Mismatches: bad}, err
}

// xferPull imports the sender's buffer (once) and copies it into the receiver's with peer copies.
func xferPull(c *worker.Conn, x *xferSide, setup xferSetup) (t xferTimes, err error) {
	zero := func() error { return xferZero(x, setup.Size) }
	if err := zero(); err != nil {
		return t, err
	}
	start := time.Now()
	r, err := ipc.Receive(c.Unix())
	if err != nil {
		return t, err
	}
	src, err := ipc.Open(x.dev, r, vmm.ReadOnly(x.dev))
	r.Close()
	if err != nil {
		return t, err
	}
	defer func() { err = errors.Join(err, src.Close()) }()
	t.ShareSeconds = time.Since(start).Seconds()
	took, err := xferTimed(setup.Warmup, setup.Iters,
		func() error { return x.dev.CopyAsync(x.buf.Ptr(), src.Ptr(), setup.Size, x.s) },
		x.s.Synchronize, zero)
	if err != nil {
		return t, err
	}
	t.Seconds = took.Seconds()
	t.Mismatches, err = x.dev.Verify(x.buf.Ptr(), setup.Size, 0, setup.Seed)
	return t, err
}

// xferNCCLEnv lists the NCCL_* variables in effect.
func xferNCCLEnv() map[string]string {
	env := map[string]string{}
	for _, kv := range os.Environ() {
		if k, v, ok := strings.Cut(kv, "="); ok && strings.HasPrefix(k, "NCCL_") {
			env[k] = v
		}
	}
	return env
}

// xferPeer runs the PyTorch script with the same size, warm-up and iterations.
func xferPeer(o *XferOptions, res *XferResult) error {
	script := o.PeerScript // found by check
	ctx, cancel := context.WithTimeout(context.Background(), 2*o.Timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, o.Python, script, "--size", fmt.Sprint(o.Size), "--warmup", fmt.Sprint(o.Warmup),
		"--iters", fmt.Sprint(o.Iters), "--devices", fmt.Sprintf("%d,%d", o.Devices[0], o.Devices[1]))
	cmd.Stderr = o.logWriter()
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("the PyTorch peer (%s %s): %w", o.Python, script, err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	var p XferPeer
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &p); err != nil {
		return fmt.Errorf("the PyTorch peer's output %q: %w", lines[len(lines)-1], err)
	}
	res.PyTorch, res.PyTorchGBps, res.PyTorchInitSeconds = &p, p.GBps, p.InitSeconds
	if p.GBps > 0 {
		res.NCCLVsPyTorch = res.NCCLGBps / p.GBps
	}
	res.Verified = res.Verified && p.Verified
	return nil
}

func (o *XferOptions) logWriter() io.Writer {
	if o.Log != nil {
		return o.Log
	}
	return os.Stderr
}

// Text prints the result for people.
func (r *XferResult) Text(w io.Writer) {
	sim := ""
	if r.Sim {
		sim = " (simulated: times are of Go code, not a GPU)"
	}
	fmt.Fprintf(w, "xfer: %s of %s KV blocks in %d chunks, device %d → device %d (another process), NCCL %s, transport %s, registered %v, by chunks %v, backend %s%s\n",
		units.FormatSize(r.SizeBytes), units.FormatSize(r.BlockBytes), r.Chunks, r.Devices[0], r.Devices[1], r.NCCLVersion,
		r.Transport, r.Registered, r.ByChunks, r.Backend, sim)
	fmt.Fprintf(w, "  communicator of 2 ranks ready in %.3f s\n", r.InitSeconds)
	fmt.Fprintf(w, "  NCCL send/recv:                  %8.2f GB/s (%d transfers after %d warm-up)\n", r.NCCLGBps, r.Iters, r.Warmup)
	fmt.Fprintf(w, "  cuvmm ipc + peer copies:         %8.2f GB/s (shared once in %.3f s)\n", r.NativeGBps, r.NativeShareSeconds)
	if r.PyTorch != nil {
		fmt.Fprintf(w, "  PyTorch send/recv (torch %s): %8.2f GB/s, init %.3f s: NCCL path at %.2f× PyTorch's\n",
			r.PyTorch.TorchVersion, r.PyTorchGBps, r.PyTorchInitSeconds, r.NCCLVsPyTorch)
	}
	status := "ok: the receiver found every block"
	if !r.Verified {
		status = "FAILED"
	}
	fmt.Fprintf(w, "  verified: %s\n", status)
}
