package driver

import "unsafe"

// API is every driver call the higher layers use. Open returns the real driver; sim.New returns the
// simulated one. Methods return nil on success, a Result for a driver error, or an error wrapping
// ErrNotSupported when the entry point is missing.
//
// Context rule: the calls marked "needs a context" act in the calling OS thread's current context,
// as the driver does. Callers (package vmm) lock the goroutine to its thread and bind the device's
// primary context with CtxSetCurrent for the duration of the call. The simulator enforces this and
// answers CUDA_ERROR_INVALID_CONTEXT when no context is current on the thread.
//
// Sizes and addresses are uint64 (size_t and CUdeviceptr on 64-bit Linux). Host pointers passed to
// asynchronous copies must stay valid and pinned until the stream has passed the copy: never pass Go
// heap memory to them.
type API interface {
	// Init calls cuInit.
	Init(flags uint32) error
	// DriverGetVersion calls cuDriverGetVersion (for example 13000 for CUDA 13.0).
	DriverGetVersion() (int, error)

	// DeviceGetCount calls cuDeviceGetCount.
	DeviceGetCount() (int, error)
	// DeviceGet calls cuDeviceGet.
	DeviceGet(ordinal int) (Device, error)
	// DeviceGetName calls cuDeviceGetName.
	DeviceGetName(dev Device) (string, error)
	// DeviceGetAttribute calls cuDeviceGetAttribute.
	DeviceGetAttribute(attr DeviceAttribute, dev Device) (int, error)
	// DeviceTotalMem calls cuDeviceTotalMem_v2.
	DeviceTotalMem(dev Device) (uint64, error)
	// DeviceCanAccessPeer calls cuDeviceCanAccessPeer.
	DeviceCanAccessPeer(dev, peer Device) (bool, error)
	// DeviceGetUUID calls cuDeviceGetUuid_v2.
	DeviceGetUUID(dev Device) ([16]byte, error)

	// DevicePrimaryCtxRetain calls cuDevicePrimaryCtxRetain.
	DevicePrimaryCtxRetain(dev Device) (Context, error)
	// DevicePrimaryCtxRelease calls cuDevicePrimaryCtxRelease_v2.
	DevicePrimaryCtxRelease(dev Device) error
	// CtxSetCurrent calls cuCtxSetCurrent (binds ctx to the calling OS thread).
	CtxSetCurrent(ctx Context) error
	// CtxGetCurrent calls cuCtxGetCurrent.
	CtxGetCurrent() (Context, error)
	// CtxSynchronize calls cuCtxSynchronize. Needs a context.
	CtxSynchronize() error

	// MemGetInfo calls cuMemGetInfo_v2 for the current context's device. Needs a context.
	MemGetInfo() (free, total uint64, err error)

	// MemCreate calls cuMemCreate. Needs a context.
	MemCreate(size uint64, prop *AllocationProp, flags uint64) (MemHandle, error)
	// MemRelease calls cuMemRelease. Needs a context.
	MemRelease(h MemHandle) error
	// MemGetAllocationGranularity calls cuMemGetAllocationGranularity. Needs a context.
	MemGetAllocationGranularity(prop *AllocationProp, option GranularityOption) (uint64, error)
	// MemGetAllocationPropertiesFromHandle calls cuMemGetAllocationPropertiesFromHandle. Needs a
	// context.
	MemGetAllocationPropertiesFromHandle(h MemHandle) (AllocationProp, error)
	// MemRetainAllocationHandle calls cuMemRetainAllocationHandle; the new handle must be released.
	// Needs a context.
	MemRetainAllocationHandle(addr DevicePtr) (MemHandle, error)
	// MemAddressReserve calls cuMemAddressReserve. Needs a context.
	MemAddressReserve(size, alignment uint64, hint DevicePtr, flags uint64) (DevicePtr, error)
	// MemAddressFree calls cuMemAddressFree. Needs a context.
	MemAddressFree(ptr DevicePtr, size uint64) error
	// MemMap calls cuMemMap. Needs a context.
	MemMap(ptr DevicePtr, size, offset uint64, h MemHandle, flags uint64) error
	// MemUnmap calls cuMemUnmap. Needs a context.
	MemUnmap(ptr DevicePtr, size uint64) error
	// MemSetAccess calls cuMemSetAccess with len(desc) descriptors. Needs a context.
	MemSetAccess(ptr DevicePtr, size uint64, desc []AccessDesc) error
	// MemGetAccess calls cuMemGetAccess. Needs a context.
	MemGetAccess(loc Location, ptr DevicePtr) (AccessFlags, error)
	// MemExportToShareableHandle calls cuMemExportToShareableHandle for HandleTypePosixFD and returns
	// the new file descriptor, owned by the caller. Needs a context.
	MemExportToShareableHandle(h MemHandle, typ HandleType, flags uint64) (fd int, err error)
	// MemExportToFabricHandle calls cuMemExportToShareableHandle for HandleTypeFabric. Needs a
	// context.
	MemExportToFabricHandle(h MemHandle, flags uint64) (FabricHandle, error)
	// MemImportFromShareableHandle calls cuMemImportFromShareableHandle with the FD passed by value.
	// The caller keeps ownership of fd. Needs a context.
	MemImportFromShareableHandle(fd int, typ HandleType) (MemHandle, error)
	// MemGetHandleForAddressRange calls cuMemGetHandleForAddressRange and returns the dma-buf FD,
	// owned by the caller. Needs a context.
	MemGetHandleForAddressRange(ptr DevicePtr, size uint64, typ RangeHandleType, flags uint64) (fd int, err error)

	// MemHostRegister calls cuMemHostRegister_v2. Needs a context.
	MemHostRegister(p unsafe.Pointer, size uint64, flags uint32) error
	// MemHostUnregister calls cuMemHostUnregister. Needs a context.
	MemHostUnregister(p unsafe.Pointer) error
	// MemHostGetDevicePointer calls cuMemHostGetDevicePointer_v2. Needs a context.
	MemHostGetDevicePointer(p unsafe.Pointer, flags uint32) (DevicePtr, error)
	// MemHostAlloc calls cuMemHostAlloc. Needs a context.
	MemHostAlloc(size uint64, flags uint32) (unsafe.Pointer, error)
	// MemFreeHost calls cuMemFreeHost. Needs a context.
	MemFreeHost(p unsafe.Pointer) error
	// MemAlloc calls cuMemAlloc_v2 (the legacy allocator, used for baselines). Needs a context.
	MemAlloc(size uint64) (DevicePtr, error)
	// MemFree calls cuMemFree_v2. Needs a context.
	MemFree(ptr DevicePtr) error

	// Memcpy calls cuMemcpy (unified addressing: either side may be host or device). Needs a context.
	Memcpy(dst, src DevicePtr, n uint64) error
	// MemcpyHtoD calls cuMemcpyHtoD_v2. Needs a context.
	MemcpyHtoD(dst DevicePtr, src unsafe.Pointer, n uint64) error
	// MemcpyDtoH calls cuMemcpyDtoH_v2. Needs a context.
	MemcpyDtoH(dst unsafe.Pointer, src DevicePtr, n uint64) error
	// MemcpyDtoD calls cuMemcpyDtoD_v2. Needs a context.
	MemcpyDtoD(dst, src DevicePtr, n uint64) error
	// MemcpyAsync calls cuMemcpyAsync. Needs a context.
	MemcpyAsync(dst, src DevicePtr, n uint64, s Stream) error
	// MemcpyHtoDAsync calls cuMemcpyHtoDAsync_v2. Needs a context.
	MemcpyHtoDAsync(dst DevicePtr, src unsafe.Pointer, n uint64, s Stream) error
	// MemcpyDtoHAsync calls cuMemcpyDtoHAsync_v2. Needs a context.
	MemcpyDtoHAsync(dst unsafe.Pointer, src DevicePtr, n uint64, s Stream) error
	// MemcpyPeerAsync calls cuMemcpyPeerAsync. Needs a context.
	MemcpyPeerAsync(dst DevicePtr, dstCtx Context, src DevicePtr, srcCtx Context, n uint64, s Stream) error
	// MemsetD8 calls cuMemsetD8_v2. Needs a context.
	MemsetD8(ptr DevicePtr, value uint8, n uint64) error
	// MemsetD32 calls cuMemsetD32_v2 (n is a count of 32-bit words). Needs a context.
	MemsetD32(ptr DevicePtr, value uint32, n uint64) error
	// MemsetD8Async calls cuMemsetD8Async. Needs a context.
	MemsetD8Async(ptr DevicePtr, value uint8, n uint64, s Stream) error

	// StreamCreate calls cuStreamCreate. Needs a context.
	StreamCreate(flags uint32) (Stream, error)
	// StreamDestroy calls cuStreamDestroy_v2. Needs a context.
	StreamDestroy(s Stream) error
	// StreamSynchronize calls cuStreamSynchronize. Needs a context.
	StreamSynchronize(s Stream) error
	// EventCreate calls cuEventCreate. Needs a context.
	EventCreate(flags uint32) (Event, error)
	// EventRecord calls cuEventRecord. Needs a context.
	EventRecord(e Event, s Stream) error
	// EventSynchronize calls cuEventSynchronize. Needs a context.
	EventSynchronize(e Event) error
	// EventElapsedTime calls cuEventElapsedTime_v2 (or cuEventElapsedTime before 12.8) and returns
	// milliseconds. Needs a context.
	EventElapsedTime(start, end Event) (float32, error)
	// EventDestroy calls cuEventDestroy_v2. Needs a context.
	EventDestroy(e Event) error

	// Stream-ordered allocation and event queries
	//
	// StreamWaitEvent calls cuStreamWaitEvent: work queued on s after this call waits until e has
	// completed (flags 0). Needs a context.
	StreamWaitEvent(s Stream, e Event, flags uint32) error
	// EventQuery calls cuEventQuery: true when the work captured by the event's last record has
	// completed (or it was never recorded), false for CUDA_ERROR_NOT_READY. Needs a context.
	EventQuery(e Event) (bool, error)
	// MemAllocAsync calls cuMemAllocAsync: size bytes from the device's current memory pool, usable
	// by work queued on s after this call. Needs a context.
	MemAllocAsync(size uint64, s Stream) (DevicePtr, error)
	// MemFreeAsync calls cuMemFreeAsync: ptr returns to its pool once s passes this point. Needs a
	// context.
	MemFreeAsync(ptr DevicePtr, s Stream) error
	// DeviceGetDefaultMemPool calls cuDeviceGetDefaultMemPool.
	DeviceGetDefaultMemPool(dev Device) (MemPool, error)
	// MemPoolSetAttribute calls cuMemPoolSetAttribute. The three REUSE attributes are C ints (0 or
	// 1), the others cuuint64_t; value is converted accordingly.
	MemPoolSetAttribute(pool MemPool, attr MemPoolAttribute, value uint64) error
	// MemPoolGetAttribute calls cuMemPoolGetAttribute (the value widened to uint64).
	MemPoolGetAttribute(pool MemPool, attr MemPoolAttribute) (uint64, error)
	// MemPoolTrimTo calls cuMemPoolTrimTo: unused memory above minBytesToKeep goes back to the
	// system.
	MemPoolTrimTo(pool MemPool, minBytesToKeep uint64) error

	// ModuleLoadData calls cuModuleLoadData with a NUL-terminated copy of image (PTX text). Needs a
	// context; the module belongs to it.
	ModuleLoadData(image []byte) (Module, error)
	// ModuleGetFunction calls cuModuleGetFunction. Needs a context.
	ModuleGetFunction(m Module, name string) (Function, error)
	// ModuleUnload calls cuModuleUnload. Needs a context.
	ModuleUnload(m Module) error
	// LaunchKernel calls cuLaunchKernel. Every kernel parameter is passed as one 8-byte value (the
	// project's kernels take only 64-bit pointers and integers). Needs the context of f's module.
	LaunchKernel(f Function, grid, block Dim3, sharedMem uint32, s Stream, args ...uint64) error

	// Graphs

	// StreamBeginCapture calls cuStreamBeginCapture_v2: from now on the work queued on s is recorded
	// into a graph instead of running. s must be a stream made by StreamCreate (the legacy stream
	// cannot capture). Use CaptureModeRelaxed from Go: goroutines move between OS threads, and the
	// other modes tie the capture to the thread that began it. Needs a context.
	StreamBeginCapture(s Stream, mode CaptureMode) error
	// StreamEndCapture calls cuStreamEndCapture and returns the graph recorded on s, owned by the
	// caller (GraphDestroy). A capture invalidated by an unsupported call fails with
	// CUDA_ERROR_STREAM_CAPTURE_INVALIDATED and ends. Needs a context.
	StreamEndCapture(s Stream) (Graph, error)
	// GraphInstantiate calls cuGraphInstantiateWithFlags; the executable graph is owned by the
	// caller (GraphExecDestroy) and is independent of g afterwards. Needs a context.
	GraphInstantiate(g Graph, flags uint64) (GraphExec, error)
	// GraphLaunch calls cuGraphLaunch: the graph's work is queued on s, with the addresses and
	// arguments it was captured with. Needs a context.
	GraphLaunch(e GraphExec, s Stream) error
	// GraphExecDestroy calls cuGraphExecDestroy. Needs a context.
	GraphExecDestroy(e GraphExec) error
	// GraphDestroy calls cuGraphDestroy. Needs a context.
	GraphDestroy(g Graph) error
}
