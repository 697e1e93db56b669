//go:build cgo && linux

package driver

/*
#cgo LDFLAGS: -ldl

// None of the trampolines calls back into Go, and none keeps a pointer it was given past its return
// (cuLaunchKernel copies the kernel parameters before returning; the module image and function name
// are copied into C memory first). Declaring so lets Go pointers to locals stay on the stack: the
// hot paths (MemCreate, MemMap, MemSetAccess, MemUnmap, MemRelease) allocate nothing.
#cgo noescape cuvmm_error_text
#cgo nocallback cuvmm_error_text
#cgo noescape cuvmm_DriverGetVersion
#cgo nocallback cuvmm_DriverGetVersion
#cgo noescape cuvmm_DeviceGet
#cgo nocallback cuvmm_DeviceGet
#cgo noescape cuvmm_DeviceGetCount
#cgo nocallback cuvmm_DeviceGetCount
#cgo noescape cuvmm_DeviceGetName
#cgo nocallback cuvmm_DeviceGetName
#cgo noescape cuvmm_DeviceGetAttribute
#cgo nocallback cuvmm_DeviceGetAttribute
#cgo noescape cuvmm_DeviceTotalMem
#cgo nocallback cuvmm_DeviceTotalMem
#cgo noescape cuvmm_DeviceCanAccessPeer
#cgo nocallback cuvmm_DeviceCanAccessPeer
#cgo noescape cuvmm_DeviceGetUuid
#cgo nocallback cuvmm_DeviceGetUuid
#cgo noescape cuvmm_DevicePrimaryCtxRetain
#cgo nocallback cuvmm_DevicePrimaryCtxRetain
#cgo noescape cuvmm_CtxGetCurrent
#cgo nocallback cuvmm_CtxGetCurrent
#cgo noescape cuvmm_MemGetInfo
#cgo nocallback cuvmm_MemGetInfo
#cgo noescape cuvmm_MemCreate
#cgo nocallback cuvmm_MemCreate
#cgo noescape cuvmm_MemGetAllocationGranularity
#cgo nocallback cuvmm_MemGetAllocationGranularity
#cgo noescape cuvmm_MemGetAllocationPropertiesFromHandle
#cgo nocallback cuvmm_MemGetAllocationPropertiesFromHandle
#cgo noescape cuvmm_MemRetainAllocationHandle
#cgo nocallback cuvmm_MemRetainAllocationHandle
#cgo noescape cuvmm_MemAddressReserve
#cgo nocallback cuvmm_MemAddressReserve
#cgo nocallback cuvmm_MemAddressFree
#cgo nocallback cuvmm_MemMap
#cgo nocallback cuvmm_MemUnmap
#cgo noescape cuvmm_MemSetAccess
#cgo nocallback cuvmm_MemSetAccess
#cgo noescape cuvmm_MemGetAccess
#cgo nocallback cuvmm_MemGetAccess
#cgo noescape cuvmm_MemExportToFD
#cgo nocallback cuvmm_MemExportToFD
#cgo noescape cuvmm_MemExportToFabric
#cgo nocallback cuvmm_MemExportToFabric
#cgo noescape cuvmm_MemImportFromFD
#cgo nocallback cuvmm_MemImportFromFD
#cgo noescape cuvmm_MemGetHandleForAddressRange
#cgo nocallback cuvmm_MemGetHandleForAddressRange
#cgo nocallback cuvmm_MemRelease
#cgo noescape cuvmm_MemHostGetDevicePointer
#cgo nocallback cuvmm_MemHostGetDevicePointer
#cgo noescape cuvmm_MemHostAlloc
#cgo nocallback cuvmm_MemHostAlloc
#cgo noescape cuvmm_MemAlloc
#cgo nocallback cuvmm_MemAlloc
#cgo noescape cuvmm_StreamCreate
#cgo nocallback cuvmm_StreamCreate
#cgo noescape cuvmm_EventCreate
#cgo nocallback cuvmm_EventCreate
#cgo noescape cuvmm_EventElapsedTime
#cgo nocallback cuvmm_EventElapsedTime
#cgo noescape cuvmm_MemAllocAsync
#cgo nocallback cuvmm_MemAllocAsync
#cgo nocallback cuvmm_MemFreeAsync
#cgo nocallback cuvmm_StreamWaitEvent
#cgo noescape cuvmm_DeviceGetDefaultMemPool
#cgo nocallback cuvmm_DeviceGetDefaultMemPool
#cgo nocallback cuvmm_MemPoolSetAttribute
#cgo noescape cuvmm_MemPoolGetAttribute
#cgo nocallback cuvmm_MemPoolGetAttribute
#cgo nocallback cuvmm_MemPoolTrimTo
#cgo noescape cuvmm_ModuleLoadData
#cgo nocallback cuvmm_ModuleLoadData
#cgo noescape cuvmm_ModuleGetFunction
#cgo nocallback cuvmm_ModuleGetFunction
#cgo noescape cuvmm_LaunchKernel
#cgo nocallback cuvmm_LaunchKernel
#cgo nocallback cuvmm_StreamBeginCapture
#cgo noescape cuvmm_StreamEndCapture
#cgo nocallback cuvmm_StreamEndCapture
#cgo noescape cuvmm_GraphInstantiate
#cgo nocallback cuvmm_GraphInstantiate
#cgo nocallback cuvmm_GraphLaunch

#include "cuda_calls.h"
*/
import "C"

import (
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"
)

// The Go types passed to C by address must have the C layout. AccessDesc is handed to cuMemSetAccess
// as the CUmemAccessDesc array itself, so a mismatch would be silent corruption: each pair of lines
// below fails to compile (constant overflow) unless the two sides are equal.
var (
	_ [unsafe.Sizeof(AccessDesc{}) - C.sizeof_CUmemAccessDesc_]struct{}
	_ [C.sizeof_CUmemAccessDesc_ - unsafe.Sizeof(AccessDesc{})]struct{}
	_ [unsafe.Offsetof(AccessDesc{}.Flags) - 8]struct{}
	_ [8 - unsafe.Offsetof(AccessDesc{}.Flags)]struct{}
	_ [unsafe.Offsetof(Location{}.ID) - 4]struct{}
	_ [4 - unsafe.Offsetof(Location{}.ID)]struct{}
	_ [unsafe.Sizeof(FabricHandle{}) - C.sizeof_CUmemFabricHandle_]struct{}
	_ [C.sizeof_CUmemFabricHandle_ - unsafe.Sizeof(FabricHandle{})]struct{}
)

