// Package broker is a pinned copy broker: one process owns a pinned host region, makes it visible
// to the GPUs once, and performs the DMA between it and the device memory of any number of worker
// processes, which share their buffers with it by file descriptor.
//
// # Why
//
// Every GPU that can reach host memory keeps page tables for it in its own memory: 2 MiB per GiB,
// per process, per GPU (docs/driver-facts.md, section 3, measured on the H200 host). Eight workers that
// each map a 64 GiB pool on a GPU pay 8 × 128 MiB there, and each pays the time to pin or import it.
// With a broker the region is mapped once per GPU, whatever the number of workers; the workers
// touch it from the CPU only (Client.Region), which costs no GPU memory. Measured on the H200 host,
// a broker imports a worker's 4 GiB allocation in 0.48 ms and copies into it at 55.5 GB/s host to
// device, 55.3 device to host, 47.9 GB/s in 1 MiB pieces.
//
// # Use
//
// The broker:
//
//	region, _ := pinned.New(dev, 8<<30, pinned.Options{})          // granted to dev
//	srv, _ := broker.Listen(region, "/run/user/1000/cuvmm-broker.sock", broker.Options{})
//	go srv.Serve()
//	defer srv.Close()                                               // before region.Close
//
// A worker:
//
//	c, _ := broker.Dial(path)
//	view, _ := c.Region(ctx, dev, pinned.OpenOptions{})             // CPU-only: no GPU cost
//	buf, _ := c.Register(ctx, deviceBuffer)                         // any vmm.Chunked, POSIX-FD handles
//	copy(view.Bytes()[off:], data)
//	err := c.Copy(ctx, broker.Request{Buffer: buf.ID(), Dir: broker.ToDevice, HostOffset: off, Length: n})
//	done, _ := c.CopyAsync(broker.Request{...})                     // pipelined
//	err = done.Wait(ctx)
//
// # Protocol
//
// One small request frame and one small response frame per operation, on the ipc transport (frame
// kinds KindRequest and KindResponse; the wire format is documented in wire.go and
// docs/broker.md), versioned by their kinds (Version) and decoded strictly: a malformed message is answered with
// StatusProtocol and the connection closed. Buffers travel as ipc.Send does (descriptor plus one file
// descriptor per chunk), the region as pinned.Region.Share does.
//
// # Safety
//
//   - The socket is created 0600 in a private directory, and every peer's uid is checked
//     (SO_PEERCRED) against Options.AllowUIDs, then Options.Authorize; the worker checks the broker's
//     uid likewise. Connections are capped in total and per uid; silent and half-sent peers are
//     dropped (Options.IdleTimeout, ReadTimeout), and the Client pings ahead of the idle timeout.
//   - Every memfd shared with a worker is sealed against resizing, and a worker that registers one
//     that is not loses its connection: no worker can make the broker fault.
//   - Every copy is bounds-checked: the host range must lie in the worker's grant (the whole region,
//     or the window Options.Grant gives it), the buffer range in the buffer's chunks, and the buffer
//     must be one this worker registered. Buffer ids are per connection.
//   - A worker that disconnects or dies has its copies queued on a stream drained (those still
//     waiting for a stream are not started), then its buffers unmapped and released, before the
//     broker closes its end of the connection; the broker keeps serving the others. Client.Close
//     waits for that end, so no copy of the worker runs once it returns nil (it returns an error
//     wrapping ErrTimeout or ErrBrokerGone when it cannot tell). A broker that exits fails every
//     pending and later request with ErrBrokerGone; dial again (DialOptions.Retry waits for a
//     restarted broker) and register the buffers again.
//
// # Concurrency
//
// Each served device has Options.StreamsPerDevice non-blocking streams shared by all workers. A copy
// takes a free stream, is queued on it (cuMemcpyHtoDAsync / cuMemcpyDtoHAsync) and answered when it
// is done, from a goroutine of its own (or, for small copies, the connection's goroutine), so copies
// of many workers, and many copies of one worker, run at once. A copy of at most Options.SpinMax
// bytes is waited for by spinning (cuStreamSynchronize), a larger one by sleeping on a blocking
// event, so that large copies do not keep a core busy each. They are not
// ordered with the worker's own GPU work: a worker synchronizes what touches a range before asking
// for a copy of it, and touches the range again once the copy's Completion is done.
package broker
