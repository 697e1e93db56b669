// Package measure holds cuvmm's measurements: each is one function that takes an options struct,
// runs on a Backend (the real driver or the simulator), verifies what it did, measures against the
// obvious baseline in the same run, and returns a typed result. A result's JSON encoding is what
// `vmmdemo <subcommand> --json` prints, and its Text method what the command prints otherwise; the
// command only parses flags, calls the function and renders the result.
//
//	Info       driver version, devices, VMM features, granularity, peer matrix
//	Grow       growbuf growing in place against realloc-and-copy
//	Stripe     a range striped over several GPUs: build against the raw driver sequence, reads
//	Share      a buffer shared with a second process: export, send, import and map, round trip
//	Bandwidth  host↔device copies by host memory kind against cuMemHostAlloc, async staging
//	Pinned     GPU page-table cost of a pinned region shared by N processes, by sharing mode
//	Broker     the pinned copy broker against raw pinned copies, round trip, GPU memory
//	Sleep      buffers put to sleep and woken at the same addresses (package offload) against raw
//	           copies (or raw file I/O) and the usual cuMemHostAlloc-then-copy backup
//	Pool       an allocation trace replayed on the cuvmm pool, cuMemAlloc, cuMemAllocAsync (and
//	           PyTorch's caching allocator): memory, failures, latency
//	Xfer       a growable buffer moved to a second process and GPU through NCCL, beside ipc and peer
//	           copies (and PyTorch's send/recv)
//
// Options are checked before anything is allocated; a bad one is an error wrapping
// ErrInvalidOption that names it. Long measurements report progress through the optional
// Progress in their options.
//
// The measurements with a second process (Share, Pinned, Broker, Xfer) re-execute the running binary
// as their workers: a program that calls them must call RunWorker at the top of main (a test binary,
// at the top of TestMain). The workers inherit the environment and talk to the parent over a socket
// pair.
//
// Times from the simulator measure the Go simulation, not a GPU: each result says so, and only the
// ratios' shape, not their values, carries over.
package measure
