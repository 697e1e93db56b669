package driver

import (
	"errors"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"github.com/cuvmm/cuvmm/internal/kernels"
)

const chunk = 2 << 20 // the granularity measured on the H200

// openReal returns the real driver, initialised, with at least one device; without one it skips
// with the reason, or fails when CUVMM_REQUIRE_GPU=1.
func openReal(t testing.TB) API {
	t.Helper()
	a, err := Open()
	if err == nil {
		err = a.Init(0)
	}
	if err == nil {
		var n int
		if n, err = a.DeviceGetCount(); err == nil && n == 0 {
			err = errors.New("the driver reports no devices")
		}
	}
	if err != nil {
		if requireGPU() {
			t.Fatalf("CUVMM_REQUIRE_GPU=1 but the real driver is not usable: %v", err)
		}
		t.Skipf("no usable CUDA driver: %v", err)
	}
	return a
}

// bindDevice locks the test to its OS thread and makes device 0's primary context current there, as
// package vmm does around each call; it undoes both at cleanup.
func bindDevice(t testing.TB, a API) (Device, Context) {
	t.Helper()
	runtime.LockOSThread()
	dev, err := a.DeviceGet(0)
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatal(err)
	}
	ctx, err := a.DevicePrimaryCtxRetain(dev)
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatal(err)
	}
	if err := a.CtxSetCurrent(ctx); err != nil {
		_ = a.DevicePrimaryCtxRelease(dev)
		runtime.UnlockOSThread()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := a.CtxSetCurrent(0); err != nil {
			t.Error(err)
		}
		if err := a.DevicePrimaryCtxRelease(dev); err != nil {
			t.Error(err)
		}
		runtime.UnlockOSThread()
	})
	return dev, ctx
}