// The library names Open tries, in order. libcuda.so.1 is what the driver package installs on the
// loader path; libcuda.so is the development link (or, on a machine without a driver, possibly the
// toolkit's stub, whose cuInit answers CUDA_ERROR_STUB_LIBRARY).
var openNames = []string{"libcuda.so.1", "libcuda.so"}

var (
	openOnce sync.Once
	openLib  *cudaLib
	openErr  error
)

// Open loads the CUDA driver library (libcuda.so.1, else libcuda.so) the first time it is called and
// returns the real driver; later calls return the same value. It does not call cuInit: call Init
// first. A missing library gives an error wrapping ErrNoDriver with the loader's message; an entry
// point missing from an old driver makes only the methods that need it fail, with a *SymbolError.
//
// Once a library is loaded, Result.Error uses the driver's own names and descriptions.
func Open() (API, error) {
	openOnce.Do(func() {
		var msgs []string
		for _, name := range openNames {
			l, msg := load(name)
			if l != nil {
				openLib = l
				l.useForErrorText()
				return
			}
			msgs = append(msgs, msg)
		}
		openErr = fmt.Errorf("driver: cannot load the CUDA driver library (%s): %w", strings.Join(msgs, "; "), ErrNoDriver)
	})
	if openErr != nil {
		return nil, openErr
	}
	return openLib, nil
}

// OpenLibrary loads the driver library at path (a file name for the loader's search, or a path) and
// returns an API over it, resolving the same versioned symbols as Open. It is meant for tests and
// tools: a library that lacks some or all CUDA entry points still loads, and each missing call
// returns a *SymbolError. A library that cannot be loaded gives an error wrapping ErrNoDriver.
// Libraries are never unloaded, since function pointers into them may live anywhere.
func OpenLibrary(path string) (API, error) {
	l, msg := load(path)
	if l == nil {
		return nil, fmt.Errorf("driver: cannot load %s: %w", msg, ErrNoDriver)
	}
	return l, nil
}

// cudaLib is a loaded driver library: its table of entry points, and the error each missing one
// returns. It is immutable after load, so it is safe for concurrent use.
type cudaLib struct {
	path     string
	fn       [numSymbols]unsafe.Pointer // nil where the symbol is missing
	resolved [numSymbols]string         // the name fn came from (the fallback, sometimes)
	missing  [numSymbols]error          // a *SymbolError where fn is nil, made once
}

// load dlopens path and resolves every symbol; on failure it returns nil and "path: dlerror".
func load(path string) (*cudaLib, string) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var errbuf [512]C.char
	h := C.cuvmm_dlopen(cpath, &errbuf[0], C.size_t(len(errbuf)))
	if h == nil {
		return nil, C.GoString(&errbuf[0])
	}
	l := &cudaLib{path: path}
	for i, s := range symbols {
		for _, name := range []string{s.name, s.fallback} {
			if name == "" {
				continue
			}
			cname := C.CString(name)
			p := C.cuvmm_dlsym(h, cname)
			C.free(unsafe.Pointer(cname))
			if p != nil {
				l.fn[i], l.resolved[i] = p, name
				break
			}
		}
		if l.fn[i] == nil {
			l.missing[i] = &SymbolError{Symbol: s.name, Since: s.since}
		}
	}
	return l, ""
}

// missingSymbols lists the entry points the library lacks.
func (l *cudaLib) missingSymbols() []string {
	var out []string
	for i, p := range l.fn {
		if p == nil {
			out = append(out, symbols[i].name)
		}
	}
	return out
}

// errorTextLib is the library Result.Error asks for names and descriptions; nil before Open.
var errorTextLib atomic.Pointer[cudaLib]

func init() { loadedErrorText = cudaErrorText }

// useForErrorText makes Result.Error use l's cuGetErrorName and cuGetErrorString, when it has both.
func (l *cudaLib) useForErrorText() {
	if l.fn[symGetErrorName] != nil && l.fn[symGetErrorString] != nil {
		errorTextLib.Store(l)
	}
}

func cudaErrorText(r Result) (name, desc string, ok bool) {
	l := errorTextLib.Load()
	if l == nil {
		return "", "", false
	}
	var n, d *C.char
	if C.cuvmm_error_text(l.fn[symGetErrorName], l.fn[symGetErrorString], C.int(r), &n, &d) == 0 {
		return "", "", false
	}
	// The driver's strings are static: copying them is all that is needed.
	return C.GoString(n), C.GoString(d), true
}

// result converts a trampoline's return code; never a zero Result.
func result(rc C.int) error { return Check(int32(rc)) }

// propToC fills c from p. win32HandleMetaData and the reserved bytes stay zero, as the driver
// requires.
func propToC(p *AllocationProp, c *C.CUmemAllocationProp_) {
	c._type = C.int(p.Type)
	c.requestedHandleTypes = C.int(p.RequestedHandleTypes)
	c.location._type = C.int(p.Location.Type)
	c.location.id = C.int(p.Location.ID)
	c.allocFlags.compressionType = C.uchar(p.Compression)
	if p.GPUDirectRDMACapable {
		c.allocFlags.gpuDirectRDMACapable = 1
	}
	c.allocFlags.usage = C.ushort(p.Usage)
}

func propFromC(c *C.CUmemAllocationProp_) AllocationProp {
	return AllocationProp{
		Type:                 AllocationType(c._type),
		RequestedHandleTypes: HandleType(c.requestedHandleTypes),
		Location:             Location{Type: LocationType(c.location._type), ID: int32(c.location.id)},
		Compression:          CompressionType(c.allocFlags.compressionType),
		GPUDirectRDMACapable: c.allocFlags.gpuDirectRDMACapable != 0,
		Usage:                uint16(c.allocFlags.usage),
	}
}

