// Package offload puts GPU memory to sleep and wakes it at the same addresses.
//
// A Set holds buffers (any vmm.Chunked that cuvmm owns: growbuf.Buffer, stripe.Range, a
// reservation's mappings through Mappings), each added with a tag and a policy:
//
//   - Keep: the content is backed up in pinned host memory and restored on wake.
//   - Discard: the content is dropped; woken memory is zeroed (or left undefined with NoZero).
//   - File: the content is written to an io.WriterAt at sleep and read back from it at wake.
//
// Sleep waits for the work queued on the buffers, copies the content out, then unmaps and releases
// the physical memory (the device's free memory rises by that much), keeping the reservations and
// the access description of every chunk. Wake creates chunks with the same properties (location,
// handle types, compression, RDMA flag) at the same offsets, grants the same access and restores the
// content. Every address stays valid: Ptr is unchanged, a kernel launched with a pointer saved before
// Sleep reads the restored bytes, and so does a CUDA graph captured before Sleep and launched after
// Wake (vmm.Stream.BeginCapture, vmm.GraphExec.Launch).
//
//	set := offload.NewSet(sys, offload.Options{})
//	defer set.Close()
//	_ = set.Add("weights", weights, offload.Keep, offload.EntryOptions{})
//	_ = set.Add("kv", kv, offload.Discard, offload.EntryOptions{})
//	_ = set.Sleep(ctx)           // GPU memory released; weights in pinned host memory
//	_ = set.Wake(ctx)            // same addresses, weights restored, kv zeroed
//
// # Speed
//
// Backups are transparent-huge-page memory registered with cuMemHostRegister after its pages were
// faulted in from several threads: of the kinds of pinned memory measured on the project's H200
// host it is the fastest to make (16 GiB in 0.58 s, against 3.8 s for a host-NUMA allocation and
// 5.5 s for cuMemHostAlloc) and copies as fast as any (55 GB/s). The backup is made of slots of
// Options.SlotSize bytes kept in a pool across sleeps, so a warm sleep only copies. The first sleep
// pins while it copies, in three stages that overlap: the pages of slot i+2 are faulted in while
// slot i+1 is registered and slot i is filled, so it takes about the longest of the three, not
// their sum. In a process that holds several GPUs the registration is the longest (the driver
// maps the memory for each of them). Every device of a set works at once, on its own copy stream,
// with two slots in flight so the copy engine never waits for the host.
//
// # Never half
//
// A Sleep that fails or is cancelled leaves every buffer awake with its content intact (a Discard
// buffer rolled back after its memory was released comes back zeroed: its content was to be
// dropped). A Wake that fails, for example because another process took the memory (an error
// wrapping driver.ErrOutOfMemory), leaves the buffers asleep with their backups intact and can be
// retried. Sleep of a sleeping buffer and Wake of an awake one are no-ops. A buffer whose memory was
// exported to other processes (ipc.Export) cannot be slept, since releasing it here would not free
// the memory: Sleep fails with an error wrapping vmm.ErrExported unless EntryOptions.Force is set.
// Closing a buffer while it sleeps frees its backup; its reservation is freed by its own Close. Close
// of a set refuses while one of its buffers sleeps.
//
// # Checkpoints
//
// Save writes the content of a set with a header (layout, sizes, tags, properties, access) and a
// CRC-32C per chunk; Restore reads such a checkpoint back into the same buffers, verifying every
// checksum before a byte reaches the GPU; Load recreates the buffers of a checkpoint in a new
// process, at the same addresses when the driver grants them.
//
// # Watching
//
// Stats reports each buffer (bytes, asleep or not), the GPU memory given back, the pinned memory
// held, and the sleeps and wakes done and failed with their bytes and time. It never waits for a
// Sleep or Wake in progress; package metrics exports it to Prometheus (metrics.NewSet).
package offload