func must(t testing.TB, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func TestRealDriverSymbols(t *testing.T) {
	a := openReal(t)
	if l, ok := a.(interface{ missingSymbols() []string }); ok {
		if m := l.missingSymbols(); len(m) != 0 {
			t.Errorf("the driver lacks %v", m)
		}
	}
	v, err := a.DriverGetVersion()
	must(t, "DriverGetVersion", err)
	t.Logf("driver version %d", v)
	if v < 11070 {
		t.Errorf("driver version %d: the project needs CUDA 11.7+", v)
	}
	// With the library loaded, errors carry the driver's own text.
	if got := ErrorInvalidValue.Name(); got != "CUDA_ERROR_INVALID_VALUE" {
		t.Errorf("driver name for 1: %q", got)
	}
	if got := ErrorNotSupported.Error(); !strings.HasPrefix(got, "CUDA_ERROR_NOT_SUPPORTED: ") {
		t.Errorf("driver text for 801: %q", got)
	}
}

// TestRealSequence runs the basic VMM sequence on device 0: create, reserve, map, set access, fill,
// copy back, export, unmap, release, free; then the pattern kernels over the mapping.
func TestRealSequence(t *testing.T) {
	a := openReal(t)
	dev, ctx := bindDevice(t, a)

	name, err := a.DeviceGetName(dev)
	must(t, "DeviceGetName", err)
	if name == "" {
		t.Error("empty device name")
	}
	total, err := a.DeviceTotalMem(dev)
	must(t, "DeviceTotalMem", err)
	uuid, err := a.DeviceGetUUID(dev)
	must(t, "DeviceGetUUID", err)
	t.Logf("device 0: %s, %d MiB, uuid %x", name, total>>20, uuid)
	if cur, err := a.CtxGetCurrent(); err != nil || cur != ctx {
		t.Errorf("CtxGetCurrent = %#x, %v; want %#x", cur, err, ctx)
	}
	for _, attr := range []DeviceAttribute{AttrVirtualMemoryManagementSupported, AttrHandleTypePosixFDSupported, AttrUnifiedAddressing} {
		v, err := a.DeviceGetAttribute(attr, dev)
		must(t, "DeviceGetAttribute", err)
		if v != 1 {
			t.Errorf("attribute %d = %d, want 1", attr, v)
		}
	}
	freeBefore, _, err := a.MemGetInfo()
	must(t, "MemGetInfo", err)

	prop := AllocationProp{Type: AllocationTypePinned, RequestedHandleTypes: HandleTypePosixFD, Location: DeviceLocation(dev)}
	for _, opt := range []GranularityOption{GranularityMinimum, GranularityRecommended} {
		g, err := a.MemGetAllocationGranularity(&prop, opt)
		must(t, "MemGetAllocationGranularity", err)
		if g != chunk {
			t.Errorf("granularity (option %d) = %d, want %d", opt, g, chunk)
		}
	}

	h, err := a.MemCreate(chunk, &prop, 0)
	must(t, "MemCreate", err)
	got, err := a.MemGetAllocationPropertiesFromHandle(h)
	must(t, "MemGetAllocationPropertiesFromHandle", err)
	if got.Type != prop.Type || got.RequestedHandleTypes != prop.RequestedHandleTypes || got.Location != prop.Location {
		t.Errorf("properties from handle %+v, created with %+v", got, prop)
	}
	ptr, err := a.MemAddressReserve(chunk, 0, 0, 0)
	must(t, "MemAddressReserve", err)
	must(t, "MemMap", a.MemMap(ptr, chunk, 0, h, 0))
	must(t, "MemSetAccess", a.MemSetAccess(ptr, chunk, []AccessDesc{{DeviceLocation(dev), AccessReadWrite}}))
	if f, err := a.MemGetAccess(DeviceLocation(dev), ptr); err != nil || f != AccessReadWrite {
		t.Errorf("MemGetAccess = %v, %v", f, err)
	}

	must(t, "MemsetD32", a.MemsetD32(ptr, 0xdeadbeef, chunk/4))
	words := make([]uint32, chunk/4)
	must(t, "MemcpyDtoH", a.MemcpyDtoH(unsafe.Pointer(&words[0]), ptr, chunk))
	for i, w := range words {
		if w != 0xdeadbeef {
			t.Fatalf("word %d = %#x after MemsetD32", i, w)
		}
	}

	retained, err := a.MemRetainAllocationHandle(ptr + 4096)
	must(t, "MemRetainAllocationHandle", err)
	must(t, "MemRelease(retained)", a.MemRelease(retained))

	fd, err := a.MemExportToShareableHandle(h, HandleTypePosixFD, 0)
	must(t, "MemExportToShareableHandle", err)
	if fd < 0 {
		t.Errorf("exported FD %d", fd)
	} else {
		// Importing in the exporting process is not what the feature is for (package ipc tests it
		// across processes); here it only shows that the FD crosses by value, so just report it.
		imported, err := a.MemImportFromShareableHandle(fd, HandleTypePosixFD)
		if err != nil {
			t.Logf("MemImportFromShareableHandle(own FD): %v", err)
		} else {
			must(t, "MemRelease(imported)", a.MemRelease(imported))
		}
		must(t, "close exported FD", syscall.Close(fd))
	}
	if ok, _ := a.DeviceGetAttribute(AttrDMABufSupported, dev); ok == 1 {
		dfd, err := a.MemGetHandleForAddressRange(ptr, chunk, RangeHandleTypeDMABufFD, 0)
		if err != nil || dfd < 0 {
			t.Errorf("MemGetHandleForAddressRange = %d, %v", dfd, err)
		} else {
			must(t, "close dma-buf FD", syscall.Close(dfd))
		}
	}

	runKernels(t, a, ptr, chunk)

	must(t, "MemUnmap", a.MemUnmap(ptr, chunk))
	must(t, "MemRelease", a.MemRelease(h))
	must(t, "MemAddressFree", a.MemAddressFree(ptr, chunk))
	if err := a.MemAddressFree(ptr, chunk); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("second MemAddressFree = %v, want CUDA_ERROR_INVALID_VALUE", err)
	}
	freeAfter, _, err := a.MemGetInfo()
	must(t, "MemGetInfo", err)
	t.Logf("free before %d MiB, after %d MiB", freeBefore>>20, freeAfter>>20)
}