// cProp converts an optional prop into a pointer for C, using storage the caller provides (so it can
// live on the caller's stack).
func cProp(p *AllocationProp, storage *C.CUmemAllocationProp_) *C.CUmemAllocationProp_ {
	if p == nil {
		return nil // the driver answers CUDA_ERROR_INVALID_VALUE
	}
	propToC(p, storage)
	return storage
}

// ---- init, devices, contexts ----

// Init calls cuInit.
func (l *cudaLib) Init(flags uint32) error {
	fn := l.fn[symInit]
	if fn == nil {
		return l.missing[symInit]
	}
	return result(C.cuvmm_Init(fn, C.uint(flags)))
}

// DriverGetVersion calls cuDriverGetVersion.
func (l *cudaLib) DriverGetVersion() (int, error) {
	fn := l.fn[symDriverGetVersion]
	if fn == nil {
		return 0, l.missing[symDriverGetVersion]
	}
	var v C.int
	if err := result(C.cuvmm_DriverGetVersion(fn, &v)); err != nil {
		return 0, err
	}
	return int(v), nil
}

// DeviceGetCount calls cuDeviceGetCount.
func (l *cudaLib) DeviceGetCount() (int, error) {
	fn := l.fn[symDeviceGetCount]
	if fn == nil {
		return 0, l.missing[symDeviceGetCount]
	}
	var n C.int
	if err := result(C.cuvmm_DeviceGetCount(fn, &n)); err != nil {
		return 0, err
	}
	return int(n), nil
}

// DeviceGet calls cuDeviceGet.
func (l *cudaLib) DeviceGet(ordinal int) (Device, error) {
	fn := l.fn[symDeviceGet]
	if fn == nil {
		return 0, l.missing[symDeviceGet]
	}
	if ordinal < 0 || ordinal > math.MaxInt32 {
		return 0, ErrorInvalidDevice // as the driver answers: C.int would wrap it to another device
	}
	var d C.int
	if err := result(C.cuvmm_DeviceGet(fn, &d, C.int(ordinal))); err != nil {
		return 0, err
	}
	return Device(d), nil
}

// DeviceGetName calls cuDeviceGetName.
func (l *cudaLib) DeviceGetName(dev Device) (string, error) {
	fn := l.fn[symDeviceGetName]
	if fn == nil {
		return "", l.missing[symDeviceGetName]
	}
	var buf [256]C.char
	if err := result(C.cuvmm_DeviceGetName(fn, &buf[0], C.int(len(buf)), C.int(dev))); err != nil {
		return "", err
	}
	buf[len(buf)-1] = 0
	return C.GoString(&buf[0]), nil
}

// DeviceGetAttribute calls cuDeviceGetAttribute.
func (l *cudaLib) DeviceGetAttribute(attr DeviceAttribute, dev Device) (int, error) {
	fn := l.fn[symDeviceGetAttribute]
	if fn == nil {
		return 0, l.missing[symDeviceGetAttribute]
	}
	var v C.int
	if err := result(C.cuvmm_DeviceGetAttribute(fn, &v, C.int(attr), C.int(dev))); err != nil {
		return 0, err
	}
	return int(v), nil
}

// DeviceTotalMem calls cuDeviceTotalMem_v2.
func (l *cudaLib) DeviceTotalMem(dev Device) (uint64, error) {
	fn := l.fn[symDeviceTotalMem]
	if fn == nil {
		return 0, l.missing[symDeviceTotalMem]
	}
	var b C.size_t
	if err := result(C.cuvmm_DeviceTotalMem(fn, &b, C.int(dev))); err != nil {
		return 0, err
	}
	return uint64(b), nil
}

// DeviceCanAccessPeer calls cuDeviceCanAccessPeer.
func (l *cudaLib) DeviceCanAccessPeer(dev, peer Device) (bool, error) {
	fn := l.fn[symDeviceCanAccessPeer]
	if fn == nil {
		return false, l.missing[symDeviceCanAccessPeer]
	}
	var can C.int
	if err := result(C.cuvmm_DeviceCanAccessPeer(fn, &can, C.int(dev), C.int(peer))); err != nil {
		return false, err
	}
	return can != 0, nil
}

// DeviceGetUUID calls cuDeviceGetUuid_v2.
func (l *cudaLib) DeviceGetUUID(dev Device) ([16]byte, error) {
	var u [16]byte
	fn := l.fn[symDeviceGetUUID]
	if fn == nil {
		return u, l.missing[symDeviceGetUUID]
	}
	if err := result(C.cuvmm_DeviceGetUuid(fn, (*C.uchar)(&u[0]), C.int(dev))); err != nil {
		return [16]byte{}, err
	}
	return u, nil
}

// DevicePrimaryCtxRetain calls cuDevicePrimaryCtxRetain.
func (l *cudaLib) DevicePrimaryCtxRetain(dev Device) (Context, error) {
	fn := l.fn[symDevicePrimaryCtxRetain]
	if fn == nil {
		return 0, l.missing[symDevicePrimaryCtxRetain]
	}
	var c C.uintptr_t
	if err := result(C.cuvmm_DevicePrimaryCtxRetain(fn, &c, C.int(dev))); err != nil {
		return 0, err
	}
	return Context(c), nil
}

// DevicePrimaryCtxRelease calls cuDevicePrimaryCtxRelease_v2.
func (l *cudaLib) DevicePrimaryCtxRelease(dev Device) error {
	fn := l.fn[symDevicePrimaryCtxRelease]
	if fn == nil {
		return l.missing[symDevicePrimaryCtxRelease]
	}
	return result(C.cuvmm_DevicePrimaryCtxRelease(fn, C.int(dev)))
}

// CtxSetCurrent calls cuCtxSetCurrent.
func (l *cudaLib) CtxSetCurrent(ctx Context) error {
	fn := l.fn[symCtxSetCurrent]
	if fn == nil {
		return l.missing[symCtxSetCurrent]
	}
	return result(C.cuvmm_CtxSetCurrent(fn, C.uintptr_t(ctx)))
}

