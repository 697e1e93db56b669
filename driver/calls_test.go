package driver

import (
	"errors"
	"reflect"
	"testing"
	"unsafe"

	"github.com/cuvmm/cuvmm/internal/kernels"
)

// callEnv holds arguments that are valid for the fake driver: memory from its MemHostAlloc (C
// memory, whose addresses the fake also accepts as device addresses) and a context.
type callEnv struct {
	host, spare unsafe.Pointer
	staging     unsafe.Pointer // host+128, a second host buffer
	dev         DevicePtr
	spareDev    DevicePtr
	spareAsync  DevicePtr // from MemAllocAsync, for MemFreeAsync
	ctx         Context
}

// newCallEnv prepares arguments using a; against a library without the calls it leaves zero values,
// which is fine since every call then fails before using them.
func newCallEnv(t *testing.T, a API) *callEnv {
	e := &callEnv{}
	if p, err := a.MemHostAlloc(8192, 0); err == nil {
		e.host, e.dev, e.staging = p, DevicePtr(uintptr(p)), unsafe.Add(p, 128)
		t.Cleanup(func() { _ = a.MemFreeHost(p) })
	}
	e.spare, _ = a.MemHostAlloc(64, 0)
	e.spareDev, _ = a.MemAlloc(64)
	e.spareAsync, _ = a.MemAllocAsync(64, 0)
	e.ctx, _ = a.DevicePrimaryCtxRetain(0)
	return e
}

var testProp = AllocationProp{Type: AllocationTypePinned, RequestedHandleTypes: HandleTypePosixFD, Location: DeviceLocation(0)}

