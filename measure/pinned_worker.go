package measure

import (
	"errors"
	"fmt"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/pattern"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/internal/worker"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

func init() { worker.Register(rolePinned, pinnedChild) }

// pinSetup is a Pinned worker's setup.
type pinSetup struct {
	workerSetup
	Device int `json:"device"`
	// AllDevices: hold a context on every device, not only the worker's.
	AllDevices bool `json:"all_devices"`
}

// pinWindow is a part of the region the creator fills with the pattern and the workers check.
type pinWindow struct {
	Offset uint64 `json:"offset"`
	Size   uint64 `json:"size"`
}

func pinWindows(size uint64) []pinWindow {
	w := min(size, 1<<20) &^ 7
	ws := []pinWindow{{0, w}}
	if size >= 2*w {
		ws = append(ws, pinWindow{(size - w) &^ 7, w})
	}
	return ws
}

// pinCall is a call to a Pinned worker: "open" (a pinned region follows: open it as the mode
// says, check the windows) or "release" (close it and exit).
type pinCall struct {
	Op      string      `json:"op"`
	Mode    string      `json:"mode,omitempty"`
	Grant   bool        `json:"grant,omitempty"`
	Seed    uint64      `json:"seed,omitempty"`
	Windows []pinWindow `json:"windows,omitempty"`
}

// pinReport is a Pinned worker's report: context up, or region open and checked.
type pinReport struct {
	Device      int      `json:"device"`
	Free        []uint64 `json:"free,omitempty"` // per device, simulator only (its accounting is per process)
	OpenSeconds float64  `json:"open_seconds,omitempty"`
	Kind        string   `json:"kind,omitempty"`
	CPUBad      int      `json:"cpu_bad"`
	GPUBad      uint64   `json:"gpu_bad"`
	Estimate    []uint64 `json:"estimate,omitempty"` // the worker's region's PageTableCost
}

// pinnedChild is one worker of Pinned: it brings up its device's context, reports, opens the region
// the parent sends as the mode says, checks it, reports again and holds it until told to release it.
func pinnedChild(c *worker.Conn) error {
	var setup pinSetup
	b, err := childBackend(c, &setup)
	if b == nil {
		return err
	}
	defer b.Close()
	rep := pinReport{Device: setup.Device}
	d, held, err := pinChildDevices(b, setup)
	if err == nil && b.Sim() {
		rep.Free, err = pinFreeHeld(b.Sys.DeviceCount(), held)
	}
	if err := c.Report(rep, err); err != nil {
		return err
	}
	var call pinCall
	if err := c.Next(&call); err != nil {
		return err
	}
	r, err := pinChildOpen(c, d, call, &rep)
	if r != nil {
		defer r.Close()
	}
	if err == nil && b.Sim() {
		rep.Free, err = pinFreeHeld(b.Sys.DeviceCount(), held)
	}
	if err := c.Report(rep, err); err != nil {
		return err
	}
	if err := c.Next(&call); err != nil || call.Op != "release" {
		return errors.Join(err, fmt.Errorf("waiting for release: got %q", call.Op))
	}
	return r.Close()
}

// pinChildDevices opens the worker's device and loads the kernels (now, so that the module's memory
// is in the baseline), and returns the devices it holds a context on: its own, or every one (which
// retains every device's primary context).
func pinChildDevices(b *Backend, setup pinSetup) (*vmm.Device, []*vmm.Device, error) {
	d, err := b.Sys.Device(setup.Device)
	if err != nil {
		return nil, nil, err
	}
	if err := d.LoadKernels(); err != nil {
		return nil, nil, err
	}
	if !setup.AllDevices {
		return d, []*vmm.Device{d}, nil
	}
	held, err := b.Sys.Devices()
	return d, held, err
}

// pinChildOpen receives the region, opens it and checks the windows with the CPU (and, when the
// device is granted, with a kernel).
func pinChildOpen(c *worker.Conn, d *vmm.Device, call pinCall, rep *pinReport) (*pinned.Region, error) {
	opts := pinned.OpenOptions{}
	if call.Grant {
		opts.Grant = []*vmm.Device{d}
	}
	t0 := time.Now()
	r, err := pinned.Receive(c.Unix(), d, opts)
	rep.OpenSeconds = time.Since(t0).Seconds()
	if err != nil {
		return nil, err
	}
	rep.Kind = r.Kind().String()
	rep.Estimate = r.PageTableCost()
	for _, win := range call.Windows {
		if win.Offset+win.Size > r.Len() {
			return r, fmt.Errorf("window %+v outside the %s region", win, units.FormatSize(r.Len()))
		}
		rep.CPUBad += int(pattern.CountHost(r.Bytes()[win.Offset:win.Offset+win.Size], win.Offset, call.Seed))
		if call.Grant && win.Size > 0 {
			bad, err := d.Verify(r.Ptr()+driver.DevicePtr(win.Offset), win.Size, win.Offset, call.Seed)
			if err != nil {
				return r, err
			}
			rep.GPUBad += bad
		}
	}
	return r, nil
}