// CtxGetCurrent calls cuCtxGetCurrent.
func (l *cudaLib) CtxGetCurrent() (Context, error) {
	fn := l.fn[symCtxGetCurrent]
	if fn == nil {
		return 0, l.missing[symCtxGetCurrent]
	}
	var c C.uintptr_t
	if err := result(C.cuvmm_CtxGetCurrent(fn, &c)); err != nil {
		return 0, err
	}
	return Context(c), nil
}

// CtxSynchronize calls cuCtxSynchronize.
func (l *cudaLib) CtxSynchronize() error {
	fn := l.fn[symCtxSynchronize]
	if fn == nil {
		return l.missing[symCtxSynchronize]
	}
	return result(C.cuvmm_CtxSynchronize(fn))
}

// MemGetInfo calls cuMemGetInfo_v2.
func (l *cudaLib) MemGetInfo() (free, total uint64, err error) {
	fn := l.fn[symMemGetInfo]
	if fn == nil {
		return 0, 0, l.missing[symMemGetInfo]
	}
	var f, t C.size_t
	if err := result(C.cuvmm_MemGetInfo(fn, &f, &t)); err != nil {
		return 0, 0, err
	}
	return uint64(f), uint64(t), nil
}

// ---- virtual memory management ----

// MemCreate calls cuMemCreate.
func (l *cudaLib) MemCreate(size uint64, prop *AllocationProp, flags uint64) (MemHandle, error) {
	fn := l.fn[symMemCreate]
	if fn == nil {
		return 0, l.missing[symMemCreate]
	}
	var cp C.CUmemAllocationProp_
	var h C.ulonglong
	if err := result(C.cuvmm_MemCreate(fn, &h, C.size_t(size), cProp(prop, &cp), C.ulonglong(flags))); err != nil {
		return 0, err
	}
	return MemHandle(h), nil
}

// MemRelease calls cuMemRelease.
func (l *cudaLib) MemRelease(h MemHandle) error {
	fn := l.fn[symMemRelease]
	if fn == nil {
		return l.missing[symMemRelease]
	}
	return result(C.cuvmm_MemRelease(fn, C.ulonglong(h)))
}

// MemGetAllocationGranularity calls cuMemGetAllocationGranularity.
func (l *cudaLib) MemGetAllocationGranularity(prop *AllocationProp, option GranularityOption) (uint64, error) {
	fn := l.fn[symMemGetAllocationGranularity]
	if fn == nil {
		return 0, l.missing[symMemGetAllocationGranularity]
	}
	var cp C.CUmemAllocationProp_
	var g C.size_t
	if err := result(C.cuvmm_MemGetAllocationGranularity(fn, &g, cProp(prop, &cp), C.int(option))); err != nil {
		return 0, err
	}
	return uint64(g), nil
}

// MemGetAllocationPropertiesFromHandle calls cuMemGetAllocationPropertiesFromHandle.
func (l *cudaLib) MemGetAllocationPropertiesFromHandle(h MemHandle) (AllocationProp, error) {
	fn := l.fn[symMemGetAllocationPropertiesFromHandle]
	if fn == nil {
		return AllocationProp{}, l.missing[symMemGetAllocationPropertiesFromHandle]
	}
	var cp C.CUmemAllocationProp_
	if err := result(C.cuvmm_MemGetAllocationPropertiesFromHandle(fn, &cp, C.ulonglong(h))); err != nil {
		return AllocationProp{}, err
	}
	return propFromC(&cp), nil
}

// MemRetainAllocationHandle calls cuMemRetainAllocationHandle.
func (l *cudaLib) MemRetainAllocationHandle(addr DevicePtr) (MemHandle, error) {
	fn := l.fn[symMemRetainAllocationHandle]
	if fn == nil {
		return 0, l.missing[symMemRetainAllocationHandle]
	}
	var h C.ulonglong
	if err := result(C.cuvmm_MemRetainAllocationHandle(fn, &h, C.ulonglong(addr))); err != nil {
		return 0, err
	}
	return MemHandle(h), nil
}

// MemAddressReserve calls cuMemAddressReserve.
func (l *cudaLib) MemAddressReserve(size, alignment uint64, hint DevicePtr, flags uint64) (DevicePtr, error) {
	fn := l.fn[symMemAddressReserve]
	if fn == nil {
		return 0, l.missing[symMemAddressReserve]
	}
	var p C.ulonglong
	rc := C.cuvmm_MemAddressReserve(fn, &p, C.size_t(size), C.size_t(alignment), C.ulonglong(hint), C.ulonglong(flags))
	if err := result(rc); err != nil {
		return 0, err
	}
	return DevicePtr(p), nil
}

// MemAddressFree calls cuMemAddressFree.
func (l *cudaLib) MemAddressFree(ptr DevicePtr, size uint64) error {
	fn := l.fn[symMemAddressFree]
	if fn == nil {
		return l.missing[symMemAddressFree]
	}
	return result(C.cuvmm_MemAddressFree(fn, C.ulonglong(ptr), C.size_t(size)))
}

// MemMap calls cuMemMap.
func (l *cudaLib) MemMap(ptr DevicePtr, size, offset uint64, h MemHandle, flags uint64) error {
	fn := l.fn[symMemMap]
	if fn == nil {
		return l.missing[symMemMap]
	}
	return result(C.cuvmm_MemMap(fn, C.ulonglong(ptr), C.size_t(size), C.size_t(offset), C.ulonglong(h), C.ulonglong(flags)))
}

// MemUnmap calls cuMemUnmap.
func (l *cudaLib) MemUnmap(ptr DevicePtr, size uint64) error {
	fn := l.fn[symMemUnmap]
	if fn == nil {
		return l.missing[symMemUnmap]
	}
	return result(C.cuvmm_MemUnmap(fn, C.ulonglong(ptr), C.size_t(size)))
}