// runKernels loads the project's PTX, fills [ptr, ptr+size) with the pattern and verifies it: zero
// mismatches with the right seed, every word with a wrong one.
func runKernels(t *testing.T, a API, ptr DevicePtr, size uint64) {
	t.Helper()
	m, err := a.ModuleLoadData(kernels.PTX)
	must(t, "ModuleLoadData", err)
	defer func() { must(t, "ModuleUnload", a.ModuleUnload(m)) }()
	fill, err := a.ModuleGetFunction(m, kernels.Fill)
	must(t, "ModuleGetFunction(fill)", err)
	verify, err := a.ModuleGetFunction(m, kernels.Verify)
	must(t, "ModuleGetFunction(verify)", err)
	counter, err := a.MemAlloc(8)
	must(t, "MemAlloc", err)
	defer func() { must(t, "MemFree", a.MemFree(counter)) }()

	nwords := size / kernels.WordSize
	const seed = 0x5eed
	grid, block := Dim3{256, 1, 1}, Dim3{256, 1, 1}
	must(t, "launch fill", a.LaunchKernel(fill, grid, block, 0, 0, uint64(ptr), nwords, 0, seed))
	for _, tc := range []struct {
		seed, want uint64
	}{{seed, 0}, {seed + 1, nwords}} {
		must(t, "MemsetD8(counter)", a.MemsetD8(counter, 0, 8))
		must(t, "launch verify", a.LaunchKernel(verify, grid, block, 0, 0, uint64(ptr), nwords, 0, tc.seed, uint64(counter)))
		must(t, "CtxSynchronize", a.CtxSynchronize())
		var bad uint64
		must(t, "MemcpyDtoH(counter)", a.MemcpyDtoH(unsafe.Pointer(&bad), counter, 8))
		if bad != tc.want {
			t.Errorf("verify with seed %#x: %d mismatches, want %d", tc.seed, bad, tc.want)
		}
	}
	head := make([]uint64, 4)
	must(t, "MemcpyDtoH(head)", a.MemcpyDtoH(unsafe.Pointer(&head[0]), ptr, 32))
	for i, w := range head {
		if w != kernels.Pattern(uint64(i), seed) {
			t.Errorf("word %d = %#x, want %#x", i, w, kernels.Pattern(uint64(i), seed))
		}
	}
}

// TestRealStreamsAndHostMemory covers streams, events, pinned and registered host memory.
func TestRealStreamsAndHostMemory(t *testing.T) {
	a := openReal(t)
	dev, _ := bindDevice(t, a)
	const n = 1 << 20

	host, err := a.MemHostAlloc(n, HostAllocPortable)
	must(t, "MemHostAlloc", err)
	defer func() { must(t, "MemFreeHost", a.MemFreeHost(host)) }()
	d, err := a.MemAlloc(n)
	must(t, "MemAlloc", err)
	defer func() { must(t, "MemFree", a.MemFree(d)) }()

	s, err := a.StreamCreate(StreamNonBlocking)
	must(t, "StreamCreate", err)
	defer func() { must(t, "StreamDestroy", a.StreamDestroy(s)) }()
	start, err := a.EventCreate(EventDefault)
	must(t, "EventCreate", err)
	defer func() { must(t, "EventDestroy", a.EventDestroy(start)) }()
	end, err := a.EventCreate(EventDefault)
	must(t, "EventCreate", err)
	defer func() { must(t, "EventDestroy", a.EventDestroy(end)) }()

	b := unsafe.Slice((*byte)(host), n)
	for i := range b {
		b[i] = byte(i * 7)
	}
	must(t, "EventRecord", a.EventRecord(start, s))
	must(t, "MemcpyHtoDAsync", a.MemcpyHtoDAsync(d, host, n, s))
	must(t, "MemsetD8Async", a.MemsetD8Async(d, 0x5a, 16, s))
	must(t, "MemcpyDtoHAsync", a.MemcpyDtoHAsync(host, d, n, s))
	must(t, "EventRecord", a.EventRecord(end, s))
	must(t, "EventSynchronize", a.EventSynchronize(end))
	must(t, "StreamSynchronize", a.StreamSynchronize(s))
	ms, err := a.EventElapsedTime(start, end)
	must(t, "EventElapsedTime", err)
	if ms < 0 {
		t.Errorf("elapsed %v ms", ms)
	}
	for i := range b {
		want := byte(i * 7)
		if i < 16 {
			want = 0x5a
		}
		if b[i] != want {
			t.Fatalf("byte %d = %#x after the round trip, want %#x", i, b[i], want)
		}
	}

	// Registered memory must not be Go memory: map an anonymous page range.
	region, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	must(t, "mmap", err)
	defer syscall.Munmap(region)
	p := unsafe.Pointer(&region[0])
	must(t, "MemHostRegister", a.MemHostRegister(p, n, HostRegisterDeviceMap))
	if err := a.MemHostRegister(p, n, HostRegisterDeviceMap); err != ErrorHostMemoryAlreadyRegistered {
		t.Errorf("second MemHostRegister = %v, want CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", err)
	}
	dp, err := a.MemHostGetDevicePointer(p, 0)
	must(t, "MemHostGetDevicePointer", err)
	must(t, "Memcpy", a.Memcpy(dp, d, 64))
	must(t, "MemcpyDtoD", a.MemcpyDtoD(d+n/2, d, 64))
	must(t, "CtxSynchronize", a.CtxSynchronize())
	if region[0] != 0x5a || region[16] != byte(16*7) {
		t.Errorf("registered memory after Memcpy: %x", region[:20])
	}
	must(t, "MemcpyDtoH", a.MemcpyDtoH(host, d+n/2, 64))
	if b[0] != 0x5a || b[16] != byte(16*7) {
		t.Errorf("after MemcpyDtoD: %x", b[:20])
	}
	must(t, "MemHostUnregister", a.MemHostUnregister(p))
	if err := a.MemHostUnregister(p); err != ErrorHostMemoryNotRegistered {
		t.Errorf("second MemHostUnregister = %v, want CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", err)
	}
	_ = dev
}