// apiCalls has one entry per API method: the method, the versioned symbol it must call, and a call
// with arguments valid for the fake driver.
var apiCalls = []struct {
	method, symbol string
	call           func(a API, e *callEnv) error
}{
	{"Init", "cuInit", func(a API, e *callEnv) error { return a.Init(0) }},
	{"DriverGetVersion", "cuDriverGetVersion", func(a API, e *callEnv) error { _, err := a.DriverGetVersion(); return err }},
	{"DeviceGetCount", "cuDeviceGetCount", func(a API, e *callEnv) error { _, err := a.DeviceGetCount(); return err }},
	{"DeviceGet", "cuDeviceGet", func(a API, e *callEnv) error { _, err := a.DeviceGet(0); return err }},
	{"DeviceGetName", "cuDeviceGetName", func(a API, e *callEnv) error { _, err := a.DeviceGetName(0); return err }},
	{"DeviceGetAttribute", "cuDeviceGetAttribute", func(a API, e *callEnv) error {
		_, err := a.DeviceGetAttribute(AttrVirtualMemoryManagementSupported, 0)
		return err
	}},
	{"DeviceTotalMem", "cuDeviceTotalMem_v2", func(a API, e *callEnv) error { _, err := a.DeviceTotalMem(0); return err }},
	{"DeviceCanAccessPeer", "cuDeviceCanAccessPeer", func(a API, e *callEnv) error { _, err := a.DeviceCanAccessPeer(0, 1); return err }},
	{"DeviceGetUUID", "cuDeviceGetUuid_v2", func(a API, e *callEnv) error { _, err := a.DeviceGetUUID(0); return err }},
	{"DevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", func(a API, e *callEnv) error { _, err := a.DevicePrimaryCtxRetain(0); return err }},
	{"DevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2", func(a API, e *callEnv) error { return a.DevicePrimaryCtxRelease(0) }},
	{"CtxSetCurrent", "cuCtxSetCurrent", func(a API, e *callEnv) error { return a.CtxSetCurrent(e.ctx) }},
	{"CtxGetCurrent", "cuCtxGetCurrent", func(a API, e *callEnv) error { _, err := a.CtxGetCurrent(); return err }},
	{"CtxSynchronize", "cuCtxSynchronize", func(a API, e *callEnv) error { return a.CtxSynchronize() }},
	{"MemGetInfo", "cuMemGetInfo_v2", func(a API, e *callEnv) error { _, _, err := a.MemGetInfo(); return err }},
	{"MemCreate", "cuMemCreate", func(a API, e *callEnv) error { _, err := a.MemCreate(2<<20, &testProp, 0); return err }},
	{"MemRelease", "cuMemRelease", func(a API, e *callEnv) error { return a.MemRelease(1) }},
	{"MemGetAllocationGranularity", "cuMemGetAllocationGranularity", func(a API, e *callEnv) error {
		_, err := a.MemGetAllocationGranularity(&testProp, GranularityMinimum)
		return err
	}},
	{"MemGetAllocationPropertiesFromHandle", "cuMemGetAllocationPropertiesFromHandle", func(a API, e *callEnv) error {
		_, err := a.MemGetAllocationPropertiesFromHandle(1)
		return err
	}},
	{"MemRetainAllocationHandle", "cuMemRetainAllocationHandle", func(a API, e *callEnv) error { _, err := a.MemRetainAllocationHandle(e.dev); return err }},
	{"MemAddressReserve", "cuMemAddressReserve", func(a API, e *callEnv) error { _, err := a.MemAddressReserve(2<<20, 0, 0, 0); return err }},
	{"MemAddressFree", "cuMemAddressFree", func(a API, e *callEnv) error { return a.MemAddressFree(0x7f0000000000, 2<<20) }},
	{"MemMap", "cuMemMap", func(a API, e *callEnv) error { return a.MemMap(0x7f0000000000, 2<<20, 0, 1, 0) }},
	{"MemUnmap", "cuMemUnmap", func(a API, e *callEnv) error { return a.MemUnmap(0x7f0000000000, 2<<20) }},
	{"MemSetAccess", "cuMemSetAccess", func(a API, e *callEnv) error {
		return a.MemSetAccess(0x7f0000000000, 2<<20, []AccessDesc{{DeviceLocation(0), AccessReadWrite}})
	}},
	{"MemGetAccess", "cuMemGetAccess", func(a API, e *callEnv) error { _, err := a.MemGetAccess(DeviceLocation(0), 0x7f0000000000); return err }},
	{"MemExportToShareableHandle", "cuMemExportToShareableHandle", func(a API, e *callEnv) error {
		_, err := a.MemExportToShareableHandle(1, HandleTypePosixFD, 0)
		return err
	}},
	{"MemExportToFabricHandle", "cuMemExportToShareableHandle", func(a API, e *callEnv) error { _, err := a.MemExportToFabricHandle(1, 0); return err }},
	{"MemImportFromShareableHandle", "cuMemImportFromShareableHandle", func(a API, e *callEnv) error {
		_, err := a.MemImportFromShareableHandle(7, HandleTypePosixFD)
		return err
	}},
	{"MemGetHandleForAddressRange", "cuMemGetHandleForAddressRange", func(a API, e *callEnv) error {
		_, err := a.MemGetHandleForAddressRange(0x7f0000000000, 2<<20, RangeHandleTypeDMABufFD, 0)
		return err
	}},
	{"MemHostRegister", "cuMemHostRegister_v2", func(a API, e *callEnv) error { return a.MemHostRegister(e.host, 4096, 0) }},
	{"MemHostGetDevicePointer", "cuMemHostGetDevicePointer_v2", func(a API, e *callEnv) error { _, err := a.MemHostGetDevicePointer(e.host, 0); return err }},
	{"MemHostUnregister", "cuMemHostUnregister", func(a API, e *callEnv) error { return a.MemHostUnregister(e.host) }},
	{"MemHostAlloc", "cuMemHostAlloc", func(a API, e *callEnv) error {
		p, err := a.MemHostAlloc(64, HostAllocPortable)
		if err == nil {
			err = a.MemFreeHost(p)
		}
		return err
	}},
	{"MemFreeHost", "cuMemFreeHost", func(a API, e *callEnv) error { return a.MemFreeHost(e.spare) }},
	{"MemAlloc", "cuMemAlloc_v2", func(a API, e *callEnv) error {
		d, err := a.MemAlloc(64)
		if err == nil {
			err = a.MemFree(d)
		}
		return err
	}},
	{"MemFree", "cuMemFree_v2", func(a API, e *callEnv) error { return a.MemFree(e.spareDev) }},
	{"Memcpy", "cuMemcpy", func(a API, e *callEnv) error { return a.Memcpy(e.dev, e.dev+64, 64) }},
	{"MemcpyHtoD", "cuMemcpyHtoD_v2", func(a API, e *callEnv) error { return a.MemcpyHtoD(e.dev, e.staging, 64) }},
	{"MemcpyDtoH", "cuMemcpyDtoH_v2", func(a API, e *callEnv) error { return a.MemcpyDtoH(e.staging, e.dev, 64) }},
	{"MemcpyDtoD", "cuMemcpyDtoD_v2", func(a API, e *callEnv) error { return a.MemcpyDtoD(e.dev, e.dev+64, 64) }},
	{"MemcpyAsync", "cuMemcpyAsync", func(a API, e *callEnv) error { return a.MemcpyAsync(e.dev, e.dev+64, 64, 0) }},
	{"MemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2", func(a API, e *callEnv) error {
		return a.MemcpyHtoDAsync(e.dev, e.staging, 64, 0)
	}},
	{"MemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2", func(a API, e *callEnv) error {
		return a.MemcpyDtoHAsync(e.staging, e.dev, 64, 0)
	}},
	{"MemcpyPeerAsync", "cuMemcpyPeerAsync", func(a API, e *callEnv) error { return a.MemcpyPeerAsync(e.dev, e.ctx, e.dev+64, e.ctx, 64, 0) }},
	{"MemsetD8", "cuMemsetD8_v2", func(a API, e *callEnv) error { return a.MemsetD8(e.dev, 1, 64) }},
	{"MemsetD32", "cuMemsetD32_v2", func(a API, e *callEnv) error { return a.MemsetD32(e.dev, 1, 16) }},
	{"MemsetD8Async", "cuMemsetD8Async", func(a API, e *callEnv) error { return a.MemsetD8Async(e.dev, 1, 64, 0) }},
	{"StreamCreate", "cuStreamCreate", func(a API, e *callEnv) error { _, err := a.StreamCreate(StreamNonBlocking); return err }},
	{"StreamSynchronize", "cuStreamSynchronize", func(a API, e *callEnv) error { return a.StreamSynchronize(0) }},
	{"StreamDestroy", "cuStreamDestroy_v2", func(a API, e *callEnv) error { return a.StreamDestroy(1) }},
	{"EventCreate", "cuEventCreate", func(a API, e *callEnv) error { _, err := a.EventCreate(EventDisableTiming); return err }},
	{"EventRecord", "cuEventRecord", func(a API, e *callEnv) error { return a.EventRecord(1, 0) }},
	{"EventSynchronize", "cuEventSynchronize", func(a API, e *callEnv) error { return a.EventSynchronize(1) }},
	{"EventElapsedTime", "cuEventElapsedTime_v2", func(a API, e *callEnv) error { _, err := a.EventElapsedTime(1, 2); return err }},
	{"EventDestroy", "cuEventDestroy_v2", func(a API, e *callEnv) error { return a.EventDestroy(1) }},
	// Stream-ordered allocation and event queries.
	{"StreamWaitEvent", "cuStreamWaitEvent", func(a API, e *callEnv) error { return a.StreamWaitEvent(0, 1, 0) }},
	{"EventQuery", "cuEventQuery", func(a API, e *callEnv) error { _, err := a.EventQuery(1); return err }},
	{"MemAllocAsync", "cuMemAllocAsync", func(a API, e *callEnv) error {
		d, err := a.MemAllocAsync(64, 0)
		if err == nil {
			err = a.MemFreeAsync(d, 0)
		}
		return err
	}},
	{"MemFreeAsync", "cuMemFreeAsync", func(a API, e *callEnv) error { return a.MemFreeAsync(e.spareAsync, 0) }},
	{"DeviceGetDefaultMemPool", "cuDeviceGetDefaultMemPool", func(a API, e *callEnv) error { _, err := a.DeviceGetDefaultMemPool(0); return err }},
	{"MemPoolSetAttribute", "cuMemPoolSetAttribute", func(a API, e *callEnv) error {
		return a.MemPoolSetAttribute(1, MemPoolReleaseThreshold, 1<<40)
	}},
	{"MemPoolGetAttribute", "cuMemPoolGetAttribute", func(a API, e *callEnv) error {
		_, err := a.MemPoolGetAttribute(1, MemPoolReservedMemHigh)
		return err
	}},
	{"MemPoolTrimTo", "cuMemPoolTrimTo", func(a API, e *callEnv) error { return a.MemPoolTrimTo(1, 0) }},
	{"ModuleLoadData", "cuModuleLoadData", func(a API, e *callEnv) error { _, err := a.ModuleLoadData(kernels.PTX); return err }},
	{"ModuleGetFunction", "cuModuleGetFunction", func(a API, e *callEnv) error { _, err := a.ModuleGetFunction(1, kernels.Fill); return err }},
	{"ModuleUnload", "cuModuleUnload", func(a API, e *callEnv) error { return a.ModuleUnload(1) }},
	{"LaunchKernel", "cuLaunchKernel", func(a API, e *callEnv) error {
		return a.LaunchKernel(1, Dim3{1, 1, 1}, Dim3{32, 1, 1}, 0, 0, uint64(e.dev), 8, 0, 42)
	}},

	// Graphs
	{"StreamBeginCapture", "cuStreamBeginCapture_v2", func(a API, e *callEnv) error { return a.StreamBeginCapture(0x5001, CaptureModeRelaxed) }},
	{"StreamEndCapture", "cuStreamEndCapture", func(a API, e *callEnv) error { _, err := a.StreamEndCapture(0x5001); return err }},
	{"GraphInstantiate", "cuGraphInstantiateWithFlags", func(a API, e *callEnv) error { _, err := a.GraphInstantiate(0x7002, 0); return err }},
	{"GraphLaunch", "cuGraphLaunch", func(a API, e *callEnv) error { return a.GraphLaunch(0x7102, 0x5001) }},
	{"GraphExecDestroy", "cuGraphExecDestroy", func(a API, e *callEnv) error { return a.GraphExecDestroy(0x7102) }},
	{"GraphDestroy", "cuGraphDestroy", func(a API, e *callEnv) error { return a.GraphDestroy(0x7002) }},
}

