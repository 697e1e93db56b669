// Package sim is a simulated CUDA driver: a pure-Go implementation of driver.API that enforces the
// rules measured on the project's H200 host (docs/driver-facts.md, section 2) with the same CUresult codes,
// so that code written against driver.API can be tested on a laptop without a GPU:
//
//	s := sim.New(sim.Devices(2))
//	defer s.Close()
//	_ = s.Init(0)
//	runtime.LockOSThread()
//	defer runtime.UnlockOSThread()
//	ctx, _ := s.DevicePrimaryCtxRetain(0)
//	_ = s.CtxSetCurrent(ctx)
//	// ... any driver.API call; s.Live() tells what is still allocated.
//
// It is a stand-in in the way a vendor's mock server is: not a model of the hardware's speed, but of
// its contract. What it makes real:
//
//   - Virtual addresses are real reservations of this process's address space (PROT_NONE, no memory),
//     so a simulated device pointer never collides with a host pointer, and 64 TiB can be reserved
//     while 1 PiB cannot. Like the driver, the simulator places reservations in a large range of its
//     own (a 4 TiB arena shared by every simulator of the process, kept for the process's life) with
//     room after each, so a hint at the end of a reservation of 32 MiB or more extends it in place.
//     A hint at the end of a reservation under 32 MiB is not taken, as the driver does not take it
//     (such reservations sit in 32 MiB blocks of its address heap): cuMemAddressReserve succeeds at
//     another address, so small reservations never extend in place.
//   - Physical allocations are memfds. An FD exported with cuMemExportToShareableHandle is a real file
//     descriptor that can be passed over a Unix socket; another process's simulator imports it and sees
//     the same bytes. Host-NUMA memory granted to the host is mapped at its virtual address, so the CPU
//     reads and writes through the same pointer as on the real driver; device memory stays PROT_NONE
//     there, so a CPU dereference of device memory faults as it would on the real driver.
//   - Contexts are bound per OS thread (by thread id), so a caller that forgets to lock its goroutine to
//     its thread and bind a context gets CUDA_ERROR_INVALID_CONTEXT here, not only on a GPU host.
//   - cuMemGetInfo counts device allocations, contexts (ContextMemory) and the page tables a GPU keeps
//     for host memory it can see (2 MiB per GiB).
//   - Copies, memsets and the project's kernels (internal/kernels) move real bytes and obey the access
//     rights of the device that performs them.
//   - FailNth makes the n-th call of any entry point fail with a chosen code and no side effect, to
//     test the undo paths of multi-step operations.
//
// # Where the simulator differs from the driver
//
// Queued work runs when something waits for it (deferred.go), not while the caller goes on, so what
// a GPU does in parallel with the host happens here at the next synchronizing call. A kernel that
// touches memory it may not access is reported then, as CUDA_ERROR_ILLEGAL_ADDRESS, as the real
// driver does; the driver's context is unusable afterwards, while the simulator's stays usable. With
// the Eager option (or CUVMM_SIM_DEFER=0) asynchronous calls complete before they return instead, and
// such a kernel makes cuLaunchKernel itself fail. Only PTX modules are accepted, and only
// kernels with a Go implementation (the built-ins of internal/kernels and those given with the Kernel
// option) can be obtained from them.
//
// # Result codes where the measurements are silent
//
// The measured rows of docs/driver-facts.md are reproduced exactly. Where they say nothing, the simulator
// answers as follows (and the tests pin these choices):
//
//   - an unknown or released allocation handle (cuMemRelease, cuMemMap, export, properties):
//     CUDA_ERROR_INVALID_VALUE;
//   - cuMemCreate for a device ordinal that does not exist: CUDA_ERROR_INVALID_DEVICE; handle types
//     WIN32 or WIN32_KMT (not available on Linux) or unknown bits: CUDA_ERROR_INVALID_VALUE;
//   - cuMemMap over a range that already holds a mapping: CUDA_ERROR_ALREADY_MAPPED; a size larger
//     than the allocation: CUDA_ERROR_INVALID_VALUE (smaller is the measured NOT_SUPPORTED);
//   - cuMemAddressFree of a range that is not exactly one reservation, or of a reservation that still
//     holds mappings: CUDA_ERROR_INVALID_VALUE;
//   - cuMemUnmap of a range outside reserved address space: CUDA_ERROR_INVALID_VALUE;
//   - cuMemSetAccess granting a device access to another device's memory when the pair cannot access
//     each other (see PeerAccess): CUDA_ERROR_PEER_ACCESS_UNSUPPORTED; a host location for device
//     memory: CUDA_ERROR_INVALID_VALUE;
//   - cuMemAddressReserve with an alignment that is not a power of two: CUDA_ERROR_INVALID_VALUE; a
//     power of two below the granularity is raised to it;
//   - cuDevicePrimaryCtxRelease of a context that is not retained: CUDA_ERROR_INVALID_CONTEXT; the last
//     release destroys the context's streams, events and modules (allocations are not context-owned);
//   - cuLaunchKernel of a function whose module belongs to another context: CUDA_ERROR_INVALID_CONTEXT;
//   - cuModuleLoadData of anything but PTX text: CUDA_ERROR_INVALID_IMAGE;
//   - cuMemsetD8/D32 or a kernel on pageable host memory (not registered nor from cuMemHostAlloc):
//     CUDA_ERROR_INVALID_VALUE / CUDA_ERROR_ILLEGAL_ADDRESS; copies may use pageable memory;
//   - cuMemHostRegister of a range that is not mapped in the process, or of simulated device
//     addresses: CUDA_ERROR_INVALID_VALUE;
//   - a kernel access that is misaligned: CUDA_ERROR_ILLEGAL_ADDRESS (the GPU says MISALIGNED_ADDRESS);
//     a KernelFunc error that is not a Result: CUDA_ERROR_LAUNCH_FAILED;
//   - device attributes the simulator does not know: CUDA_ERROR_INVALID_VALUE (set them with
//     Attribute);
//   - any call after Close: CUDA_ERROR_DEINITIALIZED.
package sim
