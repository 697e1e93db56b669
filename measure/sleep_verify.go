package measure

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/vmm"
)

// verify checks every buffer through the address saved before the first sleep, with a kernel and
// with the graph captured then (Discard: every byte must be zero, read back whole). A failure is
// recorded in the result, not returned; a device's figures stay false once a check failed.
func (r *sleepRun) verify(when string) error {
	for i, d := range r.devs {
		bad, err := d.Verify(r.ptrs[i], r.opts.Size, 0, sleepSeed+uint64(i))
		if err != nil {
			return err
		}
		viaGraph, err := r.graphs[i].run()
		if err != nil {
			return err
		}
		ok := bad == 0
		if r.policy == offload.Discard {
			if ok, err = allZero(d, r.ptrs[i], r.opts.Size); err != nil {
				return err
			}
		}
		r.record(i, when, r.bufs[i].Ptr() == r.ptrs[i], ok, bad, viaGraph)
	}
	return nil
}

// record folds one check of device i into the result: once false, a figure stays false, and the
// first failure is described.
func (r *sleepRun) record(i int, when string, ptrOK, ok bool, bad, viaGraph uint64) {
	pd := &r.res.PerDevice[i]
	graphOK := viaGraph == bad
	pd.PtrUnchanged = pd.PtrUnchanged && ptrOK
	pd.Verified = pd.Verified && ok
	pd.GraphOK = pd.GraphOK && graphOK
	r.res.Verified = r.res.Verified && ok && graphOK
	r.res.PtrUnchanged = r.res.PtrUnchanged && ptrOK
	if (!ptrOK || !ok || !graphOK) && r.res.Failure == "" {
		r.res.Failure = fmt.Sprintf("device %d %s: ptr unchanged %v, content as expected %v, %d words differ from the pattern, the graph counted %d",
			pd.Device, when, ptrOK, ok, bad, viaGraph)
	}
}

// zeroPiece is the pinned buffer allZero reads a discarded buffer back through.
const zeroPiece = 64 << 20

// allZero copies [ptr, ptr+size) back in pieces through a pinned buffer and reports whether every
// byte is zero (vmm has no device-side zero check: Device.Verify counts differences from the
// pattern).
func allZero(d *vmm.Device, ptr driver.DevicePtr, size uint64) (ok bool, err error) {
	n := min(size, zeroPiece)
	hb, err := d.HostAlloc(n, 0)
	if err != nil {
		return false, err
	}
	defer func() { err = errors.Join(err, hb.Close()) }()
	buf, zero := hb.Bytes(), make([]byte, n)
	for off := uint64(0); off < size; off += n {
		m := min(n, size-off)
		if err := d.CopyDtoH(buf[:m], ptr+driver.DevicePtr(off)); err != nil {
			return false, err
		}
		if !bytes.Equal(buf[:m], zero[:m]) {
			return false, nil
		}
	}
	return true, nil
}

// sleepGraph is a verify kernel captured into a graph while the buffer is awake, before any sleep.
type sleepGraph struct {
	d       *vmm.Device
	st      *vmm.Stream
	counter *vmm.PlainBuffer
	exec    *vmm.GraphExec
}

// captureSleepGraph makes the graph's stream and counter and captures the verify kernel; on
// failure it closes what it made (made, not the result, which is nil on every error path).
func captureSleepGraph(d *vmm.Device, ptr driver.DevicePtr, size, seed uint64) (_ *sleepGraph, err error) {
	made := &sleepGraph{d: d}
	defer func() {
		if err != nil {
			err = errors.Join(err, made.close())
		}
	}()
	if made.st, err = d.CreateStream(vmm.StreamOptions{NonBlocking: true}); err != nil {
		return nil, err
	}
	if made.counter, err = d.AllocPlain(8); err != nil {
		return nil, err
	}
	if err = made.st.BeginCapture(); err != nil {
		return nil, err
	}
	lerr := d.LaunchVerify(ptr, size, 0, seed, made.counter.Ptr(), made.st)
	graph, err := made.st.EndCapture()
	if err = errors.Join(lerr, err); err != nil {
		return nil, errors.Join(err, graph.Close())
	}
	made.exec, err = graph.Instantiate()
	if err = errors.Join(err, graph.Close()); err != nil {
		return nil, err
	}
	return made, nil
}

// run resets the counter on the graph's stream (non-blocking: a reset on the default stream would
// not be ordered before the launch), launches the graph and returns the words it counted as
// differing.
func (g *sleepGraph) run() (uint64, error) {
	err := g.d.Raw(func(api driver.API) error { return api.MemsetD8Async(g.counter.Ptr(), 0, 8, g.st.Handle()) })
	runtime.KeepAlive(g.st)
	if err != nil {
		return 0, fmt.Errorf("reset the graph's counter: %w", err)
	}
	if err := errors.Join(g.exec.Launch(g.st), g.st.Synchronize()); err != nil {
		return 0, err
	}
	var c [8]byte
	if err := g.d.CopyDtoH(c[:], g.counter.Ptr()); err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint64(c[:]), nil
}

func (g *sleepGraph) close() error {
	if g == nil {
		return nil
	}
	return errors.Join(g.exec.Close(), g.counter.Close(), g.st.Close())
}