// MemSetAccess calls cuMemSetAccess. The descriptors are passed in place (AccessDesc has the C
// layout), so any number of them costs no copy and no allocation.
func (l *cudaLib) MemSetAccess(ptr DevicePtr, size uint64, desc []AccessDesc) error {
	fn := l.fn[symMemSetAccess]
	if fn == nil {
		return l.missing[symMemSetAccess]
	}
	d := (*C.CUmemAccessDesc_)(unsafe.Pointer(unsafe.SliceData(desc)))
	return result(C.cuvmm_MemSetAccess(fn, C.ulonglong(ptr), C.size_t(size), d, C.size_t(len(desc))))
}

// MemGetAccess calls cuMemGetAccess.
func (l *cudaLib) MemGetAccess(loc Location, ptr DevicePtr) (AccessFlags, error) {
	fn := l.fn[symMemGetAccess]
	if fn == nil {
		return 0, l.missing[symMemGetAccess]
	}
	var f C.ulonglong
	if err := result(C.cuvmm_MemGetAccess(fn, &f, C.int(loc.Type), C.int(loc.ID), C.ulonglong(ptr))); err != nil {
		return 0, err
	}
	return AccessFlags(f), nil
}

// MemExportToShareableHandle calls cuMemExportToShareableHandle and returns the int it writes (the
// file descriptor for HandleTypePosixFD). A FABRIC handle is 64 bytes, not an int: use
// MemExportToFabricHandle for it.
func (l *cudaLib) MemExportToShareableHandle(h MemHandle, typ HandleType, flags uint64) (int, error) {
	fn := l.fn[symMemExportToShareableHandle]
	if fn == nil {
		return -1, l.missing[symMemExportToShareableHandle]
	}
	if typ&HandleTypeFabric != 0 {
		return -1, fmt.Errorf("driver: MemExportToShareableHandle: a %v handle is not a file descriptor (use MemExportToFabricHandle): %w", typ, ErrInvalidValue)
	}
	var fd C.int
	if err := result(C.cuvmm_MemExportToFD(fn, &fd, C.ulonglong(h), C.int(typ), C.ulonglong(flags))); err != nil {
		return -1, err
	}
	return int(fd), nil
}

// MemExportToFabricHandle calls cuMemExportToShareableHandle with CU_MEM_HANDLE_TYPE_FABRIC.
func (l *cudaLib) MemExportToFabricHandle(h MemHandle, flags uint64) (FabricHandle, error) {
	var fh FabricHandle
	fn := l.fn[symMemExportToShareableHandle]
	if fn == nil {
		return fh, l.missing[symMemExportToShareableHandle]
	}
	if err := result(C.cuvmm_MemExportToFabric(fn, (*C.uchar)(&fh[0]), C.ulonglong(h), C.ulonglong(flags))); err != nil {
		return FabricHandle{}, err
	}
	return fh, nil
}

// MemImportFromShareableHandle calls cuMemImportFromShareableHandle with fd passed by value in the
// pointer argument, as the driver expects for a POSIX file descriptor. A FABRIC import would need a
// pointer to 64 bytes, so that type is refused here rather than handed to the driver as an address.
func (l *cudaLib) MemImportFromShareableHandle(fd int, typ HandleType) (MemHandle, error) {
	fn := l.fn[symMemImportFromShareableHandle]
	if fn == nil {
		return 0, l.missing[symMemImportFromShareableHandle]
	}
	if typ&HandleTypeFabric != 0 {
		return 0, fmt.Errorf("driver: MemImportFromShareableHandle: a %v handle is not a file descriptor: %w", typ, ErrInvalidValue)
	}
	if fd < 0 || fd > math.MaxInt32 {
		return 0, ErrorInvalidValue // no such descriptor: C.int would wrap it to another one
	}
	var h C.ulonglong
	if err := result(C.cuvmm_MemImportFromFD(fn, &h, C.int(fd), C.int(typ))); err != nil {
		return 0, err
	}
	return MemHandle(h), nil
}

// MemGetHandleForAddressRange calls cuMemGetHandleForAddressRange and returns the dma-buf FD.
func (l *cudaLib) MemGetHandleForAddressRange(ptr DevicePtr, size uint64, typ RangeHandleType, flags uint64) (int, error) {
	fn := l.fn[symMemGetHandleForAddressRange]
	if fn == nil {
		return -1, l.missing[symMemGetHandleForAddressRange]
	}
	var fd C.int
	rc := C.cuvmm_MemGetHandleForAddressRange(fn, &fd, C.ulonglong(ptr), C.size_t(size), C.int(typ), C.ulonglong(flags))
	if err := result(rc); err != nil {
		return -1, err
	}
	return int(fd), nil
}

// ---- host memory ----

// MemHostRegister calls cuMemHostRegister_v2.
func (l *cudaLib) MemHostRegister(p unsafe.Pointer, size uint64, flags uint32) error {
	fn := l.fn[symMemHostRegister]
	if fn == nil {
		return l.missing[symMemHostRegister]
	}
	return result(C.cuvmm_MemHostRegister(fn, p, C.size_t(size), C.uint(flags)))
}

// MemHostUnregister calls cuMemHostUnregister.
func (l *cudaLib) MemHostUnregister(p unsafe.Pointer) error {
	fn := l.fn[symMemHostUnregister]
	if fn == nil {
		return l.missing[symMemHostUnregister]
	}
	return result(C.cuvmm_MemHostUnregister(fn, p))
}

// MemHostGetDevicePointer calls cuMemHostGetDevicePointer_v2.
func (l *cudaLib) MemHostGetDevicePointer(p unsafe.Pointer, flags uint32) (DevicePtr, error) {
	fn := l.fn[symMemHostGetDevicePointer]
	if fn == nil {
		return 0, l.missing[symMemHostGetDevicePointer]
	}
	var d C.ulonglong
	if err := result(C.cuvmm_MemHostGetDevicePointer(fn, &d, p, C.uint(flags))); err != nil {
		return 0, err
	}
	return DevicePtr(d), nil
}

