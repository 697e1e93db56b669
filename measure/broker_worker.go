package measure

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/pattern"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/internal/worker"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/pinned/broker"
	"github.com/cuvmm/cuvmm/vmm"
)

func init() { worker.Register(roleBroker, brokerChild) }

// brokerSetup is a Broker worker's setup.
type brokerSetup struct {
	workerSetup
	Device int    `json:"device"`
	Buffer uint64 `json:"buffer"` // the device buffer's size (a multiple of the granularity)
}

// brokerChild is one worker of Broker: it brings up its device and a device buffer, reports, then
// follows the parent's commands until told to exit.
func brokerChild(c *worker.Conn) error {
	var setup brokerSetup
	b, err := childBackend(c, &setup)
	if b == nil {
		return err
	}
	defer b.Close()
	w := &brokerWorker{sim: b.Sim()}
	defer w.close()
	if err := w.setup(b, setup.Device, setup.Buffer); err != nil {
		return c.Report(nil, err)
	}
	if err := c.Report(brokerReport{Free: w.free()}, nil); err != nil {
		return err
	}
	for {
		var cmd brokerCmd
		if err := c.Next(&cmd); err != nil {
			return err
		}
		if cmd.Op == brokerCmdExit {
			return w.close()
		}
		var rep brokerReport
		err := w.do(cmd, &rep)
		if err := c.Report(rep, err); err != nil {
			return err
		}
	}
}

// brokerWorker is a worker's state.
type brokerWorker struct {
	sim    bool
	dev    *vmm.Device
	res    *vmm.Reservation
	bufLen uint64
	client *broker.Client
	buf    *broker.Buffer
	view   *pinned.Region // CPU only
	naive  *pinned.Region // granted to the worker's GPU
	winOff uint64
	winLen uint64
}

func (w *brokerWorker) setup(b *Backend, device int, size uint64) error {
	d, err := b.Sys.Device(device)
	if err != nil {
		return err
	}
	w.dev = d
	if err := d.LoadKernels(); err != nil { // now, so that the module's memory is in the baseline
		return err
	}
	if w.res, err = b.Sys.Reserve(size, vmm.ReserveOptions{}); err != nil {
		return err
	}
	if _, err := w.res.MapNew(0, size, d, vmm.AllocOptions{HandleTypes: driver.HandleTypePosixFD}, vmm.ReadWrite(d)); err != nil {
		return err
	}
	w.bufLen = size
	return nil
}

// free is this process's free memory per device ordinal on the simulator (nil on a GPU, where the
// parent sees every process).
func (w *brokerWorker) free() []uint64 {
	if !w.sim {
		return nil
	}
	all, err := w.dev.System().Devices()
	if err != nil {
		return nil
	}
	var held []*vmm.Device
	for _, d := range all {
		if d == w.dev {
			held = append(held, d)
		}
	}
	f, err := pinFreeHeld(len(all), held)
	if err != nil {
		return nil
	}
	return f
}

func (w *brokerWorker) close() error {
	var errs []error
	if w.naive != nil {
		errs = append(errs, w.naive.Close())
		w.naive = nil
	}
	if w.view != nil {
		errs = append(errs, w.view.Close())
		w.view = nil
	}
	if w.client != nil {
		errs = append(errs, w.client.Close()) // the broker drops the buffer with the connection
		w.client = nil
	}
	if w.res != nil {
		for _, m := range w.res.Mappings() {
			errs = append(errs, m.Close())
		}
		errs = append(errs, w.res.Close())
		w.res = nil
	}
	return errors.Join(errs...)
}

func (w *brokerWorker) do(cmd brokerCmd, rep *brokerReport) error {
	ctx := context.Background()
	switch cmd.Op {
	case brokerCmdConnect:
		return w.connect(ctx, cmd, rep)
	case brokerCmdNaiveOpen:
		var err error
		if w.naive, err = w.client.Region(ctx, w.dev, pinned.OpenOptions{Grant: []*vmm.Device{w.dev}}); err != nil {
			return err
		}
		rep.Free = w.free()
		return nil
	case brokerCmdNaiveClose:
		err := w.naive.Close()
		w.naive = nil
		return err
	case brokerCmdVerify:
		return w.verify(ctx, rep)
	case brokerCmdBandwidth:
		return w.bandwidth(ctx, cmd, rep)
	case brokerCmdRTT:
		return w.roundTrip(ctx, cmd, rep)
	}
	return fmt.Errorf("unknown command %q", cmd.Op)
}

// connect dials the broker, maps the region for the CPU and registers the device buffer.
func (w *brokerWorker) connect(ctx context.Context, cmd brokerCmd, rep *brokerReport) error {
	c, err := broker.Dial(cmd.Socket)
	if err != nil {
		return err
	}
	w.client = c
	g := c.Info().Grant
	rep.GrantOffset, rep.GrantBytes = g.Offset, g.Length
	w.winOff, w.winLen = g.Offset, g.Length
	if w.view, err = c.Region(ctx, w.dev, pinned.OpenOptions{}); err != nil {
		return err
	}
	if w.buf, err = c.Register(ctx, ipc.FromReservation(w.res)); err != nil {
		return err
	}
	rep.BufferBytes = w.buf.Len()
	rep.Free = w.free()
	return nil
}

