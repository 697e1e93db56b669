package vmm

import (
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/pattern"
	"github.com/cuvmm/cuvmm/internal/units"
)

// BeginCapture starts recording the work queued on the stream into a graph instead of running it
// (cuStreamBeginCapture_v2, relaxed mode: goroutines move between OS threads, and the other modes tie
// a capture to one). The legacy default stream (nil) cannot capture. End with EndCapture.
func (s *Stream) BeginCapture() error {
	if s == nil {
		return fmt.Errorf("vmm: begin capture: the legacy default stream cannot capture: %w", ErrInvalidValue)
	}
	end, err := s.begin("begin capture")
	if err != nil {
		return err
	}
	defer end()
	if err := s.dev.do(func(api driver.API) error { return api.StreamBeginCapture(s.s, driver.CaptureModeRelaxed) }); err != nil {
		return fmt.Errorf("vmm: device %d: cuStreamBeginCapture: %w", s.dev.ordinal, err)
	}
	return nil
}

// EndCapture ends the capture begun with BeginCapture and returns the recorded graph
// (cuStreamEndCapture), which the caller closes.
func (s *Stream) EndCapture() (*Graph, error) {
	if s == nil {
		return nil, fmt.Errorf("vmm: end capture: the legacy default stream cannot capture: %w", ErrInvalidValue)
	}
	end, err := s.begin("end capture")
	if err != nil {
		return nil, err
	}
	defer end()
	g := &Graph{owner: owner{dev: s.dev}}
	if err := s.dev.create(&g.own, "graph", func(api driver.API) error {
		var err error
		g.g, err = api.StreamEndCapture(s.s)
		return err
	}); err != nil {
		return nil, fmt.Errorf("vmm: device %d: cuStreamEndCapture: %w", s.dev.ordinal, err)
	}
	lifetime.Track(g, &g.own)
	return g, nil
}

// Graph is a CUDA graph recorded by stream capture (CUgraph). Instantiate it to launch it.
type Graph struct {
	owner
	g driver.Graph
}

// Handle is the raw CUgraph, valid until Close.
func (g *Graph) Handle() driver.Graph { return g.g }

// Instantiate makes an executable graph (cuGraphInstantiateWithFlags), independent of g afterwards.
func (g *Graph) Instantiate() (*GraphExec, error) {
	if g == nil {
		return nil, fmt.Errorf("vmm: instantiate: nil graph: %w", ErrInvalidValue)
	}
	end, err := g.begin("instantiate a closed graph")
	if err != nil {
		return nil, err
	}
	defer end()
	e := &GraphExec{owner: owner{dev: g.dev}}
	if err := g.dev.create(&e.own, "executable graph", func(api driver.API) error {
		var err error
		e.e, err = api.GraphInstantiate(g.g, 0)
		return err
	}); err != nil {
		return nil, fmt.Errorf("vmm: device %d: cuGraphInstantiateWithFlags: %w", g.dev.ordinal, err)
	}
	lifetime.Track(e, &e.own)
	return e, nil
}

// Close destroys the graph (cuGraphDestroy), after an Instantiate in progress on another goroutine.
// Idempotent, nil-safe.
func (g *Graph) Close() error {
	if g == nil {
		return nil
	}
	return g.close("graph (cuGraphDestroy)", func(api driver.API) error { return api.GraphDestroy(g.g) })
}

// GraphExec is an executable graph (CUgraphExec). Its nodes keep the device addresses they were
// captured with: memory put to sleep and woken at the same addresses (package offload) is what a
// launch after the wake reads and writes.
type GraphExec struct {
	owner
	e driver.GraphExec
}

// Launch queues the graph's work on s (cuGraphLaunch); nil is the legacy default stream.
func (e *GraphExec) Launch(s *Stream) error {
	if e == nil {
		return fmt.Errorf("vmm: launch graph: nil graph: %w", ErrInvalidValue)
	}
	end, err := e.begin("launch a closed graph")
	if err != nil {
		return err
	}
	defer end()
	endS, err := s.begin("launch graph")
	if err != nil {
		return err
	}
	defer endS()
	if err := e.dev.do(func(api driver.API) error { return api.GraphLaunch(e.e, s.Handle()) }); err != nil {
		return fmt.Errorf("vmm: device %d: cuGraphLaunch: %w", e.dev.ordinal, err)
	}
	return nil
}

// Close destroys the executable graph (cuGraphExecDestroy), after a Launch in progress on another
// goroutine. Idempotent, nil-safe.
func (e *GraphExec) Close() error {
	if e == nil {
		return nil
	}
	return e.close("executable graph (cuGraphExecDestroy)", func(api driver.API) error { return api.GraphExecDestroy(e.e) })
}

// LaunchVerify queues the verify kernel on s: it adds to the uint64 at counter (device memory the
// device may write) the number of 8-byte words of [ptr, ptr+size) that differ from the pattern Fill
// writes with the same patternOffset and seed. Unlike Verify it does not wait, so it can be captured
// into a graph.
func (d *Device) LaunchVerify(ptr driver.DevicePtr, size, patternOffset, seed uint64, counter driver.DevicePtr, s *Stream) error {
	if err := checkPattern("verify", ptr, size, patternOffset); err != nil {
		return err
	}
	if counter == 0 || counter%8 != 0 {
		return fmt.Errorf("vmm: verify: counter address %#x is not 8-byte aligned: %w", uint64(counter), ErrInvalidValue)
	}
	end, err := s.begin("verify kernel")
	if err != nil {
		return err
	}
	defer end()
	ks, err := d.loadKernels()
	if err != nil {
		return err
	}
	err = d.do(func(api driver.API) error {
		return ks.LaunchVerify(api, s.Handle(), ptr, size/pattern.WordSize, patternOffset/pattern.WordSize, seed, counter)
	})
	if err != nil {
		return fmt.Errorf("vmm: device %d: verify %s at %#x: %w", d.ordinal, units.FormatSize(size), uint64(ptr), err)
	}
	return nil
}
