package measure

import (
	"errors"
	"os"
	"time"

	"github.com/cuvmm/cuvmm/internal/pattern"
	"github.com/cuvmm/cuvmm/internal/worker"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// The worker roles of the measurements with a second process (internal/worker runs them).
const (
	roleShare  = "measure-share"
	rolePinned = "measure-pinned"
	roleBroker = "measure-broker"
)

func init() {
	worker.Register(roleShare, shareChild)
}

// MaxWorkers bounds the worker processes of Pinned (Procs) and Broker (Workers): each is a process
// of its own, and more than this many only measure the machine's process limits.
const MaxWorkers = 256

// workerSetup is the first call every worker gets: the parent's backend, to open the same.
type workerSetup struct {
	Backend    string `json:"backend"`
	SimDevices int    `json:"sim_devices"`
}

func newWorkerSetup(b *Backend) workerSetup {
	return workerSetup{Backend: b.Name, SimDevices: b.Sys.DeviceCount()}
}

func (s workerSetup) open() (*Backend, error) { return OpenBackend(s.Backend, s.SimDevices, nil) }

// childBackend reads a worker's setup message into setup and opens the backend it names. When the
// backend cannot be opened it reports that to the parent and returns a nil Backend with the error of
// the report (nil once the parent has it), which the role returns as it is.
func childBackend[S interface{ open() (*Backend, error) }](c *worker.Conn, setup S) (*Backend, error) {
	if err := c.Next(setup); err != nil {
		return nil, err
	}
	b, err := setup.open()
	if err != nil {
		return nil, c.Report(nil, err)
	}
	return b, nil
}

// syncLog makes the log safe for the measurement's notes and its workers' output at once (one
// lock for all of them); a file needs none.
func (e *Env) syncLog() {
	if _, isFile := e.Log.(*os.File); e.Log != nil && !isFile {
		e.Log = worker.SyncWriter(e.Log)
	}
}

// startWorker starts a worker for role, its output going to the measurement's log, and sends it
// its setup.
func startWorker(e *Env, role string, setup any) (*worker.Process, error) {
	p, err := worker.Start(role, worker.Options{Stdout: e.Log, Stderr: e.Log})
	if err != nil {
		return nil, err
	}
	if err := p.Conn.Send(setup); err != nil {
		return nil, errors.Join(err, p.Kill())
	}
	return p, nil
}

// stopWorker reaps p after the measurement: killed after a failure (whose error is kept), waited
// for otherwise.
func stopWorker(p *worker.Process, err error) error {
	if err != nil {
		_ = p.Kill()
		return err
	}
	return p.Wait()
}

// shareSetup is the share worker's setup.
type shareSetup struct {
	workerSetup
	Device int  `json:"device"`
	CPU    bool `json:"cpu"`
}

// shareCall is a call to the share worker: "round" (the seeds of the next round; a buffer follows
// with ipc.Send), "verify" (timing done: verify and write now), "bye".
type shareCall struct {
	Op         string `json:"op"`
	ParentSeed uint64 `json:"parent_seed,omitempty"`
	ChildSeed  uint64 `json:"child_seed,omitempty"`
}

// shareReport is the share worker's report: the buffer mapped, or verified and written.
type shareReport struct {
	ImportMapUS float64 `json:"import_map_us,omitempty"`
	Mismatches  uint64  `json:"mismatches"`
}

// shareChild is the second process of Share: it opens the backend, reports, then per round receives
// the buffer, opens it (import, map, access), reports, verifies the parent's pattern, writes its
// own, and unmaps.
func shareChild(c *worker.Conn) error {
	var setup shareSetup
	b, err := childBackend(c, &setup)
	if b == nil {
		return err
	}
	defer b.Close()
	dev, err := b.Sys.Device(setup.Device)
	if err == nil {
		err = dev.LoadKernels()
	}
	if err := c.Report(nil, err); err != nil {
		return err
	}
	for {
		var call shareCall
		if err := c.Next(&call); err != nil {
			return err
		}
		if call.Op == "bye" {
			return nil
		}
		if err := shareChildRound(dev, c, call, setup.CPU); err != nil {
			return c.Report(nil, err)
		}
	}
}

func shareChildRound(dev *vmm.Device, c *worker.Conn, seeds shareCall, cpu bool) error {
	r, err := ipc.Receive(c.Unix())
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
	if err := c.Report(shareReport{ImportMapUS: us(el)}, nil); err != nil {
		return err
	}
	// The files are closed only now: closing a CUDA handle's descriptor costs time the buffer does
	// not need to wait for.
	if err := r.Close(); err != nil {
		return err
	}
	var next shareCall
	if err := c.Next(&next); err != nil || next.Op != "verify" {
		return errors.Join(err, errors.New("waiting for the parent's go-ahead to verify"))
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
	return c.Report(shareReport{Mismatches: bad}, nil)
}

// hostVerifyFill counts the words of mem that differ from the pattern under verifySeed, then writes
// the pattern under fillSeed, with the CPU.
func hostVerifyFill(mem []byte, verifySeed, fillSeed uint64) (bad uint64) {
	bad = pattern.CountHost(mem, 0, verifySeed)
	pattern.FillHost(mem, 0, fillSeed)
	return bad
}

// RunWorker runs the worker role this process was started for (by Share, Pinned, Broker or Xfer) and
// exits; in any other process it returns at once. A program that calls those measurements calls it
// first thing in main (a test binary, first thing in TestMain), since their workers are the same
// binary started again.
func RunWorker() { worker.Main() }
