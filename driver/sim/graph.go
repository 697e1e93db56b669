package sim

import (
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
)

// Stream capture and graphs. A capturing stream records the asynchronous work queued on it (copies,
// fills, kernel launches, graph launches) as nodes instead of running it; cuStreamEndCapture turns the
// recording into a graph, cuGraphInstantiateWithFlags into an executable graph, and cuGraphLaunch runs
// the nodes in capture order with the arguments they were captured with: the same device addresses,
// read and written when the graph runs, not when it was captured. That is what makes a graph captured
// before memory is released and mapped again at the same address read the new memory.
//
// Rules reproduced from the driver's documentation: the legacy stream (0, 1, 2) cannot capture
// (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED); beginning a capture on a capturing stream, or ending one on a
// stream that is not capturing, is CUDA_ERROR_ILLEGAL_STATE; cuStreamSynchronize of a capturing stream
// is CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture, and so is cuCtxSynchronize
// while a stream of the context captures; work queued on the stream of an invalidated capture, and
// the capture's end, then answer CUDA_ERROR_STREAM_CAPTURE_INVALIDATED; while a stream made without
// NON_BLOCKING captures, work on the legacy stream of its context and synchronous copies and fills
// (which run there) are CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and invalidate the capture; in the global
// and thread-local modes only the thread that began the capture may end it
// (CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD). Faults armed with FailNth
// fire on the graph calls themselves ("cuGraphLaunch", ...), not on the nodes a launch replays.
//
// Where the simulator differs: an event recorded on a capturing stream is recorded at once instead of
// becoming a node, and the calls that the global and thread-local modes refuse as unsafe while a
// capture is open (synchronous copies, allocation) are allowed, as in the relaxed mode cuvmm uses,
// unless the legacy stream is involved (above).

// graphTables holds the capture and graph objects of a simulator; its zero value is empty.
type graphTables struct {
	captures map[driver.Stream]*capture
	graphs   map[driver.Graph]*graphNodes
	execs    map[driver.GraphExec]*graphNodes
}

// capture is a stream's open capture.
type capture struct {
	mode    driver.CaptureMode
	tid     int
	dev     *device
	nodes   []graphNode
	invalid bool
}

// graphNodes is a graph or an executable graph: its device and its nodes in order.
type graphNodes struct {
	dev   *device
	nodes []graphNode
}

type nodeKind int

const (
	nodeCopy nodeKind = iota
	nodeMemset
	nodeKernel
)

// graphNode is one recorded operation with the arguments it was queued with.
type graphNode struct {
	kind nodeKind
	// nodeCopy
	copy copyArgs
	// nodeMemset
	fn      string
	ptr     driver.DevicePtr
	pattern []byte
	count   uint64
	// nodeKernel
	f           driver.Function
	grid, block driver.Dim3
	shared      uint32
	args        []uint64
}

// replayPrefix marks the function name of an operation replayed by cuGraphLaunch: beginOp neither
// counts it nor fires faults for it, and it is never captured.
const replayPrefix = "graph:"

func (g *graphTables) init() {
	if g.captures == nil {
		g.captures = make(map[driver.Stream]*capture)
		g.graphs = make(map[driver.Graph]*graphNodes)
		g.execs = make(map[driver.GraphExec]*graphNodes)
	}
}

// beginOp is begin(fn, ctxBound) for the operations a graph can hold; a replayed one (replayPrefix)
// only checks the context.
func (s *Sim) beginOp(fn string) (*device, error) {
	if !strings.HasPrefix(fn, replayPrefix) {
		return s.begin(fn, ctxBound)
	}
	if s.closed {
		return nil, driver.ErrorDeinitialized
	}
	d := s.currentDevice()
	if d == nil {
		return nil, driver.ErrorInvalidContext
	}
	return d, nil
}

// captureNode records n when st is capturing and fn is not a replay; the caller holds s.mu. It
// reports whether st is capturing (the caller then returns err without running n): err is nil when n
// was recorded, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED when the capture was invalidated, as the driver
// refuses work on such a stream until the capture is ended.
func (s *Sim) captureNode(st driver.Stream, fn string, n graphNode) (capturing bool, err error) {
	if strings.HasPrefix(fn, replayPrefix) {
		return false, nil
	}
	c := s.graphs.captures[st]
	if c == nil {
		return false, nil
	}
	if c.invalid {
		return true, driver.ErrorStreamCaptureInvalidated
	}
	c.nodes = append(c.nodes, n)
	return true, nil
}

// invalidateCapture marks st's capture invalid when it has one (a synchronizing call was made on
// it); the caller holds s.mu.
func (s *Sim) invalidateCapture(st driver.Stream) bool {
	c := s.graphs.captures[st]
	if c == nil {
		return false
	}
	c.invalid = true
	return true
}

// invalidateCapturesOf marks invalid every open capture on a stream of d that which accepts (nil:
// every one; its context was synchronized) and reports whether there was one; the caller holds
// s.mu.
func (s *Sim) invalidateCapturesOf(d *device, which func(driver.Stream) bool) bool {
	found := false
	for st, c := range s.graphs.captures {
		if x := s.streams[st]; x != nil && x.dev == d && (which == nil || which(st)) {
			c.invalid = true
			found = true
		}
	}
	return found
}

// legacyDuringCapture reports whether st (nil for a synchronous call, which runs on the legacy
// stream) is the legacy stream while a stream of d made without NON_BLOCKING captures: the legacy
// stream would wait for that stream, so its use is invalid and invalidates those captures
// (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT), in every capture mode. A replayed operation is never
// refused: its graph launch was checked. The caller holds s.mu.
func (s *Sim) legacyDuringCapture(fn string, st *driver.Stream, d *device) bool {
	if strings.HasPrefix(fn, replayPrefix) || (st != nil && *st != 0 && *st != 1) {
		return false
	}
	return s.invalidateCapturesOf(d, s.blocking)
}