// MemHostAlloc calls cuMemHostAlloc.
func (l *cudaLib) MemHostAlloc(size uint64, flags uint32) (unsafe.Pointer, error) {
	fn := l.fn[symMemHostAlloc]
	if fn == nil {
		return nil, l.missing[symMemHostAlloc]
	}
	var p unsafe.Pointer
	if err := result(C.cuvmm_MemHostAlloc(fn, &p, C.size_t(size), C.uint(flags))); err != nil {
		return nil, err
	}
	return p, nil
}

// MemFreeHost calls cuMemFreeHost.
func (l *cudaLib) MemFreeHost(p unsafe.Pointer) error {
	fn := l.fn[symMemFreeHost]
	if fn == nil {
		return l.missing[symMemFreeHost]
	}
	return result(C.cuvmm_MemFreeHost(fn, p))
}

// MemAlloc calls cuMemAlloc_v2.
func (l *cudaLib) MemAlloc(size uint64) (DevicePtr, error) {
	fn := l.fn[symMemAlloc]
	if fn == nil {
		return 0, l.missing[symMemAlloc]
	}
	var d C.ulonglong
	if err := result(C.cuvmm_MemAlloc(fn, &d, C.size_t(size))); err != nil {
		return 0, err
	}
	return DevicePtr(d), nil
}

// MemFree calls cuMemFree_v2.
func (l *cudaLib) MemFree(ptr DevicePtr) error {
	fn := l.fn[symMemFree]
	if fn == nil {
		return l.missing[symMemFree]
	}
	return result(C.cuvmm_MemFree(fn, C.ulonglong(ptr)))
}

// ---- copies and fills ----

// Memcpy calls cuMemcpy.
func (l *cudaLib) Memcpy(dst, src DevicePtr, n uint64) error {
	fn := l.fn[symMemcpy]
	if fn == nil {
		return l.missing[symMemcpy]
	}
	return result(C.cuvmm_Memcpy(fn, C.ulonglong(dst), C.ulonglong(src), C.size_t(n)))
}

// MemcpyHtoD calls cuMemcpyHtoD_v2.
func (l *cudaLib) MemcpyHtoD(dst DevicePtr, src unsafe.Pointer, n uint64) error {
	fn := l.fn[symMemcpyHtoD]
	if fn == nil {
		return l.missing[symMemcpyHtoD]
	}
	return result(C.cuvmm_MemcpyHtoD(fn, C.ulonglong(dst), src, C.size_t(n)))
}

// MemcpyDtoH calls cuMemcpyDtoH_v2.
func (l *cudaLib) MemcpyDtoH(dst unsafe.Pointer, src DevicePtr, n uint64) error {
	fn := l.fn[symMemcpyDtoH]
	if fn == nil {
		return l.missing[symMemcpyDtoH]
	}
	return result(C.cuvmm_MemcpyDtoH(fn, dst, C.ulonglong(src), C.size_t(n)))
}

// MemcpyDtoD calls cuMemcpyDtoD_v2.
func (l *cudaLib) MemcpyDtoD(dst, src DevicePtr, n uint64) error {
	fn := l.fn[symMemcpyDtoD]
	if fn == nil {
		return l.missing[symMemcpyDtoD]
	}
	return result(C.cuvmm_MemcpyDtoD(fn, C.ulonglong(dst), C.ulonglong(src), C.size_t(n)))
}

// MemcpyAsync calls cuMemcpyAsync.
func (l *cudaLib) MemcpyAsync(dst, src DevicePtr, n uint64, s Stream) error {
	fn := l.fn[symMemcpyAsync]
	if fn == nil {
		return l.missing[symMemcpyAsync]
	}
	return result(C.cuvmm_MemcpyAsync(fn, C.ulonglong(dst), C.ulonglong(src), C.size_t(n), C.uintptr_t(s)))
}

// MemcpyHtoDAsync calls cuMemcpyHtoDAsync_v2.
func (l *cudaLib) MemcpyHtoDAsync(dst DevicePtr, src unsafe.Pointer, n uint64, s Stream) error {
	fn := l.fn[symMemcpyHtoDAsync]
	if fn == nil {
		return l.missing[symMemcpyHtoDAsync]
	}
	return result(C.cuvmm_MemcpyHtoDAsync(fn, C.ulonglong(dst), src, C.size_t(n), C.uintptr_t(s)))
}

// MemcpyDtoHAsync calls cuMemcpyDtoHAsync_v2.
func (l *cudaLib) MemcpyDtoHAsync(dst unsafe.Pointer, src DevicePtr, n uint64, s Stream) error {
	fn := l.fn[symMemcpyDtoHAsync]
	if fn == nil {
		return l.missing[symMemcpyDtoHAsync]
	}
	return result(C.cuvmm_MemcpyDtoHAsync(fn, dst, C.ulonglong(src), C.size_t(n), C.uintptr_t(s)))
}

// MemcpyPeerAsync calls cuMemcpyPeerAsync.
func (l *cudaLib) MemcpyPeerAsync(dst DevicePtr, dstCtx Context, src DevicePtr, srcCtx Context, n uint64, s Stream) error {
	fn := l.fn[symMemcpyPeerAsync]
	if fn == nil {
		return l.missing[symMemcpyPeerAsync]
	}
	return result(C.cuvmm_MemcpyPeerAsync(fn, C.ulonglong(dst), C.uintptr_t(dstCtx), C.ulonglong(src),
		C.uintptr_t(srcCtx), C.size_t(n), C.uintptr_t(s)))
}

// MemsetD8 calls cuMemsetD8_v2.
func (l *cudaLib) MemsetD8(ptr DevicePtr, value uint8, n uint64) error {
	fn := l.fn[symMemsetD8]
	if fn == nil {
		return l.missing[symMemsetD8]
	}
	return result(C.cuvmm_MemsetD8(fn, C.ulonglong(ptr), C.uchar(value), C.size_t(n)))
}

