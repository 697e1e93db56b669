package driver

import (
	"testing"
	"unsafe"
)

// TestRealGraphs captures a fill and a copy on a stream, launches the graph after the source changed,
// and checks the rules the simulator models, logging the codes the real driver gives.
func TestRealGraphs(t *testing.T) {
	a := openReal(t)
	bindDevice(t, a)
	const n = 1 << 20
	d, err := a.MemAlloc(2 * n)
	must(t, "MemAlloc", err)
	defer func() { must(t, "MemFree", a.MemFree(d)) }()
	host, err := a.MemHostAlloc(n, 0)
	must(t, "MemHostAlloc", err)
	defer func() { must(t, "MemFreeHost", a.MemFreeHost(host)) }()
	s, err := a.StreamCreate(StreamNonBlocking)
	must(t, "StreamCreate", err)
	defer func() { must(t, "StreamDestroy", a.StreamDestroy(s)) }()

	must(t, "StreamBeginCapture", a.StreamBeginCapture(s, CaptureModeRelaxed))
	must(t, "MemsetD8Async (captured)", a.MemsetD8Async(d, 0x3c, 16, s))
	must(t, "MemcpyAsync (captured)", a.MemcpyAsync(d+n, d, n, s))
	g, err := a.StreamEndCapture(s)
	must(t, "StreamEndCapture", err)
	e, err := a.GraphInstantiate(g, 0)
	must(t, "GraphInstantiate", err)
	must(t, "GraphDestroy", a.GraphDestroy(g))

	// The capture ran nothing: write the source now; the graph's copy reads it at launch.
	b := unsafe.Slice((*byte)(host), n)
	for i := range b {
		b[i] = byte(i * 5)
	}
	must(t, "MemcpyHtoD", a.MemcpyHtoD(d, host, n))
	must(t, "GraphLaunch", a.GraphLaunch(e, s))
	must(t, "StreamSynchronize", a.StreamSynchronize(s))
	clear(b)
	must(t, "MemcpyDtoH", a.MemcpyDtoH(host, d+n, n))
	for i := range b {
		want := byte(i * 5)
		if i < 16 {
			want = 0x3c
		}
		if b[i] != want {
			t.Fatalf("byte %d after the graph = %#x, want %#x", i, b[i], want)
		}
	}
	must(t, "GraphExecDestroy", a.GraphExecDestroy(e))

	err = a.StreamBeginCapture(0, CaptureModeRelaxed)
	t.Logf("capture on the legacy stream: %v", err)
	if err == nil {
		g, _ := a.StreamEndCapture(0)
		_ = a.GraphDestroy(g)
		t.Error("the legacy stream began a capture")
	}
	_, err = a.StreamEndCapture(s)
	t.Logf("end without a capture: %v", err)
	if err == nil {
		t.Error("StreamEndCapture without a capture succeeded")
	}
	must(t, "StreamBeginCapture", a.StreamBeginCapture(s, CaptureModeRelaxed))
	err = a.StreamSynchronize(s)
	t.Logf("synchronize a capturing stream: %v", err)
	g, err = a.StreamEndCapture(s)
	t.Logf("end of that capture: %v", err)
	if err == nil {
		must(t, "GraphDestroy", a.GraphDestroy(g))
	}
}
