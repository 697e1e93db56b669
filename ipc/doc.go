// Package ipc shares device and host-NUMA memory between processes with no copy, by passing the
// allocations' shareable handles as file descriptors.
//
// The legacy cuIpcGetMemHandle does not work on VMM memory (the driver answers INVALID_VALUE), so a
// buffer is shared as a Descriptor (its size and, for every chunk, the chunk's offset, size, location
// and handle type) plus one POSIX file descriptor per chunk, exported with
// cuMemExportToShareableHandle. The receiver imports every chunk (cuMemImportFromShareableHandle),
// reserves one range, maps each chunk at its offset and grants the access it chooses, so it sees the
// same layout as the exporter. Any vmm.Chunked value (growbuf.Buffer, stripe.Range, FromReservation
// over a vmm.Reservation) is exported whole: every chunk, not only the first. A Buffer received here is
// a vmm.Chunked too, but the driver reports no handle types for imported memory (measured on the H200,
// even in the exporting process), so it cannot be exported again (see Buffer).
//
// # Layers
//
//   - WriteMessage / ReadMessage: a small versioned binary frame (magic, version, kind, payload length,
//     descriptor count) and its file descriptors over a Unix stream socket (SCM_RIGHTS). Other
//     packages use it for their own message kinds (KindUser and above).
//   - Export / Send / Receive / Open: a buffer's descriptor and files; Open makes a Buffer, the
//     receiver's mapping of the whole buffer.
//   - Listen / Server.Publish / Dial / Client.Fetch: named buffers served on a socket path, with the
//     peer's uid checked (SO_PEERCRED), connections capped, and silent peers dropped (see
//     ServerOptions and docs/ipc.md, Security).
//   - GetFD / ReceiveFromPID: the pidfd path (pidfd_open + pidfd_getfd) for peers that publish
//     (pid, fd) pairs instead of connecting a socket.
//   - HandleTypes / Allocate: FABRIC together with POSIX_FD where the driver grants it, POSIX_FD alone
//     otherwise.
//
// # Lifetime
//
// The physical memory lives until the last process unmaps it. When the exporter closes its buffer
// (or exits), importers keep valid mappings, with the same content, until they close theirs; new
// importers can no longer fetch it once the exporter has closed the files it exported (Server keeps
// them open while a buffer is published). The files a receiver gets are needed only until Open
// returns: close the Received then.
//
// # Errors
//
// Every received descriptor is close-on-exec, and every one is closed when a read or a decode fails.
// A received memfd must be sealed against resizing (Open checks). Protocol faults wrap ErrProtocol
// (ErrMessageTooLarge for size limits); a server's refusals arrive as a *ServerError that matches
// ErrNotFound, ErrPermission, ErrProtocol, ErrConnLimit, ErrIdle or ErrTimeout with errors.Is; driver
// failures keep their driver sentinels (driver.ErrInvalidValue, driver.ErrInvalidHandle, ...).
package ipc