// TestAPICallsCoverEveryMethod keeps apiCalls in step with the API interface.
func TestAPICallsCoverEveryMethod(t *testing.T) {
	have := map[string]bool{}
	for _, c := range apiCalls {
		if have[c.method] {
			t.Errorf("apiCalls lists %s twice", c.method)
		}
		have[c.method] = true
	}
	api := reflect.TypeFor[API]()
	for i := 0; i < api.NumMethod(); i++ {
		if m := api.Method(i).Name; !have[m] {
			t.Errorf("apiCalls has no entry for API.%s", m)
		}
		delete(have, api.Method(i).Name)
	}
	for m := range have {
		t.Errorf("apiCalls lists %s, which API does not have", m)
	}
}

// TestMissingSymbols loads a library with no CUDA entry points at all (the C library): it loads,
// and every call fails with a *SymbolError naming its own versioned symbol.
func TestMissingSymbols(t *testing.T) {
	a, err := OpenLibrary("libc.so.6")
	if errors.Is(err, ErrNoDriver) && cLayout() == nil {
		t.Skipf("no loader in this build: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	e := newCallEnv(t, a)
	for _, c := range apiCalls {
		err := c.call(a, e)
		var se *SymbolError
		if !errors.As(err, &se) {
			t.Errorf("%s: %v, want a *SymbolError", c.method, err)
			continue
		}
		if se.Symbol != c.symbol {
			t.Errorf("%s: the error names %s, want %s", c.method, se.Symbol, c.symbol)
		}
		if !errors.Is(err, ErrNotSupported) {
			t.Errorf("%s: %v does not match ErrNotSupported", c.method, err)
		}
	}
	_, err = a.MemCreate(2<<20, &testProp, 0)
	if want := "driver: cuMemCreate is not exported by the loaded libcuda.so.1 (needs a CUDA 10.2+ driver): not supported"; err == nil || err.Error() != want {
		t.Errorf("MemCreate error text %q, want %q", err, want)
	}
}

func TestOpenLibraryMissingFile(t *testing.T) {
	a, err := OpenLibrary("/nonexistent/libcuda.so.1")
	if a != nil || !errors.Is(err, ErrNoDriver) {
		t.Fatalf("OpenLibrary(nonexistent) = %v, %v; want ErrNoDriver", a, err)
	}
	if cLayout() != nil && !containsAll(err.Error(), "/nonexistent/libcuda.so.1", "No such file") {
		t.Errorf("the error does not carry the loader's message: %v", err)
	}
}

// TestOpenWithoutDriver: where libcuda.so.1 is missing (this development machine), Open fails with
// ErrNoDriver and says what the loader said.
func TestOpenWithoutDriver(t *testing.T) {
	a, err := Open()
	if err == nil {
		t.Skip("a CUDA driver library is installed here; see real_test.go")
	}
	if a != nil || !errors.Is(err, ErrNoDriver) {
		t.Fatalf("Open() = %v, %v; want ErrNoDriver", a, err)
	}
	if cLayout() != nil && !containsAll(err.Error(), "libcuda.so.1", "libcuda.so") {
		t.Errorf("the error does not name the libraries tried: %v", err)
	}
	// The answer is remembered, not retried.
	if _, err2 := Open(); err2 != err {
		t.Errorf("second Open() = %v, want the same error", err2)
	}
}
