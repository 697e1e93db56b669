package driver

import (
	"testing"
	"unsafe"
)

// TestRealStreamOrdered covers the stream-ordered allocation and event query calls on the real
// driver: a buffer from the default pool is written on one stream, a second stream waits for it
// through an event, the pool's counters move and TrimTo gives the memory back.
func TestRealStreamOrdered(t *testing.T) {
	a := openReal(t)
	dev, _ := bindDevice(t, a)
	const n = 8 << 20
	pool, err := a.DeviceGetDefaultMemPool(dev)
	must(t, "DeviceGetDefaultMemPool", err)
	must(t, "MemPoolSetAttribute(release threshold)", a.MemPoolSetAttribute(pool, MemPoolReleaseThreshold, 1<<40))
	defer func() { must(t, "MemPoolSetAttribute", a.MemPoolSetAttribute(pool, MemPoolReleaseThreshold, 0)) }()
	if v, err := a.MemPoolGetAttribute(pool, MemPoolReleaseThreshold); err != nil || v != 1<<40 {
		t.Fatalf("release threshold = %d, %v; want 1 TiB (a 64-bit value)", v, err)
	}
	if v, err := a.MemPoolGetAttribute(pool, MemPoolReuseAllowOpportunistic); err != nil || v > 1 {
		t.Fatalf("REUSE_ALLOW_OPPORTUNISTIC = %d, %v; want 0 or 1 (an int attribute)", v, err)
	}
	s1, err := a.StreamCreate(StreamNonBlocking)
	must(t, "StreamCreate", err)
	defer func() { must(t, "StreamDestroy", a.StreamDestroy(s1)) }()
	s2, err := a.StreamCreate(StreamNonBlocking)
	must(t, "StreamCreate", err)
	defer func() { must(t, "StreamDestroy", a.StreamDestroy(s2)) }()
	ev, err := a.EventCreate(EventDisableTiming)
	must(t, "EventCreate", err)
	defer func() { must(t, "EventDestroy", a.EventDestroy(ev)) }()
	host, err := a.MemHostAlloc(n, 0)
	must(t, "MemHostAlloc", err)
	defer func() { must(t, "MemFreeHost", a.MemFreeHost(host)) }()

	d, err := a.MemAllocAsync(n, s1)
	must(t, "MemAllocAsync", err)
	must(t, "MemsetD8Async", a.MemsetD8Async(d, 0x3c, n, s1))
	must(t, "EventRecord", a.EventRecord(ev, s1))
	must(t, "StreamWaitEvent", a.StreamWaitEvent(s2, ev, 0))
	must(t, "MemcpyDtoHAsync", a.MemcpyDtoHAsync(host, d, n, s2))
	must(t, "MemFreeAsync", a.MemFreeAsync(d, s2))
	must(t, "StreamSynchronize", a.StreamSynchronize(s2))
	if done, err := a.EventQuery(ev); err != nil || !done {
		t.Fatalf("EventQuery after the waiting stream finished = %v, %v", done, err)
	}
	for i, b := range unsafe.Slice((*byte)(host), n) {
		if b != 0x3c {
			t.Fatalf("byte %d = %#x: the copy on s2 did not wait for the memset on s1", i, b)
		}
	}
	if v, err := a.MemPoolGetAttribute(pool, MemPoolReservedMemCurrent); err != nil || v < n {
		t.Fatalf("reserved after a free with a high threshold = %d, %v; want at least %d", v, err, n)
	}
	must(t, "MemPoolTrimTo", a.MemPoolTrimTo(pool, 0))
	if v, err := a.MemPoolGetAttribute(pool, MemPoolReservedMemCurrent); err != nil || v != 0 {
		t.Errorf("reserved after TrimTo(0) = %d, %v", v, err)
	}
	if _, err := a.MemAllocAsync(1<<62, s1); err == nil {
		t.Error("MemAllocAsync of 4 EiB succeeded")
	}
}