// MemsetD32 calls cuMemsetD32_v2.
func (l *cudaLib) MemsetD32(ptr DevicePtr, value uint32, n uint64) error {
	fn := l.fn[symMemsetD32]
	if fn == nil {
		return l.missing[symMemsetD32]
	}
	return result(C.cuvmm_MemsetD32(fn, C.ulonglong(ptr), C.uint(value), C.size_t(n)))
}

// MemsetD8Async calls cuMemsetD8Async.
func (l *cudaLib) MemsetD8Async(ptr DevicePtr, value uint8, n uint64, s Stream) error {
	fn := l.fn[symMemsetD8Async]
	if fn == nil {
		return l.missing[symMemsetD8Async]
	}
	return result(C.cuvmm_MemsetD8Async(fn, C.ulonglong(ptr), C.uchar(value), C.size_t(n), C.uintptr_t(s)))
}

// ---- streams and events ----

// StreamCreate calls cuStreamCreate.
func (l *cudaLib) StreamCreate(flags uint32) (Stream, error) {
	fn := l.fn[symStreamCreate]
	if fn == nil {
		return 0, l.missing[symStreamCreate]
	}
	var s C.uintptr_t
	if err := result(C.cuvmm_StreamCreate(fn, &s, C.uint(flags))); err != nil {
		return 0, err
	}
	return Stream(s), nil
}

// handleCall calls a one-handle entry point (destroy, synchronize, unload).
func (l *cudaLib) handleCall(sym symbol, h uintptr) error {
	fn := l.fn[sym]
	if fn == nil {
		return l.missing[sym]
	}
	return result(C.cuvmm_handle_call(fn, C.uintptr_t(h)))
}

// StreamDestroy calls cuStreamDestroy_v2.
func (l *cudaLib) StreamDestroy(s Stream) error { return l.handleCall(symStreamDestroy, uintptr(s)) }

// StreamSynchronize calls cuStreamSynchronize.
func (l *cudaLib) StreamSynchronize(s Stream) error {
	return l.handleCall(symStreamSynchronize, uintptr(s))
}

// EventCreate calls cuEventCreate.
func (l *cudaLib) EventCreate(flags uint32) (Event, error) {
	fn := l.fn[symEventCreate]
	if fn == nil {
		return 0, l.missing[symEventCreate]
	}
	var e C.uintptr_t
	if err := result(C.cuvmm_EventCreate(fn, &e, C.uint(flags))); err != nil {
		return 0, err
	}
	return Event(e), nil
}

// EventRecord calls cuEventRecord.
func (l *cudaLib) EventRecord(e Event, s Stream) error {
	fn := l.fn[symEventRecord]
	if fn == nil {
		return l.missing[symEventRecord]
	}
	return result(C.cuvmm_EventRecord(fn, C.uintptr_t(e), C.uintptr_t(s)))
}

// EventSynchronize calls cuEventSynchronize.
func (l *cudaLib) EventSynchronize(e Event) error {
	return l.handleCall(symEventSynchronize, uintptr(e))
}

// EventElapsedTime calls cuEventElapsedTime_v2, or cuEventElapsedTime on drivers before 12.8.
func (l *cudaLib) EventElapsedTime(start, end Event) (float32, error) {
	fn := l.fn[symEventElapsedTime]
	if fn == nil {
		return 0, l.missing[symEventElapsedTime]
	}
	var ms C.float
	if err := result(C.cuvmm_EventElapsedTime(fn, &ms, C.uintptr_t(start), C.uintptr_t(end))); err != nil {
		return 0, err
	}
	return float32(ms), nil
}

// EventDestroy calls cuEventDestroy_v2.
func (l *cudaLib) EventDestroy(e Event) error { return l.handleCall(symEventDestroy, uintptr(e)) }

// ---- stream-ordered allocation and event queries ----

// StreamWaitEvent calls cuStreamWaitEvent.
func (l *cudaLib) StreamWaitEvent(s Stream, e Event, flags uint32) error {
	fn := l.fn[symStreamWaitEvent]
	if fn == nil {
		return l.missing[symStreamWaitEvent]
	}
	return result(C.cuvmm_StreamWaitEvent(fn, C.uintptr_t(s), C.uintptr_t(e), C.uint(flags)))
}

// EventQuery calls cuEventQuery; CUDA_ERROR_NOT_READY is (false, nil).
func (l *cudaLib) EventQuery(e Event) (bool, error) {
	err := l.handleCall(symEventQuery, uintptr(e))
	if r, ok := err.(Result); ok && r == ErrorNotReady {
		return false, nil
	}
	return err == nil, err
}

// MemAllocAsync calls cuMemAllocAsync.
func (l *cudaLib) MemAllocAsync(size uint64, s Stream) (DevicePtr, error) {
	fn := l.fn[symMemAllocAsync]
	if fn == nil {
		return 0, l.missing[symMemAllocAsync]
	}
	var d C.ulonglong
	if err := result(C.cuvmm_MemAllocAsync(fn, &d, C.size_t(size), C.uintptr_t(s))); err != nil {
		return 0, err
	}
	return DevicePtr(d), nil
}

// MemFreeAsync calls cuMemFreeAsync.
func (l *cudaLib) MemFreeAsync(ptr DevicePtr, s Stream) error {
	fn := l.fn[symMemFreeAsync]
	if fn == nil {
		return l.missing[symMemFreeAsync]
	}
	return result(C.cuvmm_MemFreeAsync(fn, C.ulonglong(ptr), C.uintptr_t(s)))
}

// DeviceGetDefaultMemPool calls cuDeviceGetDefaultMemPool.
func (l *cudaLib) DeviceGetDefaultMemPool(dev Device) (MemPool, error) {
	fn := l.fn[symDeviceGetDefaultMemPool]
	if fn == nil {
		return 0, l.missing[symDeviceGetDefaultMemPool]
	}
	var p C.uintptr_t
	if err := result(C.cuvmm_DeviceGetDefaultMemPool(fn, &p, C.int(dev))); err != nil {
		return 0, err
	}
	return MemPool(p), nil
}

