// Package growbuf provides device buffers (or pinned host-NUMA buffers) that grow and shrink in place:
// the address stays the same, nothing is copied, and memory is never held twice.
//
// A Buffer reserves a large range of virtual addresses once (cuMemAddressReserve) and maps physical
// chunks into it on demand (cuMemCreate, cuMemMap, cuMemSetAccess). Growing adds chunks after the last
// one; shrinking unmaps and releases whole chunks from the end. Kernels may keep using Ptr() while the
// buffer grows, because the bytes already mapped never move.
//
//	buf, err := growbuf.New(dev, growbuf.Options{})
//	defer buf.Close()
//	err = buf.Grow(100 << 20)       // Len 100 MiB, Cap the bytes mapped (at least that)
//	launch(kernel, buf.Ptr(), buf.Len())
//	err = buf.Grow(300 << 20)       // same Ptr, the first 100 MiB untouched
//	err = buf.Shrink(10 << 20)      // waits for queued work, then releases whole chunks past 10 MiB
//
// # Sizes
//
// Len is the number of bytes the caller asked for (the last Grow, Resize or Shrink). Cap is the number
// of bytes mapped, a multiple of the granularity, at least Len: the chunks Chunks lists cover exactly
// [0, Cap). Reserved is the size of the virtual range, at least Cap. Only [0, Len) is the caller's data;
// [Len, Cap) is mapped and accessible, so writing there is harmless, but a later Shrink may release it.
//
// Buffer implements vmm.Chunked: ipc.Export shares every chunk, so a receiver sees the whole
// capacity, of which the first Len bytes are the caller's data.
//
// # Chunk policy
//
// Each new chunk's size comes from Options.Chunk. The default is geometric: the first chunk is one
// granularity (2 MiB), each later one as large as the buffer's capacity so far (so the capacity
// doubles), up to DefaultMaxChunk (256 MiB), then every chunk is 256 MiB. Why: cuMemSetAccess, the
// dominant cost of mapping, costs per chunk (measured on the H200: 21.6 µs for 2 MiB, 72.7 µs for
// 32 MiB, 957 µs for 512 MiB, so about 18 µs per chunk plus 1.8 µs per MiB), and cuMemCreate about
// 7 µs per chunk. Small chunks therefore cost up to eight times more per byte than large ones, while
// large chunks waste memory (up to one chunk mapped past Len) and make Shrink coarse. Doubling keeps a
// small buffer small (a 3 MiB buffer maps 4 MiB) and reaches large chunks after a few steps; at 256 MiB
// the fixed per-chunk cost is about 5% of the chunk's cost, so larger chunks would gain little and
// waste more. FixedChunks gives every chunk one size, which makes Cap predictable: a buffer grown in
// steps of its chunk size has Cap == Len, as long as no chunk is cut short at a reservation's end
// (MaxSize and Limit multiples of the chunk size).
//
// A Grow that needs several chunks adds several, each of the policy's size; a chunk is cut short where
// a reservation or Options.Limit ends (a mapping cannot span two reservations).
//
// # When the reservation is full
//
// Options.MaxSize is the size of the first reservation (default: the device's memory, or Limit when
// smaller, rounded up to the granularity, so that a device buffer practically never outgrows it). When a Grow needs more:
//
//  1. The buffer reserves the range right after its last reservation (cuMemAddressReserve with the
//     end as the address hint, kept only when the driver grants exactly that address), asking first
//     for as much again as is reserved, then for just what is needed. The buffer then consists of
//     several adjacent reservations; Ptr does not change and the bytes are contiguous. The driver may
//     refuse a free range for reasons of its own: on the H200 host an extension as large as a
//     reservation of 64 MiB or more was granted, a 2 MiB one after it was not, and reservations under
//     32 MiB sit in 32 MiB blocks of the driver's address heap that an extension cannot cross. Hence
//     the large first request, and a large default MaxSize.
//  2. If that range is taken and Options.AllowMove is false, Grow fails with an error wrapping
//     ErrReservationFull and the buffer is unchanged.
//  3. If Options.AllowMove is true, the buffer reserves a new, larger range elsewhere, maps the same
//     physical chunks there (no copy; the bytes are simply visible at the new address), maps the new
//     chunks, grants access, synchronizes (see below), unmaps and frees the old range, and calls
//     Options.OnMove(old, new). Ptr returns the new address from then on; addresses taken from the old
//     Ptr are invalid.
//
// Options.Limit, when set, is a hard cap on Cap: a Grow past it fails with ErrTooLarge before anything
// is done. So does a Grow past what the buffer's location could ever back, whatever the Limit: the
// device's total memory (vmm.Device.TotalMemory) for device memory, the host's physical memory for
// host-NUMA memory (128 TiB when that cannot be read). Such a Grow fails at once, before any driver
// call and without counting or listing chunks.
//
// # Shrink and queued GPU work
//
// Unmapping memory that a queued kernel or copy still uses makes that work fault. So Shrink, a move
// and Close first wait for queued work: they synchronize Options.Stream when it is set (the caller
// promises that all work using the buffer is on that stream), and otherwise the primary context of the
// owning device and of every peer device (cuCtxSynchronize). Grow never synchronizes: it only adds
// memory.
//
// # Atomicity and concurrency
//
// A Grow either reaches the new size or leaves the buffer exactly as it was: when any step fails
// (creating a chunk, mapping it, granting access, extending or moving the reservation), every chunk and
// reservation made by that call is released again, and the error names the failed call and the sizes.
//
// A Buffer is safe for concurrent use. Grow, Resize, Shrink, Chunks and Close serialize on a mutex;
// Ptr, Len, Cap and Reserved are lock-free reads, so readers never wait for a growth in progress.
// Each is one atomic load. Growing publishes Cap before Len and shrinking (Shrink, Close) lowers Len
// before Cap, so Len <= Cap <= Reserved holds at every instant; two separate loads may still
// straddle a change: a reader that loads Len and then Cap sees Len <= Cap unless a Shrink or Close
// runs in between, and one that loads Cap and then Len unless a Grow runs in between.
package growbuf