// verify copies a pattern both ways through the broker and checks it.
func (w *brokerWorker) verify(ctx context.Context, rep *brokerReport) error {
	n := min(w.bufLen, w.winLen)
	ptr := w.res.Ptr()
	// Device → host: the GPU writes the pattern, the broker copies it into the window, this
	// process's CPU checks it.
	if err := w.dev.Fill(ptr, n, 0, brokerSeedD2H); err != nil {
		return err
	}
	if err := w.pieces(ctx, broker.ToHost, n); err != nil {
		return err
	}
	rep.CPUBad = pattern.CountHost(w.view.Bytes()[w.winOff:w.winOff+n], 0, brokerSeedD2H)
	// Host → device: the CPU writes the pattern into the window, the broker copies it to the
	// device, a kernel checks it.
	pattern.FillHost(w.view.Bytes()[w.winOff:w.winOff+n], 0, brokerSeedH2D)
	// cuMemsetD8 is asynchronous for device memory: finish it before the broker writes there,
	// since the broker's copies are not ordered with this process's own work.
	if err := w.dev.Memset(ptr, 0, n); err != nil {
		return err
	}
	if err := w.dev.Synchronize(); err != nil {
		return err
	}
	if err := w.pieces(ctx, broker.ToDevice, n); err != nil {
		return err
	}
	bad, err := w.dev.Verify(ptr, n, 0, brokerSeedH2D)
	rep.GPUBad = bad
	return err
}

// bandwidth moves cmd.Bytes in requests of cmd.RequestBytes, cmd.Depth in flight, and reports when
// it started and ended.
func (w *brokerWorker) bandwidth(ctx context.Context, cmd brokerCmd, rep *brokerReport) error {
	s := cmd.RequestBytes
	dir := broker.ToDevice
	if cmd.Direction == brokerDirD2H {
		dir = broker.ToHost
	}
	count := cmd.Bytes / max(s, 1)
	hostSlots, bufSlots := w.winLen/max(s, 1), w.bufLen/max(s, 1)
	if count == 0 || hostSlots == 0 || bufSlots == 0 || cmd.Depth < 1 {
		return fmt.Errorf("requests of %s do not fit the window (%s) or the buffer (%s)", units.FormatSize(s), units.FormatSize(w.winLen), units.FormatSize(w.bufLen))
	}
	inflight := make([]*broker.Completion, 0, cmd.Depth)
	start := time.Now()
	for k := uint64(0); k < count; k++ {
		if len(inflight) == cmd.Depth {
			if err := inflight[0].Wait(ctx); err != nil {
				return err
			}
			inflight = inflight[1:]
		}
		cp, err := w.client.CopyAsync(broker.Request{Buffer: w.buf.ID(), Dir: dir,
			HostOffset: w.winOff + (k%hostSlots)*s, BufferOffset: (k % bufSlots) * s, Length: s})
		if err != nil {
			return err
		}
		inflight = append(inflight, cp)
	}
	for _, cp := range inflight {
		if err := cp.Wait(ctx); err != nil {
			return err
		}
	}
	end := time.Now()
	rep.StartNS, rep.EndNS, rep.Bytes = start.UnixNano(), end.UnixNano(), count*s
	return nil
}

// roundTrip times pings and small synchronous copies (after 10 untimed of each), medians.
func (w *brokerWorker) roundTrip(ctx context.Context, cmd brokerCmd, rep *brokerReport) error {
	var pings, rtts, copies []float64
	for i := 0; i < cmd.Samples+10; i++ {
		t0 := time.Now()
		if err := w.client.Ping(ctx); err != nil {
			return err
		}
		if i >= 10 {
			pings = append(pings, float64(time.Since(t0).Nanoseconds())/1e3)
		}
	}
	for i := 0; i < cmd.Samples+10; i++ {
		t0 := time.Now()
		cp, err := w.client.CopyAsync(broker.Request{Buffer: w.buf.ID(), Dir: broker.ToDevice, HostOffset: w.winOff, Length: brokerRTTBytes})
		if err == nil {
			err = cp.Wait(ctx)
		}
		if err != nil {
			return err
		}
		if i >= 10 {
			rtts = append(rtts, float64(time.Since(t0).Nanoseconds())/1e3)
			copies = append(copies, float64(cp.BrokerTime().Nanoseconds())/1e3)
		}
	}
	rep.PingUS, rep.RTTUS, rep.BrokerCopyUS = median(pings), median(rtts), median(copies)
	return nil
}

// pieces copies the first n bytes of the buffer to or from the start of the window, in pipelined
// pieces.
func (w *brokerWorker) pieces(ctx context.Context, dir broker.Direction, n uint64) error {
	var comps []*broker.Completion
	for off := uint64(0); off < n; off += brokerVerifyPiece {
		cp, err := w.client.CopyAsync(broker.Request{Buffer: w.buf.ID(), Dir: dir, HostOffset: w.winOff + off, BufferOffset: off,
			Length: min(brokerVerifyPiece, n-off)})
		if err != nil {
			return err
		}
		comps = append(comps, cp)
	}
	for _, cp := range comps {
		if err := cp.Wait(ctx); err != nil {
			return err
		}
	}
	return nil
}
