// Package nccl moves cuvmm buffers between GPUs, processes and hosts through NCCL, the collective
// communication library that distributed inference and training use (over NVLink inside a host, and
// over sockets, InfiniBand or RoCE between hosts).
//
// # Loading
//
// No NCCL headers or libraries are needed to build. Open loads libnccl.so.2 at run time with dlopen:
// first through the loader's search, then from the path in $CUVMM_NCCL_LIBRARY (for example the copy
// inside a Python environment's nvidia-nccl package, which is not on the loader's path). Each entry
// point is resolved on its own: one the library lacks fails only its call, with a *VersionError
// (errors.Is(err, ErrNotSupported)) naming the NCCL version that has it. ncclGetVersion is checked:
// below MinVersion (2.14, non-blocking communicators) Open refuses the library. Nothing loadable is
// ErrNoNCCL, with every place tried in the message. ncclResult_t is Result, an error whose text is
// ncclGetErrorString's; failed calls come back as *CallError with ncclGetLastError's message.
// ncclConfig_t is declared as nccl.h 2.28 declares it (a versioned struct with size, magic and
// version) and checked against nccl.h where one is installed.
//
// # Communicators
//
// One rank makes a UniqueID (API.GetUniqueID) and hands it to the others over any connection:
// ShareID and ReceiveID on an io.ReadWriter, ServeID and DialID on a TCP listener (how ranks on
// different hosts meet) or a Unix socket. Every rank then calls NewComm with the same ID. NewComm
// initializes without blocking (ncclCommInitRankConfig with blocking=0) and polls
// ncclCommGetAsyncError: when its context ends first, the communicator is aborted (ncclCommAbort)
// and the error wraps ErrAborted and the context's error. The same holds for every operation:
// NCCL hangs when ranks disagree or a peer dies, and here a deadline turns the hang into an error.
//
// # Operations
//
// Operations run on a vmm.Stream (nil: the legacy default stream) and are queued, not done, when
// they return: Comm.Wait waits for the stream while watching the context. Send, Recv, AllReduce,
// AllGather, ReduceScatter and Broadcast take a device pointer and a count; a Group issues several
// at once between ncclGroupStart and ncclGroupEnd, and also takes whole buffers (any vmm.Chunked,
// such as a growbuf.Buffer): SendBuffer, RecvBuffer, AllReduceBuffer, ... Arguments are checked
// before NCCL sees them: counts whose byte size overflows, peers out of range, null buffers (but a
// broadcast's send buffer on a rank other than the root, which NCCL does not read), closed streams,
// and streams and buffers of another device (ErrWrongDevice) are refused with errors wrapping
// ErrInvalidValue.
//
// # Registration
//
// Comm.Register registers every chunk of a buffer, one ncclCommRegister (or, with
// RegisterOptions.Window, ncclCommWindowRegister) per chunk: NCCL looks up one allocation per
// registered range, so registering a multi-chunk buffer in one call would register its first chunk
// only. SendChunks and RecvChunks move a registered buffer one operation per chunk, so that each lies
// inside a registration. A registration holds the buffer's allocations (from before Register waits
// for the communicator): closing or shrinking the buffer fails with vmm.ErrInUse until the
// registration is closed, and registering an overlapping
// buffer again fails with ErrAlreadyRegistered. Comm.Close deregisters what is left.
//
// Between two GPUs of one host (NVLink, NCCL 2.28 on two H200s), registration gained nothing
// measured, and moving a 4 GiB buffer of 23 chunks one operation per chunk, registered or not, ran
// 1.5 % slower than one SendBuffer of it: register where the transport gains from it (a network
// with GPUDirect RDMA), and otherwise move the whole buffer in one operation.
//
// # Closing and aborting
//
// Close does not wait for a call that another goroutine is making on the communicator: it returns
// at once with an error wrapping ErrInUse, and can be called again once that call has returned.
// Abort, allowed from any goroutine, interrupts a call that hangs. An open communicator counts as an
// object on its device: vmm.System.Close fails with vmm.ErrInUse, naming it, until it is closed. An
// ncclCommAbort that could not run (binding the device failed) is run again by Close, or, after a
// failed NewComm, by the System (System.RetryOrphans, System.Close).
//
// What NCCL 2.28.3 does here, seen on two H200s joined by NVLink:
//   - Close is a collective when ranks live in several processes: ncclCommDestroy waits until the
//     ranks of the other processes have closed theirs (or exited). Close every rank at about the
//     same time; a process that waits for its peer to exit before closing deadlocks with a peer
//     doing the same. Close gives up after Options.CloseTimeout with an error wrapping ErrInUse,
//     and the destroy ends in the background once the peers close.
//   - Close deregisters what is still registered before it finalizes: left to ncclCommDestroy,
//     the registration of a buffer that a rank of the same process imported stayed mapped for the
//     life of the process.
//   - A window's registration returns ncclSuccess while its group still runs; Register waits for it
//     before the next chunk.
//   - An error NCCL reports (a receive from the rank itself, say) aborts the communicator at once,
//     and the error wraps ErrAborted with NCCL's; counts that differ between a send and its receive
//     are not detected (the receive ends with the bytes sent).
//   - Aborting a communicator with an operation in flight leaves its connection buffers allocated
//     for the life of the process (320 MiB on a receiver's device, 64 MiB on a sender's, with the
//     default 32 channels; none with NCCL_CUMEM_ENABLE=0 or NCCL_P2P_DISABLE=1). Aborting one that
//     still waits in its bootstrap leaves two listening sockets open per rank.
//   - NCCL's RAS thread keeps reconnecting to a peer process that died for about a minute, holding
//     a socket meanwhile (NCCL_RAS_ENABLE=0 turns RAS off).
//
// # Environment
//
// This package never turns on NVLink SHARP or multicast and sets no NCCL variable: NCCL reads its
// environment (NCCL_NVLS_ENABLE, NCCL_P2P_DISABLE, NCCL_SOCKET_IFNAME, ...) as the process has it,
// and processes started by the tests and demos inherit it.
//
// # Testing without GPUs
//
// Package ncclsim is a simulated NCCL with the same API: ranks in separate processes exchange bytes
// over Unix sockets and reductions are computed on simulated memory, so code using this package is
// tested on any machine with the simulated driver (driver/sim).
package nccl