// MemPoolSetAttribute calls cuMemPoolSetAttribute.
func (l *cudaLib) MemPoolSetAttribute(pool MemPool, attr MemPoolAttribute, value uint64) error {
	fn := l.fn[symMemPoolSetAttribute]
	if fn == nil {
		return l.missing[symMemPoolSetAttribute]
	}
	return result(C.cuvmm_MemPoolSetAttribute(fn, C.uintptr_t(pool), C.int(attr), C.ulonglong(value)))
}

// MemPoolGetAttribute calls cuMemPoolGetAttribute.
func (l *cudaLib) MemPoolGetAttribute(pool MemPool, attr MemPoolAttribute) (uint64, error) {
	fn := l.fn[symMemPoolGetAttribute]
	if fn == nil {
		return 0, l.missing[symMemPoolGetAttribute]
	}
	var v C.ulonglong
	if err := result(C.cuvmm_MemPoolGetAttribute(fn, C.uintptr_t(pool), C.int(attr), &v)); err != nil {
		return 0, err
	}
	return uint64(v), nil
}

// MemPoolTrimTo calls cuMemPoolTrimTo.
func (l *cudaLib) MemPoolTrimTo(pool MemPool, minBytesToKeep uint64) error {
	fn := l.fn[symMemPoolTrimTo]
	if fn == nil {
		return l.missing[symMemPoolTrimTo]
	}
	return result(C.cuvmm_MemPoolTrimTo(fn, C.uintptr_t(pool), C.size_t(minBytesToKeep)))
}

// ---- modules and kernels ----

// ModuleLoadData calls cuModuleLoadData with a NUL-terminated C copy of image.
func (l *cudaLib) ModuleLoadData(image []byte) (Module, error) {
	fn := l.fn[symModuleLoadData]
	if fn == nil {
		return 0, l.missing[symModuleLoadData]
	}
	var m C.uintptr_t
	rc := C.cuvmm_ModuleLoadData(fn, &m, unsafe.Pointer(unsafe.SliceData(image)), C.size_t(len(image)))
	if err := result(rc); err != nil {
		return 0, err
	}
	return Module(m), nil
}

// ModuleGetFunction calls cuModuleGetFunction.
func (l *cudaLib) ModuleGetFunction(m Module, name string) (Function, error) {
	fn := l.fn[symModuleGetFunction]
	if fn == nil {
		return 0, l.missing[symModuleGetFunction]
	}
	if strings.IndexByte(name, 0) >= 0 {
		return 0, fmt.Errorf("driver: ModuleGetFunction: name %q contains a NUL byte: %w", name, ErrInvalidValue)
	}
	var f C.uintptr_t
	cname := (*C.char)(unsafe.Pointer(unsafe.StringData(name)))
	if err := result(C.cuvmm_ModuleGetFunction(fn, &f, C.uintptr_t(m), cname, C.size_t(len(name)))); err != nil {
		return 0, err
	}
	return Function(f), nil
}

// ModuleUnload calls cuModuleUnload.
func (l *cudaLib) ModuleUnload(m Module) error { return l.handleCall(symModuleUnload, uintptr(m)) }

// LaunchKernel calls cuLaunchKernel with kernelParams pointing at each of args in place (built on
// the C stack for up to 32 arguments) and extra = NULL.
func (l *cudaLib) LaunchKernel(f Function, grid, block Dim3, sharedMem uint32, s Stream, args ...uint64) error {
	fn := l.fn[symLaunchKernel]
	if fn == nil {
		return l.missing[symLaunchKernel]
	}
	return result(C.cuvmm_LaunchKernel(fn, C.uintptr_t(f),
		C.uint(grid.X), C.uint(grid.Y), C.uint(grid.Z),
		C.uint(block.X), C.uint(block.Y), C.uint(block.Z),
		C.uint(sharedMem), C.uintptr_t(s),
		(*C.ulonglong)(unsafe.Pointer(unsafe.SliceData(args))), C.size_t(len(args))))
}

// ---- graphs ----

// StreamBeginCapture calls cuStreamBeginCapture_v2.
func (l *cudaLib) StreamBeginCapture(s Stream, mode CaptureMode) error {
	fn := l.fn[symStreamBeginCapture]
	if fn == nil {
		return l.missing[symStreamBeginCapture]
	}
	return result(C.cuvmm_StreamBeginCapture(fn, C.uintptr_t(s), C.int(mode)))
}

// StreamEndCapture calls cuStreamEndCapture.
func (l *cudaLib) StreamEndCapture(s Stream) (Graph, error) {
	fn := l.fn[symStreamEndCapture]
	if fn == nil {
		return 0, l.missing[symStreamEndCapture]
	}
	var g C.uintptr_t
	if err := result(C.cuvmm_StreamEndCapture(fn, C.uintptr_t(s), &g)); err != nil {
		return 0, err
	}
	return Graph(g), nil
}

// GraphInstantiate calls cuGraphInstantiateWithFlags.
func (l *cudaLib) GraphInstantiate(g Graph, flags uint64) (GraphExec, error) {
	fn := l.fn[symGraphInstantiate]
	if fn == nil {
		return 0, l.missing[symGraphInstantiate]
	}
	var e C.uintptr_t
	if err := result(C.cuvmm_GraphInstantiate(fn, &e, C.uintptr_t(g), C.ulonglong(flags))); err != nil {
		return 0, err
	}
	return GraphExec(e), nil
}

// GraphLaunch calls cuGraphLaunch.
func (l *cudaLib) GraphLaunch(e GraphExec, s Stream) error {
	fn := l.fn[symGraphLaunch]
	if fn == nil {
		return l.missing[symGraphLaunch]
	}
	return result(C.cuvmm_GraphLaunch(fn, C.uintptr_t(e), C.uintptr_t(s)))
}

// GraphExecDestroy calls cuGraphExecDestroy.
func (l *cudaLib) GraphExecDestroy(e GraphExec) error {
	return l.handleCall(symGraphExecDestroy, uintptr(e))
}

// GraphDestroy calls cuGraphDestroy.
func (l *cudaLib) GraphDestroy(g Graph) error { return l.handleCall(symGraphDestroy, uintptr(g)) }