import (
	"errors"
	"fmt"
	"slices"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// Sentinel errors.
var (
	// ErrReservationFull: a Grow needed more address space than the buffer's reservations, the range
	// right after them was not free, and Options.AllowMove was false (or the move failed too).
	ErrReservationFull = errors.New("growbuf: reservation full")
	// ErrTooLarge: a Grow past Options.Limit, past what the buffer's location could ever back (the
	// device's total memory, or the host's for host-NUMA memory), or to a size that overflows when
	// rounded up.
	ErrTooLarge = errors.New("growbuf: size too large")
)

// DefaultMaxChunk is the largest chunk of the default (geometric) policy.
const DefaultMaxChunk uint64 = 256 << 20

// ChunkPolicy decides how large each new chunk is. All sizes must be multiples of the granularity
// (Buffer.Granularity; 2 MiB on current GPUs). The zero value is the default geometric policy.
type ChunkPolicy struct {
	// Fixed makes every chunk Size bytes.
	Fixed bool
	// Size is the chunk size of a fixed policy (required), or the smallest chunk of a geometric one
	// (0: the granularity).
	Size uint64
	// Max is the largest chunk of a geometric policy (0: DefaultMaxChunk, or Size when that is
	// larger). It must be 0 for a fixed policy.
	Max uint64
}

// FixedChunks is the policy of chunks of size bytes each.
func FixedChunks(size uint64) ChunkPolicy { return ChunkPolicy{Fixed: true, Size: size} }

// GeometricChunks is the policy whose chunks are as large as the capacity so far (doubling it), at
// least minSize and at most maxSize bytes (0 for either: the defaults).
func GeometricChunks(minSize, maxSize uint64) ChunkPolicy {
	return ChunkPolicy{Size: minSize, Max: maxSize}
}

func (p ChunkPolicy) String() string {
	if p.Fixed {
		return "fixed " + units.FormatSize(p.Size)
	}
	return fmt.Sprintf("geometric %s to %s", units.FormatSize(p.Size), units.FormatSize(p.Max))
}

// Peer is another device granted access to the buffer.
type Peer struct {
	Device *vmm.Device
	// ReadOnly grants read access only (PROT_READ; the peer's writes fail). Otherwise read-write.
	ReadOnly bool
}

// Options configure New. The zero value is a device buffer on the given device with the default
// chunk policy, reserving the device's memory size of addresses.
type Options struct {
	// MaxSize is the size of the first reservation, rounded up to the granularity (Reserved reports
	// it). 0: the device's total memory, or Limit when that is smaller, rounded up. Growing past it extends the reservation in place
	// or moves the buffer (see the package doc); Limit is the hard cap.
	MaxSize uint64
	// Limit caps Cap: a Grow to more fails with ErrTooLarge. It is rounded up to the granularity.
	// 0: no limit but the memory of the location (see the package doc).
	Limit uint64
	// Chunk is the chunk policy; the zero value is the default geometric one.
	Chunk ChunkPolicy
	// Location is where the memory lives: the zero value or the device's own location for device
	// memory, or driver.HostNUMALocation(node) for a growable pinned host buffer (needs host-NUMA VMM
	// support, CUDA 12.2+), which the CPU may also read and write through the same address.
	Location driver.Location
	// Peers are other devices granted access to every chunk.
	Peers []Peer
	// HandleTypes are requested for every chunk (for example driver.HandleTypePosixFD), so that the
	// chunks can be exported (package ipc exports a vmm.Chunked).
	HandleTypes driver.HandleType
	// AllowMove lets a Grow that finds its reservation full and the range after it taken move the
	// chunks to a larger reservation elsewhere. Ptr then changes.
	AllowMove bool
	// OnMove, if set, is called after a move with the old and the new address, before Grow returns
	// and with the buffer's lock held: it may call Ptr, Len, Cap and Reserved but no other method.
	OnMove func(old, new driver.DevicePtr)
	// Stream, if set, is the stream that all work using the buffer runs on: Shrink, a move and Close
	// synchronize only it. Otherwise they synchronize the owning device and every peer. It must be
	// an open stream of the owning device or of one of Peers (New refuses others with
	// vmm.ErrInvalidValue): work on any other device cannot use the buffer, so waiting for it would
	// not wait for the buffer's work.
	Stream *vmm.Stream
}

// chunk is one mapping of the buffer, at buffer offset off.
type chunk struct {
	m         *vmm.Mapping
	off, size uint64
}

// segment is one reservation of the buffer, starting at buffer offset off.
type segment struct {
	res *vmm.Reservation
	off uint64
}

func (s segment) end() uint64 { return s.off + s.res.Size() }

// Buffer is a growable buffer. It implements vmm.Chunked. Make one with New; Close releases it.
type Buffer struct {
	dev       *vmm.Device
	sys       *vmm.System
	loc       driver.Location
	gran      uint64
	policy    ChunkPolicy
	limit     uint64
	most      uint64 // the most bytes the location could ever back: a larger Cap fails at once
	allocOpts vmm.AllocOptions
	access    []vmm.Access
	syncDevs  []*vmm.Device
	stream    *vmm.Stream
	allowMove bool
	onMove    func(old, new driver.DevicePtr)

	// Lock-free views, written with mu held.
	ptr      atomic.Uint64
	length   atomic.Uint64
	capacity atomic.Uint64
	reserved atomic.Uint64

	own     lifetime.Owner // its lock serializes the methods; closed once Close freed everything
	segs    []segment      // adjacent, in address order; segs[0].off == 0
	chunks  []chunk        // in offset order, covering [0, capacity)
	closing bool           // Close was called: the buffer refuses use
	// What a failed clean-up left behind, retried and reported by Close.
	leftMaps []*vmm.Mapping
	leftRes  []*vmm.Reservation
	deferred error
}

var _ vmm.Chunked = (*Buffer)(nil)

// New makes an empty buffer on dev: it reserves Options.MaxSize of addresses and maps nothing yet.
// Errors wrap vmm.ErrInvalidValue for bad options, driver.ErrNotSupported for a location or peer the
// device cannot use, or the driver's error from reserving the range.
func New(dev *vmm.Device, opts Options) (*Buffer, error) {
	if dev == nil {
		return nil, fmt.Errorf("growbuf: new: nil device: %w", vmm.ErrInvalidValue)
	}
	sys := dev.System()
	loc, err := location(dev, opts.Location)
	if err != nil {
		return nil, err
	}
	if err := vmm.CheckHandleTypes(opts.HandleTypes); err != nil {
		return nil, fmt.Errorf("growbuf: new on %s: %w", dev, err)
	}
	// A chunk must be a multiple of its location's granularity and every offset a multiple of the
	// reservation granularity.
	gran, err := sys.CommonGranularity(loc, dev)
	if err != nil {
		return nil, fmt.Errorf("growbuf: new: %w", err)
	}
	policy, err := normalizePolicy(opts.Chunk, gran)
	if err != nil {
		return nil, fmt.Errorf("growbuf: new on %s: %w", dev, err)
	}
	limit := ^uint64(0) / gran * gran
	if opts.Limit != 0 {
		if limit, err = vmm.RoundUp(fmt.Sprintf("growbuf: new on %s: limit", dev), opts.Limit, gran); err != nil {
			return nil, err
		}
	}
	maxSize := opts.MaxSize
	if maxSize == 0 {
		maxSize = min(dev.TotalMemory(), limit)
	}
	if maxSize, err = vmm.RoundUp(fmt.Sprintf("growbuf: new on %s: max size", dev), maxSize, gran); err != nil {
		return nil, err
	}
	access, syncDevs, err := peerAccess(dev, loc, opts.Peers)
	if err != nil {
		return nil, err
	}
	if err := checkStream(dev, opts.Stream, syncDevs); err != nil {
		return nil, err
	}
	r, err := sys.Reserve(maxSize, vmm.ReserveOptions{})
	if err != nil {
		return nil, fmt.Errorf("growbuf: new on %s: reserve %s: %w", dev, units.FormatSize(maxSize), err)
	}
	r.SetKind("growbuf")
	b := &Buffer{
		dev: dev, sys: sys, loc: loc, gran: gran, policy: policy, limit: limit, most: backable(dev, loc),
		allocOpts: vmm.AllocOptions{Location: loc, HandleTypes: opts.HandleTypes},
		access:    access, syncDevs: syncDevs, stream: opts.Stream,
		allowMove: opts.AllowMove, onMove: opts.OnMove,
		segs: []segment{{res: r, off: 0}},
	}
	b.ptr.Store(uint64(r.Ptr()))
	b.reserved.Store(r.Size())
	b.own.Init(nil, "growable buffer")
	lifetime.Track(b, &b.own)
	return b, nil
}

// location resolves Options.Location for dev.
func location(dev *vmm.Device, loc driver.Location) (driver.Location, error) {
	switch loc.Type {
	case driver.LocationInvalid:
		return dev.Location(), nil
	case driver.LocationDevice:
		if loc != dev.Location() {
			return loc, fmt.Errorf("growbuf: new on %s: location %s is another device's memory (make the buffer with that device): %w", dev, loc, vmm.ErrInvalidValue)
		}
		return loc, nil
	case driver.LocationHostNUMA:
		if loc.ID < 0 {
			return loc, fmt.Errorf("growbuf: new on %s: host NUMA node %d: %w", dev, loc.ID, vmm.ErrInvalidValue)
		}
		// A device that reports no support fails here; when the answer cannot be had (drivers
		// before 12.9 do not know the attribute), cuMemCreate decides at the first Grow.
		if err := dev.Check(vmm.FeatureHostNUMA); errors.Is(err, driver.ErrNotSupported) {
			return loc, fmt.Errorf("growbuf: new on %s: %s: %w", dev, loc, err)
		}
		return loc, nil
	}
	return loc, fmt.Errorf("growbuf: new on %s: location %s: want the device or a host NUMA node: %w", dev, loc, vmm.ErrInvalidValue)
}

// maxHostBytes bounds a host-NUMA buffer when the host's memory cannot be read: 128 TiB, the user
// address space of x86-64 and arm64 with 48-bit virtual addresses.
const maxHostBytes uint64 = 1 << 47

// backable is the most memory loc could ever back: dev's total memory, or the host's physical
// memory for a host-NUMA location.
func backable(dev *vmm.Device, loc driver.Location) uint64 {
	if loc.Type != driver.LocationHostNUMA {
		return dev.TotalMemory()
	}
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil || si.Totalram == 0 {
		return maxHostBytes
	}
	return min(uint64(si.Totalram)*uint64(max(si.Unit, 1)), maxHostBytes)
}

// peerAccess is the access list of every chunk (the owning device, the CPU for host-NUMA memory,
// the peers) and the devices a wait synchronizes, after checking the peers.
func peerAccess(dev *vmm.Device, loc driver.Location, peers []Peer) ([]vmm.Access, []*vmm.Device, error) {
	access := []vmm.Access{vmm.ReadWrite(dev)}
	if loc.Type == driver.LocationHostNUMA {
		access = append(access, vmm.HostReadWrite())
	}
	syncDevs := []*vmm.Device{dev}
	for i, p := range peers {
		if p.Device == nil {
			return nil, nil, fmt.Errorf("growbuf: new on %s: peer %d is a nil device: %w", dev, i, vmm.ErrInvalidValue)
		}
		if p.Device.System() != dev.System() {
			return nil, nil, fmt.Errorf("growbuf: new on %s: peer %s belongs to another System: %w", dev, p.Device, vmm.ErrInvalidValue)
		}
		if slices.Contains(syncDevs, p.Device) {
			return nil, nil, fmt.Errorf("growbuf: new on %s: peer %s listed twice or is the owning device (which always has read-write access): %w", dev, p.Device, vmm.ErrInvalidValue)
		}
		if loc.Type == driver.LocationDevice {
			ok, err := p.Device.CanAccessPeer(dev)
			if err != nil {
				return nil, nil, fmt.Errorf("growbuf: new on %s: %w", dev, err)
			}
			if !ok {
				return nil, nil, fmt.Errorf("growbuf: new on %s: peer %s cannot access the memory of %s: %w", dev, p.Device, dev, driver.ErrNotSupported)
			}
		}
		if p.ReadOnly {
			access = append(access, vmm.ReadOnly(p.Device))
		} else {
			access = append(access, vmm.ReadWrite(p.Device))
		}
		syncDevs = append(syncDevs, p.Device)
	}
	return access, syncDevs, nil
}

// checkStream refuses an Options.Stream that Shrink, a move and Close could not wait on for the
// buffer's work: a closed one, or one of a device that cannot use the buffer (neither dev nor one of
// its peers, users; or of another System). Such a wait would pass while the buffer's work is queued.
func checkStream(dev *vmm.Device, s *vmm.Stream, users []*vmm.Device) error {
	switch {
	case s == nil:
		return nil
	case s.Closed():
		return fmt.Errorf("growbuf: new on %s: Options.Stream is a closed stream: %w (%w)", dev, vmm.ErrClosed, vmm.ErrInvalidValue)
	case s.Device().System() != dev.System():
		return fmt.Errorf("growbuf: new on %s: Options.Stream belongs to another System: %w", dev, vmm.ErrInvalidValue)
	case !slices.Contains(users, s.Device()):
		return fmt.Errorf("growbuf: new on %s: Options.Stream is a stream of device %d, which is neither the buffer's device nor one of its peers: %w",
			dev, s.Device().Ordinal(), vmm.ErrInvalidValue)
	}
	return nil
}

func normalizePolicy(p ChunkPolicy, gran uint64) (ChunkPolicy, error) {
	if p.Fixed {
		if p.Size == 0 {
			return p, fmt.Errorf("fixed chunk policy with size 0: %w", vmm.ErrInvalidValue)
		}
		if p.Max != 0 {
			return p, fmt.Errorf("fixed chunk policy of %s with a Max of %s (Max is for geometric policies): %w", units.FormatSize(p.Size), units.FormatSize(p.Max), vmm.ErrInvalidValue)
		}
	} else {
		if p.Size == 0 {
			p.Size = gran
		}
		if p.Max == 0 {
			p.Max = max(DefaultMaxChunk, p.Size)
		}
		if p.Max < p.Size {
			return p, fmt.Errorf("geometric chunk policy: largest chunk %s is smaller than the smallest %s: %w", units.FormatSize(p.Max), units.FormatSize(p.Size), vmm.ErrInvalidValue)
		}
	}
	for _, s := range []uint64{p.Size, p.Max} {
		if s%gran != 0 {
			return p, fmt.Errorf("chunk size %d (%s) is not a multiple of the granularity %s: %w", s, units.FormatSize(s), units.FormatSize(gran), vmm.ErrInvalidValue)
		}
	}
	return p, nil
}

// Ptr is the buffer's first address. It never changes, except when a Grow moves the buffer (only
// with Options.AllowMove; see OnMove). It is valid from New on, even while Len is 0, and 0 after
// Close.
func (b *Buffer) Ptr() driver.DevicePtr {
	if b == nil {
		return 0
	}
	return driver.DevicePtr(b.ptr.Load())
}

// Len is the size the caller asked for: the n of the last successful Grow (when larger), Resize or
// Shrink. The bytes [0, Len) are the caller's.
func (b *Buffer) Len() uint64 {
	if b == nil {
		return 0
	}
	return b.length.Load()
}

// Cap is the number of bytes mapped: the sum of the chunks, a multiple of the granularity, at least
// Len. Growing up to Cap makes no driver call.
func (b *Buffer) Cap() uint64 {
	if b == nil {
		return 0
	}
	return b.capacity.Load()
}

// Reserved is the size of the buffer's virtual address range (all its reservations), at least Cap.
func (b *Buffer) Reserved() uint64 {
	if b == nil {
		return 0
	}
	return b.reserved.Load()
}

// Device is the device the buffer was made on.
func (b *Buffer) Device() *vmm.Device { return b.dev }

// Location is where the buffer's memory lives.
func (b *Buffer) Location() driver.Location { return b.loc }

// Granularity is the unit chunk sizes and Cap are multiples of.
func (b *Buffer) Granularity() uint64 { return b.gran }

// Policy is the chunk policy in use, with defaults filled in.
func (b *Buffer) Policy() ChunkPolicy { return b.policy }

// Reservations is the number of adjacent reservations that make up the address range (1 until the
// first in-place extension).
func (b *Buffer) Reservations() int {
	if b == nil {
		return 0
	}
	b.own.Lock()
	defer b.own.Unlock()
	return len(b.segs)
}

func (b *Buffer) String() string {
	if b == nil {
		return "nil growable buffer"
	}
	return fmt.Sprintf("growable buffer %#x (len %s, cap %s, reserved %s, %s)", b.ptr.Load(),
		units.FormatSize(b.Len()), units.FormatSize(b.Cap()), units.FormatSize(b.Reserved()), b.loc)
}

// Chunks lists the buffer's allocations in offset order; they cover [0, Cap). The allocations belong
// to the buffer: export them, but do not close them, and do not use them after the buffer changes.
func (b *Buffer) Chunks() []vmm.Chunk {
	if b == nil {
		return nil
	}
	b.own.Lock()
	defer b.own.Unlock()
	out := make([]vmm.Chunk, len(b.chunks))
	for i, c := range b.chunks {
		out[i] = vmm.Chunk{Offset: c.off, Allocation: c.m.Allocation()}
	}
	return out
}

func (b *Buffer) use(op string, n uint64) error {
	if b == nil {
		return fmt.Errorf("growbuf: %s to %d bytes: nil buffer: %w", op, n, vmm.ErrInvalidValue)
	}
	if b.closing {
		return fmt.Errorf("growbuf: %s to %d bytes: buffer %#x: %w", op, n, b.ptr.Load(), vmm.ErrClosed)
	}
	return nil
}

// Grow makes Len at least n bytes (n is the total size, not an increment); a smaller n does nothing.
// It maps new chunks as the chunk policy says, extending or moving the reservation when needed (see
// the package doc). The new bytes are not initialized. On failure the buffer is unchanged.
func (b *Buffer) Grow(n uint64) error {
	if b == nil {
		return b.use("grow", n)
	}
	b.own.Lock()
	defer b.own.Unlock()
	if err := b.use("grow", n); err != nil {
		return err
	}
	return b.grow(n)
}

// Resize sets Len to n: it grows like Grow, or shrinks like Shrink.
func (b *Buffer) Resize(n uint64) error {
	if b == nil {
		return b.use("resize", n)
	}
	b.own.Lock()
	defer b.own.Unlock()
	if err := b.use("resize", n); err != nil {
		return err
	}
	if n >= b.length.Load() {
		return b.grow(n)
	}
	return b.shrink(n)
}

// Shrink sets Len to n, which must not exceed Len, and unmaps and releases every chunk that lies
// wholly past n. Before unmapping it waits for queued work (Options.Stream, or else the owning
// device and every peer), so that no queued kernel or copy loses its memory. The address range
// stays reserved, so growing again keeps Ptr. When waiting for queued work fails (cuCtxSynchronize
// or cuStreamSynchronize), or unmapping what a failed clean-up after a move left (which must go
// before the chunks it maps can be released), nothing changes, Len included. When a later driver
// call fails, Len is n and Cap tells what is still mapped. Either way, calling Shrink again retries.
func (b *Buffer) Shrink(n uint64) error {
	if b == nil {
		return b.use("shrink", n)
	}
	b.own.Lock()
	defer b.own.Unlock()
	if err := b.use("shrink", n); err != nil {
		return err
	}
	return b.shrink(n)
}

// chunkSize is the policy's size for a chunk starting at buffer offset pos (< limit), cut at the
// limit.
func (b *Buffer) chunkSize(pos uint64) uint64 {
	c := b.policy.Size
	if !b.policy.Fixed {
		c = min(max(pos, b.policy.Size), b.policy.Max)
	}
	return min(c, b.limit-pos)
}

// step is the size of the chunk that starts at pos: chunkSize, also cut at the end of the
// reservation pos falls in (a mapping cannot span two reservations). Past the reservations it is
// chunkSize.
func (b *Buffer) step(pos uint64) uint64 {
	c := b.chunkSize(pos)
	for i := len(b.segs) - 1; i >= 0; i-- {
		s := b.segs[i]
		if pos >= s.off {
			if end := s.end(); pos < end {
				c = min(c, end-pos)
			}
			break
		}
	}
	return c
}

// segAt is the reservation holding buffer offset pos (< Reserved).
func (b *Buffer) segAt(pos uint64) segment {
	for i := len(b.segs) - 1; i > 0; i-- {
		if pos >= b.segs[i].off {
			return b.segs[i]
		}
	}
	return b.segs[0]
}

// grow implements Grow; the caller holds mu.
func (b *Buffer) grow(n uint64) error {
	if n <= b.length.Load() {
		return nil
	}
	have := b.capacity.Load()
	need, err := vmm.RoundUp(fmt.Sprintf("growbuf: grow to %d bytes", n), n, b.gran)
	if err != nil {
		return fmt.Errorf("%w (%w)", err, ErrTooLarge)
	}
	if need > b.limit {
		return fmt.Errorf("growbuf: grow to %d bytes (%s mapped): past the limit of %s: %w", n, units.FormatSize(need), units.FormatSize(b.limit), ErrTooLarge)
	}
	if need > b.most {
		return fmt.Errorf("growbuf: grow to %d bytes (%s mapped): more than the %s of %s memory could ever back: %w", n, units.FormatSize(need), units.FormatSize(b.most), b.loc, ErrTooLarge)
	}
	if need <= have {
		b.length.Store(n)
		return nil
	}
	// The capacity the policy reaches, chunk by chunk, cut at reservation ends.
	target := have
	for target < need {
		target += b.step(target)
	}
	reserved := b.reserved.Load()
	addedSeg := false
	if target > reserved {
		if err := b.extend(target); err != nil {
			if b.allowMove {
				return b.move(n, need, err)
			}
			return fmt.Errorf("growbuf: grow from %s to %d bytes needs %s of addresses; the reservation of %s at %#x is full and the range after it could not be had (%w): %w",
				units.FormatSize(b.length.Load()), n, units.FormatSize(target), units.FormatSize(reserved), b.ptr.Load(), err, ErrReservationFull)
		}
		addedSeg = true
	}
	var specs []vmm.ChunkSpec
	var news []chunk
	for pos := have; pos < target; {
		size := b.step(pos)
		seg := b.segAt(pos)
		specs = append(specs, vmm.ChunkSpec{Reservation: seg.res, Offset: pos - seg.off, Size: size, Device: b.dev, Alloc: b.allocOpts, Access: b.access})
		news = append(news, chunk{off: pos, size: size})
		pos += size
	}
	maps, err := vmm.MapChunks(specs)
	if err != nil {
		err = fmt.Errorf("growbuf: grow from %s to %d bytes: %w", units.FormatSize(b.length.Load()), n, err)
		if addedSeg {
			err = errors.Join(err, b.dropLastSegment())
		}
		return err
	}
	for i := range news {
		news[i].m = maps[i]
	}
	b.chunks = append(b.chunks, news...)
	b.capacity.Store(target)
	b.length.Store(n)
	return nil
}

// extend reserves the range right after the last reservation so that the buffer reaches target
// bytes of addresses. It asks first for as much again as is reserved (so that extensions stay few),
// then for just what is needed.
func (b *Buffer) extend(target uint64) error {
	last := b.segs[len(b.segs)-1]
	reserved := last.end()
	minimum := target - reserved
	sizes := []uint64{minimum}
	if reserved > minimum && reserved <= ^uint64(0)-reserved {
		sizes = []uint64{reserved, minimum}
	}
	var errs []error
	for _, size := range sizes {
		r, err := b.sys.Reserve(size, vmm.ReserveOptions{Hint: last.res.End(), RequireHint: true})
		if err == nil {
			r.SetKind("growbuf")
			b.segs = append(b.segs, segment{res: r, off: reserved})
			b.reserved.Store(reserved + r.Size())
			return nil
		}
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// dropLastSegment undoes the extension a failed grow made: it frees the last reservation (or,
// should that fail, leaves it with the System to retry). The caller holds the lock.
func (b *Buffer) dropLastSegment() error {
	last := b.segs[len(b.segs)-1]
	b.segs = b.segs[:len(b.segs)-1]
	b.reserved.Store(b.segs[len(b.segs)-1].end())
	if err := vmm.UndoClose(last.res); err != nil {
		return fmt.Errorf("growbuf: undoing the extension: %w", err)
	}
	return nil
}

// move implements a Grow that does not fit in place (Options.AllowMove): it builds the whole buffer
// in a new reservation (the old chunks mapped again, the new ones created), and only when all of that
// worked, waits for queued work, hands the chunks' ownership to the new mappings, and unmaps and frees
// the old range. cause is why the in-place extension failed.
func (b *Buffer) move(n, need uint64, cause error) error {
	have := b.capacity.Load()
	oldReserved := b.reserved.Load()
	target, added := have, 0
	for target < need {
		target += b.chunkSize(target)
		added++
	}
	size := target
	if oldReserved <= ^uint64(0)/2 {
		size = max(target, 2*oldReserved)
	}
	fail := func(what string, err error) error {
		return fmt.Errorf("growbuf: grow from %s to %d bytes: the reservation of %s at %#x is full (%v), and moving to a new range of %s failed: %s: %w (%w)",
			units.FormatSize(b.length.Load()), n, units.FormatSize(oldReserved), b.ptr.Load(), cause, units.FormatSize(size), what, err, ErrReservationFull)
	}
	specs, chunks := b.movedChunks(have, target, added)
	// The old chunks mapped again and the new ones made, in a new range, all or nothing.
	r, maps, err := b.sys.ReserveChunks(size, vmm.ReserveOptions{}, specs)
	if err != nil {
		return fail("building the new range", err)
	}
	r.SetKind("growbuf")
	for i := range chunks {
		chunks[i].m = maps[i]
	}
	undo := func(err error) error {
		var errs []error
		for i := len(maps) - 1; i >= 0; i-- {
			errs = append(errs, vmm.UndoClose(maps[i]))
		}
		errs = append(errs, vmm.UndoClose(r))
		if uerr := errors.Join(errs...); uerr != nil {
			return errors.Join(err, fmt.Errorf("growbuf: undoing the move: %w", uerr))
		}
		return err
	}
	// Commit: nothing queued may still use the old addresses when they are unmapped.
	if err := b.sync(); err != nil {
		return undo(fail("waiting for queued work before unmapping the old range", err))
	}
	for i, c := range b.chunks {
		if err := vmm.TransferOwnership(chunks[i].m, c.m); err != nil {
			for j := i - 1; j >= 0; j-- {
				_ = vmm.TransferOwnership(b.chunks[j].m, chunks[j].m)
			}
			return undo(fail("transferring the chunks", err))
		}
	}
	oldPtr := b.Ptr()
	b.freeOldRange(have)
	clear(b.segs)
	b.segs = append(b.segs[:0], segment{res: r, off: 0})
	b.chunks = chunks
	b.ptr.Store(uint64(r.Ptr()))
	b.reserved.Store(r.Size())
	b.capacity.Store(target)
	b.length.Store(n)
	if b.onMove != nil {
		b.onMove(oldPtr, r.Ptr())
	}
	return nil
}

// movedChunks lists the chunks of a move: the old ones mapped again (their allocations), then
// added new ones up to target, all at their buffer offsets.
func (b *Buffer) movedChunks(have, target uint64, added int) ([]vmm.ChunkSpec, []chunk) {
	specs := make([]vmm.ChunkSpec, 0, len(b.chunks)+added)
	chunks := make([]chunk, 0, len(b.chunks)+added)
	for _, c := range b.chunks {
		specs = append(specs, vmm.ChunkSpec{Offset: c.off, Allocation: c.m.Allocation(), Access: b.access})
		chunks = append(chunks, chunk{off: c.off, size: c.size})
	}
	for pos := have; pos < target; {
		size := b.chunkSize(pos)
		specs = append(specs, vmm.ChunkSpec{Offset: pos, Size: size, Device: b.dev, Alloc: b.allocOpts, Access: b.access})
		chunks = append(chunks, chunk{off: pos, size: size})
		pos += size
	}
	return specs, chunks
}

// freeOldRange unmaps the old reservations after a move (their mappings no longer own the chunks)
// and frees them. The grow has succeeded by then: what cannot be freed is kept (leftMaps, leftRes)
// for Close, which retries it before anything else and reports the error.
func (b *Buffer) freeOldRange(have uint64) {
	oldPtr := b.Ptr()
	var errs []error
	for i := len(b.segs) - 1; i >= 0; i-- {
		s := b.segs[i]
		if mapped := min(have, s.end()); mapped > s.off {
			if err := s.res.UnmapRange(0, mapped-s.off); err != nil {
				errs = append(errs, err)
				b.leftMaps = append(b.leftMaps, s.res.Mappings()...)
			}
		}
		if len(errs) == 0 {
			if err := s.res.Close(); err != nil {
				errs = append(errs, err)
				b.leftRes = append(b.leftRes, s.res)
			}
		} else {
			b.leftRes = append(b.leftRes, s.res)
		}
	}
	if len(errs) > 0 {
		b.deferred = errors.Join(b.deferred, fmt.Errorf("growbuf: freeing the range at %#x after moving the buffer: %w", uint64(oldPtr), errors.Join(errs...)))
	}
}

// sync waits for the work that may use the buffer (see the package doc).
func (b *Buffer) sync() error {
	if b.stream != nil {
		return b.stream.Synchronize()
	}
	for _, d := range b.syncDevs {
		if err := d.Synchronize(); err != nil {
			return err
		}
	}
	return nil
}

// shrink implements Shrink; the caller holds mu.
func (b *Buffer) shrink(n uint64) error {
	if l := b.length.Load(); n > l {
		return fmt.Errorf("growbuf: shrink to %d bytes: larger than Len %d (use Grow or Resize to grow): %w", n, l, vmm.ErrInvalidValue)
	}
	first := len(b.chunks)
	for first > 0 && b.chunks[first-1].off >= n {
		first--
	}
	if first == len(b.chunks) {
		b.length.Store(n)
		return nil
	}
	if err := b.sync(); err != nil {
		return fmt.Errorf("growbuf: shrink to %d bytes: waiting for queued work (nothing was unmapped): %w", n, err)
	}
	if err := b.unmapLeft(fmt.Sprintf("shrink to %d bytes", n)); err != nil {
		return err
	}
	b.length.Store(n)
	if err := b.unmapFrom(first); err != nil {
		return fmt.Errorf("growbuf: shrink to %d bytes (cap now %s): %w", n, units.FormatSize(b.capacity.Load()), err)
	}
	return nil
}

// unmapLeft retries unmapping the old range's mappings that a failed clean-up after a move left
// (freeOldRange). They map the chunks' allocations, which cannot be released while they do.
func (b *Buffer) unmapLeft(op string) error {
	var errs []error
	b.leftMaps, errs = closeAll(op+": unmapping the old range left by a move (nothing was released)", b.leftMaps, nil)
	return errors.Join(errs...)
}

// unmapFrom unmaps and releases chunks[first:], one cuMemUnmap per reservation, last first. The
// caller holds mu and has synchronized.
func (b *Buffer) unmapFrom(first int) error {
	for len(b.chunks) > first {
		last := b.chunks[len(b.chunks)-1]
		seg := b.segAt(last.off)
		j := len(b.chunks) - 1
		for j > first && b.chunks[j-1].off >= seg.off {
			j--
		}
		start, end := b.chunks[j].off, last.off+last.size
		// A range that a failed move's undo left mapping a chunk, kept by the System, is retried
		// by UnmapRange before it releases the chunk.
		if err := seg.res.UnmapRange(start-seg.off, end-start); err != nil {
			// cuMemUnmap failing changes nothing; a release failing after the unmap leaves those
			// mappings open with the release pending: Close retries them.
			if mappingLive(seg.res, last.m) {
				return err
			}
			for _, c := range b.chunks[j:] {
				b.leftMaps = append(b.leftMaps, c.m)
			}
			b.dropChunks(j)
			return err
		}
		b.dropChunks(j)
	}
	return nil
}

// dropChunks forgets chunks[from:], lowering Len (when past the new Cap) before Cap, so that a
// lock-free reader never sees Len > Cap.
func (b *Buffer) dropChunks(from int) {
	clear(b.chunks[from:])
	b.chunks = b.chunks[:from]
	var capacity uint64
	if from > 0 {
		c := b.chunks[from-1]
		capacity = c.off + c.size
	}
	if b.length.Load() > capacity {
		b.length.Store(capacity)
	}
	b.capacity.Store(capacity)
}

// closeAll closes each of list, returning those that failed (to retry) and errs with their errors,
// each prefixed with "growbuf: " and op.
func closeAll[T interface{ Close() error }](op string, list []T, errs []error) ([]T, []error) {
	left := list[:0]
	for _, x := range list {
		if err := x.Close(); err != nil {
			errs = append(errs, fmt.Errorf("growbuf: %s: %w", op, err))
			left = append(left, x)
		}
	}
	clear(list[len(left):])
	return left, errs
}

func mappingLive(r *vmm.Reservation, m *vmm.Mapping) bool {
	for _, x := range r.Mappings() {
		if x == m {
			return true
		}
	}
	return false
}

// Close waits for queued work (as Shrink does), unmaps and releases every chunk and frees the
// address range. Afterwards Ptr, Len, Cap and Reserved are 0 and the other methods fail with
// vmm.ErrClosed. Close is idempotent and safe on nil; when a driver call fails it returns the error
// and a later Close retries what is left. Errors of clean-ups that Grow could not report (after a
// move) are reported here.
func (b *Buffer) Close() error {
	if b == nil {
		return nil
	}
	b.own.Lock()
	defer b.own.Unlock()
	if b.own.Closed() {
		return nil
	}
	b.closing = true
	var errs []error
	if b.deferred != nil {
		errs = append(errs, b.deferred)
		b.deferred = nil
	}
	if len(b.chunks) > 0 || len(b.leftMaps) > 0 {
		if err := b.sync(); err != nil {
			// Unmap anyway: a failed synchronization means a broken context, whose work will not run.
			errs = append(errs, fmt.Errorf("growbuf: close: waiting for queued work: %w", err))
		}
	}
	// What an earlier failure left first: an old range's mappings still map allocations that the
	// chunks own, which can be released only once those are unmapped.
	b.leftMaps, errs = closeAll("close", b.leftMaps, errs)
	if len(b.chunks) > 0 {
		if err := b.unmapFrom(0); err != nil {
			errs = append(errs, fmt.Errorf("growbuf: close: %w", err))
		}
	}
	b.length.Store(0)
	for len(b.segs) > 0 && len(b.chunks) == 0 {
		s := b.segs[len(b.segs)-1]
		if err := s.res.Close(); err != nil {
			errs = append(errs, fmt.Errorf("growbuf: close: %w", err))
			break
		}
		b.segs = b.segs[:len(b.segs)-1]
	}
	b.leftRes, errs = closeAll("close", b.leftRes, errs)
	if len(b.segs) == 0 {
		b.ptr.Store(0)
		b.reserved.Store(0)
	} else {
		b.reserved.Store(b.segs[len(b.segs)-1].end())
	}
	if len(errs) == 0 && len(b.segs) == 0 && len(b.leftMaps) == 0 && len(b.leftRes) == 0 {
		b.own.MarkClosed()
	}
	return errors.Join(errs...)
}
