package vmm

import "github.com/cuvmm/cuvmm/driver"

// Chunk is one physical allocation of a buffer made of several, at its offset from the buffer's
// first address.
type Chunk struct {
	Offset     uint64
	Allocation *Allocation
}

// Chunked is a buffer made of allocations mapped back to back at one address: growbuf.Buffer and
// stripe.Range implement it, and package ipc exports any Chunked value whole (every chunk, at its
// offset, so the receiver sees the same layout).
type Chunked interface {
	// Ptr is the buffer's first address.
	Ptr() driver.DevicePtr
	// Len is the number of bytes in use. The chunks cover at least Len bytes and may extend past it
	// (a growable buffer's capacity); exporters share every chunk.
	Len() uint64
	// Chunks lists the allocations in offset order. The allocations belong to the buffer: callers
	// may export them but must not close them, and must not use them after the buffer changes
	// (grows, shrinks or closes).
	Chunks() []Chunk
}