// StreamBeginCapture calls cuStreamBeginCapture_v2.
func (s *Sim) StreamBeginCapture(st driver.Stream, mode driver.CaptureMode) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.begin("cuStreamBeginCapture", ctxBound)
	if err != nil {
		return err
	}
	if mode < driver.CaptureModeGlobal || mode > driver.CaptureModeRelaxed {
		return driver.ErrorInvalidValue
	}
	if st == 0 || st == 1 || st == 2 {
		return driver.ErrorStreamCaptureUnsupported
	}
	if _, ok := s.streams[st]; !ok {
		return driver.ErrorInvalidHandle
	}
	s.graphs.init()
	if s.graphs.captures[st] != nil {
		return driver.ErrorIllegalState
	}
	s.graphs.captures[st] = &capture{mode: mode, tid: unix.Gettid(), dev: d}
	return nil
}

// StreamEndCapture calls cuStreamEndCapture.
func (s *Sim) StreamEndCapture(st driver.Stream) (driver.Graph, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuStreamEndCapture", ctxBound); err != nil {
		return 0, err
	}
	c := s.graphs.captures[st]
	if c == nil {
		return 0, driver.ErrorIllegalState
	}
	if c.mode != driver.CaptureModeRelaxed && c.tid != unix.Gettid() {
		return 0, driver.ErrorStreamCaptureWrongThread
	}
	delete(s.graphs.captures, st)
	if c.invalid {
		return 0, driver.ErrorStreamCaptureInvalidated
	}
	h := driver.Graph(newHandle())
	s.graphs.graphs[h] = &graphNodes{dev: c.dev, nodes: c.nodes}
	return h, nil
}

// GraphInstantiate calls cuGraphInstantiateWithFlags (flags 0 or AUTO_FREE_ON_LAUNCH, 1; the
// simulator's graphs allocate nothing, so the flag changes nothing).
func (s *Sim) GraphInstantiate(g driver.Graph, flags uint64) (driver.GraphExec, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuGraphInstantiateWithFlags", ctxBound); err != nil {
		return 0, err
	}
	gr := s.graphs.graphs[g]
	if gr == nil {
		return 0, driver.ErrorInvalidValue
	}
	if flags&^1 != 0 {
		return 0, driver.ErrorInvalidValue
	}
	h := driver.GraphExec(newHandle())
	s.graphs.execs[h] = &graphNodes{dev: gr.dev, nodes: append([]graphNode(nil), gr.nodes...)}
	return h, nil
}

// GraphLaunch calls cuGraphLaunch: it runs the nodes in order on the calling thread's context (which
// must be the graph's device) and returns the first node's error; into a capturing stream it records
// the nodes instead.
func (s *Sim) GraphLaunch(e driver.GraphExec, st driver.Stream) error {
	s.mu.Lock()
	d, err := s.begin("cuGraphLaunch", ctxBound)
	if err == nil {
		switch ex := s.graphs.execs[e]; {
		case ex == nil || !s.validStream(st):
			err = driver.ErrorInvalidHandle
		case ex.dev != d:
			err = driver.ErrorInvalidContext
		case s.streamDevice(st, d) != d:
			err = driver.ErrorInvalidHandle // a stream of another context, as for cuLaunchKernel
		case s.legacyDuringCapture("cuGraphLaunch", &st, d):
			err = driver.ErrorStreamCaptureImplicit
		}
	}
	if err != nil {
		s.mu.Unlock()
		return err
	}
	nodes := s.graphs.execs[e].nodes
	if c := s.graphs.captures[st]; c != nil {
		if c.invalid {
			err = driver.ErrorStreamCaptureInvalidated
		} else {
			c.nodes = append(c.nodes, nodes...)
		}
		s.mu.Unlock()
		return err
	}
	s.mu.Unlock()
	for _, n := range nodes {
		if err := s.replay(n, st); err != nil {
			return err
		}
	}
	return nil
}

// replay runs one node on stream st.
func (s *Sim) replay(n graphNode, st driver.Stream) error {
	switch n.kind {
	case nodeCopy:
		c := n.copy
		c.fn = replayPrefix + c.fn
		c.stream = &st
		return s.memcpy(c)
	case nodeMemset:
		return s.memset(replayPrefix+n.fn, n.ptr, n.pattern, n.count, &st)
	default:
		return s.launch(replayPrefix+"cuLaunchKernel", n.f, n.grid, n.block, n.shared, st, n.args)
	}
}

// GraphExecDestroy calls cuGraphExecDestroy; an unknown handle is CUDA_ERROR_INVALID_VALUE.
func (s *Sim) GraphExecDestroy(e driver.GraphExec) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuGraphExecDestroy", ctxBound); err != nil {
		return err
	}
	if s.graphs.execs[e] == nil {
		return driver.ErrorInvalidValue
	}
	delete(s.graphs.execs, e)
	return nil
}

// GraphDestroy calls cuGraphDestroy; an unknown handle is CUDA_ERROR_INVALID_VALUE. Executable
// graphs made from it stay valid.
func (s *Sim) GraphDestroy(g driver.Graph) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuGraphDestroy", ctxBound); err != nil {
		return err
	}
	if s.graphs.graphs[g] == nil {
		return driver.ErrorInvalidValue
	}
	delete(s.graphs.graphs, g)
	return nil
}