// TestRealPeerCopy copies between devices 0 and 1 when there are two.
func TestRealPeerCopy(t *testing.T) {
	a := openReal(t)
	if n, _ := a.DeviceGetCount(); n < 2 {
		t.Skip("one device")
	}
	_, ctx0 := bindDevice(t, a)
	dev1, err := a.DeviceGet(1)
	must(t, "DeviceGet(1)", err)
	can, err := a.DeviceCanAccessPeer(0, dev1)
	must(t, "DeviceCanAccessPeer", err)
	t.Logf("device 0 can access device 1: %v", can)
	ctx1, err := a.DevicePrimaryCtxRetain(dev1)
	must(t, "DevicePrimaryCtxRetain(1)", err)
	defer func() { must(t, "DevicePrimaryCtxRelease(1)", a.DevicePrimaryCtxRelease(dev1)) }()

	must(t, "CtxSetCurrent(1)", a.CtxSetCurrent(ctx1))
	d1, err := a.MemAlloc(4096)
	must(t, "MemAlloc on 1", err)
	must(t, "CtxSetCurrent(0)", a.CtxSetCurrent(ctx0))
	d0, err := a.MemAlloc(4096)
	must(t, "MemAlloc on 0", err)
	must(t, "MemsetD8", a.MemsetD8(d0, 0x42, 4096))
	must(t, "MemcpyPeerAsync", a.MemcpyPeerAsync(d1, ctx1, d0, ctx0, 4096, 0))
	must(t, "CtxSynchronize", a.CtxSynchronize())
	buf := make([]byte, 4096)
	must(t, "MemcpyDtoH", a.MemcpyDtoH(unsafe.Pointer(&buf[0]), d1, 4096))
	for i, b := range buf {
		if b != 0x42 {
			t.Fatalf("byte %d on device 1 = %#x", i, b)
		}
	}
	must(t, "MemFree on 0", a.MemFree(d0))
	must(t, "CtxSetCurrent(1)", a.CtxSetCurrent(ctx1))
	must(t, "MemFree on 1", a.MemFree(d1))
	must(t, "CtxSetCurrent(0)", a.CtxSetCurrent(ctx0))
}

// BenchmarkRealChunkCycle measures one 2 MiB chunk through create, reserve, map, set access, unmap,
// release and free through this package, to compare with the raw C figures in docs/driver-facts.md.
func BenchmarkRealChunkCycle(b *testing.B) {
	a := openReal(b)
	dev, _ := bindDevice(b, a)
	prop := AllocationProp{Type: AllocationTypePinned, RequestedHandleTypes: HandleTypePosixFD, Location: DeviceLocation(dev)}
	desc := []AccessDesc{{DeviceLocation(dev), AccessReadWrite}}
	b.ReportAllocs()
	for b.Loop() {
		h, err := a.MemCreate(chunk, &prop, 0)
		if err != nil {
			b.Fatal(err)
		}
		p, err := a.MemAddressReserve(chunk, 0, 0, 0)
		if err != nil {
			b.Fatal(err)
		}
		if err := a.MemMap(p, chunk, 0, h, 0); err != nil {
			b.Fatal(err)
		}
		if err := a.MemSetAccess(p, chunk, desc); err != nil {
			b.Fatal(err)
		}
		if err := a.MemUnmap(p, chunk); err != nil {
			b.Fatal(err)
		}
		if err := a.MemRelease(h); err != nil {
			b.Fatal(err)
		}
		if err := a.MemAddressFree(p, chunk); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRealGetAttribute is the cost of one trivial driver call through cgo.
func BenchmarkRealGetAttribute(b *testing.B) {
	a := openReal(b)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := a.DeviceGetAttribute(AttrVirtualMemoryManagementSupported, 0); err != nil {
			b.Fatal(err)
		}
	}
}
