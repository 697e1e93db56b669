package offload

import (
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// Policy says what happens to a buffer's content while it sleeps.
type Policy int

// Policies.
const (
	// Keep backs the content up in pinned host memory and restores it on wake.
	Keep Policy = iota
	// Discard drops the content; woken memory is zeroed unless EntryOptions.NoZero.
	Discard
	// File writes the content to EntryOptions.File at sleep and reads it back at wake.
	File
)

func (p Policy) String() string {
	switch p {
	case Keep:
		return "keep"
	case Discard:
		return "discard"
	case File:
		return "file"
	}
	return fmt.Sprintf("policy(%d)", int(p))
}

// ParsePolicy parses "keep", "discard" or "file".
func ParsePolicy(s string) (Policy, error) {
	for _, p := range []Policy{Keep, Discard, File} {
		if p.String() == s {
			return p, nil
		}
	}
	return 0, fmt.Errorf("offload: policy %q: want keep, discard or file: %w", s, ErrInvalidValue)
}

// FileBacking is where a File policy keeps a buffer's content (an *os.File works). Its methods run
// while the set is locked: of the set's methods they may call Stats only.
type FileBacking interface {
	io.WriterAt
	io.ReaderAt
}

// EntryOptions tunes one buffer of a set.
type EntryOptions struct {
	// Stream is the stream all work on the buffer is queued on: Sleep synchronizes it. When nil,
	// Sleep synchronizes every device the buffer's chunks live on (cuCtxSynchronize).
	Stream *vmm.Stream
	// File and FileOffset say where a File policy keeps the content: bytes [FileOffset,
	// FileOffset+size) of File, where size is the sum of the buffer's chunks.
	File       FileBacking
	FileOffset int64
	// Force lets a buffer exported to other processes sleep. Its memory is not freed while they hold
	// it, and they keep it: after Wake this process has new memory with the content of the sleep, and
	// the importers' writes no longer reach it, nor its theirs (export the woken buffer again to
	// share it).
	Force bool
	// NoZero leaves a Discard buffer's woken memory uninitialized instead of zeroing it.
	NoZero bool
}

// Options tunes a Set.
type Options struct {
	// SlotSize is the size of the pinned host slots backups are made of (default 256 MiB: copies of
	// that size run at full speed, and pinning one takes about 10-20 ms). It is rounded up to 2 MiB, and
	// a sleep smaller than one slot uses a smaller one.
	SlotSize uint64
	// Progress, when set, is called with the bytes copied so far and the total, during Sleep, Wake,
	// Save, Restore and Load (from several goroutines, never at once). Restore counts a byte when it
	// has been read from the checkpoint into pinned memory: it checks every checksum before copying
	// any byte to a GPU, and those copies, at the copy engine's speed, end the call. It runs while the
	// set is locked: of the set's methods it may call Stats only (the others would wait forever).
	Progress func(done, total uint64)
	// IOWorkers is how many goroutines move a File buffer's bytes between the file and pinned
	// staging memory, each a part (FilePart) at a time, taking the next part as soon as it is done
	// (0: DefaultIOWorkers). One thread copies between the page cache and memory at a few GB/s;
	// fast storage and a warm page cache want several.
	IOWorkers int
	// FilePart is the bytes an I/O goroutine moves at once (0: DefaultFilePart), rounded up to 4 KiB
	// and at most a slot; FileBuffers is how many staging buffers of that size each goroutine cycles
	// through (0: DefaultFileBuffers). More buffers let the reads run further ahead of the copies;
	// fewer keep the bytes just read in the CPU's cache until the device copies them.
	FilePart    uint64
	FileBuffers int
	// FirstSleep says how a sleep backs up a Keep buffer when the pool has no slots for it
	// (FirstSleepAuto, also for values it does not know: staged where the System has opened several
	// devices; see FirstSleep).
	FirstSleep FirstSleep
}

// DefaultIOWorkers is Options.IOWorkers' default, per device. On the measured host, 8 goroutines
// woke 8 GiB from a file in the page cache at 46-50 GB/s in most runs, near the copy engine's 55
// GB/s (16 made 51 GB/s), while the writes of a sleep stayed near 5-6 GB/s with any count. With two
// GPUs at once, 16 per device woke a fifth slower than 8: the reads and the copies share the host's
// memory (docs/offload-runs.md).
const DefaultIOWorkers = 8

// DefaultSlotSize is Options.SlotSize's default.
const DefaultSlotSize uint64 = 256 << 20

// DefaultFilePart is Options.FilePart's default: the bytes an I/O goroutine moves at once in File
// mode. Each goroutine cycles through DefaultFileBuffers staging buffers of that size. Measured in
// C on the project's H200 hosts (reading a file out of the page cache into pinned staging, then
// copying it to the device, 8 threads per GPU, rounds of five, each against a read alone of the
// same parts), the medians: 4 MiB parts in 2 buffers woke at 0.93-0.99 of the read alone on two
// GPUs at once and 0.89-0.90 on one; 2 MiB in 4 buffers at 0.80-0.83 and 0.81-0.85; 2 MiB in 2 at
// 0.88 and 0.74-0.81. 32 MiB parts fell far behind (29 GB/s against 49 on one GPU).
const DefaultFilePart uint64 = 4 << 20

// DefaultFileBuffers is Options.FileBuffers' default: each I/O goroutine reads into one staging
// buffer while the device copies from the other (see DefaultFilePart).
const DefaultFileBuffers = 2

// Set is a set of buffers that sleep and wake together or by tag. It is safe for concurrent use;
// Sleep, Wake, Save, Restore and Close serialize.
type Set struct {
	sys  *vmm.System
	opts Options

	// mu serializes the methods and guards the fields below. It is a mutex of the set's own, not
	// the owner's lock, because a buffer closed while asleep frees its backup from under its
	// allocation's lock, which it may do only when it gets mu at once (TryLock; see onChunkClosed).
	mu      sync.Mutex
	entries []*entry
	pool    *hostPool
	streams map[*vmm.Device]*vmm.Stream // one copy stream per device, made on first use
	own     lifetime.Owner              // the set's closed state; its lock is taken only with mu held
	stats   setStats                    // what Stats returns, as the last call left it
	steps   SleepSteps                  // the last sleep's steps, for Stats once it is counted
	staged  atomic.Uint64               // the bytes the running sleep staged (SleepSteps.StagedBytes)

	stagedMu   sync.Mutex
	toRegister []*slot // staged slots whose registration copyOut starts (queueRegistration)
}

// entry is one buffer of a set.
type entry struct {
	tag    string
	buf    vmm.Chunked
	policy Policy
	opts   EntryOptions

	// asleep: the entry sleeps, and Wake restores every chunk. A failed Sleep or Wake whose undo
	// failed too leaves an entry asleep with some chunks still mapped; Wake skips creating those.
	asleep   bool
	chunks   []chunkState // while asleep: what it takes to recreate each chunk
	backup   []*slot      // Keep policy while asleep: the content, in chunk order
	released atomic.Int64 // chunks whose memory is released (ReleaseAt), closed or not
	closed   atomic.Int64 // chunks closed while released
	// busy lists the devices where copies queued by a failed Wake that could neither drain its
	// stream nor synchronize the device may still read the backup: reap then holds the backup
	// (hostPool.hold) until they all synchronize, instead of freeing it. The System's retry takes
	// a device off once it synchronized it.
	busy []*vmm.Device
}

// chunkState is one chunk of a sleeping buffer.
type chunkState struct {
	alloc  *vmm.Allocation
	ptr    driver.DevicePtr
	size   uint64
	access []vmm.Access
	backup []hostPiece // Keep policy: where the content is
	// pending: a failed Wake that could not drain its copies left the chunk mapped, for the System
	// to release again once the device synchronizes (Set.resleepLater); the caller may close it
	// meanwhile, and reap then counts it as released and closed.
	pending bool
	// live: a failed Sleep whose undo failed too never released the chunk, so its content is in the
	// chunk itself (its backup may be incomplete: the copy that failed was its own or one before
	// it). Wake leaves it as it is.
	live bool
}

func ptrOff(n uint64) driver.DevicePtr { return driver.DevicePtr(n) }

// NewSet makes an empty set for the buffers of sys.
func NewSet(sys *vmm.System, opts Options) *Set {
	s := &Set{sys: sys, opts: opts.withDefaults(), pool: newHostPool(sys), streams: map[*vmm.Device]*vmm.Stream{}}
	s.own.Init(nil, "set")
	lifetime.Track(s, &s.own)
	return s
}

// withDefaults fills in the zero options and rounds SlotSize to a huge page, FilePart to 4 KiB.
func (opts Options) withDefaults() Options {
	if opts.SlotSize == 0 {
		opts.SlotSize = DefaultSlotSize
	}
	opts.SlotSize = min(opts.SlotSize, math.MaxUint64/hugePage*hugePage) // rounding up must not wrap to 0
	opts.SlotSize = (opts.SlotSize + hugePage - 1) / hugePage * hugePage
	if opts.IOWorkers <= 0 {
		opts.IOWorkers = DefaultIOWorkers
	}
	if opts.FilePart == 0 {
		opts.FilePart = DefaultFilePart
	}
	opts.FilePart = (min(opts.FilePart, opts.SlotSize) + 4095) / 4096 * 4096
	if opts.FileBuffers <= 0 {
		opts.FileBuffers = DefaultFileBuffers
	}
	if opts.FirstSleep < FirstSleepAuto || opts.FirstSleep > FirstSleepStage {
		opts.FirstSleep = FirstSleepAuto
	}
	return opts
}

// Add adds buf under tag with policy. Every chunk of buf must belong to the set's System, and tag
// must be new and not empty. The buffer must be awake; the set does not own it (close it yourself,
// after removing it or closing the set).
func (s *Set) Add(tag string, buf vmm.Chunked, policy Policy, opts EntryOptions) error {
	if err := s.checkAdd(tag, buf, policy, opts); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.publish()
	if s.own.IsClosed() {
		return fmt.Errorf("offload: add %q: %w", tag, ErrClosed)
	}
	if s.find(tag) != nil {
		return fmt.Errorf("offload: add %q: the tag is taken: %w", tag, ErrInvalidValue)
	}
	if other := s.sharing(buf); other != nil {
		return fmt.Errorf("offload: add %q: it shares memory with %s, already in the set: %w", tag, other, ErrInvalidValue)
	}
	s.entries = append(s.entries, &entry{tag: tag, buf: buf, policy: policy, opts: opts})
	return nil
}

// sharing returns the entry that holds one of buf's allocations, if any; the caller holds s.mu.
func (s *Set) sharing(buf vmm.Chunked) *entry {
	mine := map[*vmm.Allocation]bool{}
	for _, c := range buf.Chunks() {
		mine[c.Allocation] = true
	}
	for _, e := range s.entries {
		if e.asleep {
			for _, cs := range e.chunks {
				if mine[cs.alloc] {
					return e
				}
			}
			continue
		}
		for _, c := range e.buf.Chunks() {
			if mine[c.Allocation] {
				return e
			}
		}
	}
	return nil
}

func (s *Set) checkAdd(tag string, buf vmm.Chunked, policy Policy, opts EntryOptions) error {
	switch {
	case s == nil || s.sys == nil:
		return fmt.Errorf("offload: add %q: nil set or system: %w", tag, ErrInvalidValue)
	case tag == "":
		return fmt.Errorf("offload: add: empty tag: %w", ErrInvalidValue)
	case buf == nil:
		return fmt.Errorf("offload: add %q: nil buffer: %w", tag, ErrInvalidValue)
	case policy < Keep || policy > File:
		return fmt.Errorf("offload: add %q: %s: %w", tag, policy, ErrInvalidValue)
	case policy == File && opts.File == nil:
		return fmt.Errorf("offload: add %q: the file policy needs EntryOptions.File: %w", tag, ErrInvalidValue)
	case opts.FileOffset < 0:
		return fmt.Errorf("offload: add %q: negative file offset %d: %w", tag, opts.FileOffset, ErrInvalidValue)
	}
	chunks := buf.Chunks()
	if len(chunks) == 0 {
		return fmt.Errorf("offload: add %q: the buffer has no chunks: %w", tag, ErrInvalidValue)
	}
	for i, c := range chunks {
		if c.Allocation == nil {
			return fmt.Errorf("offload: add %q: chunk %d has no allocation: %w", tag, i, ErrInvalidValue)
		}
		if c.Allocation.Device().System() != s.sys {
			return fmt.Errorf("offload: add %q: chunk %d (%s) belongs to another System: %w", tag, i, c.Allocation, ErrInvalidValue)
		}
		if c.Allocation.Asleep() {
			return fmt.Errorf("offload: add %q: chunk %d is asleep (in another set?): %w", tag, i, ErrInvalidValue)
		}
	}
	if opts.Stream != nil && opts.Stream.Device().System() != s.sys {
		return fmt.Errorf("offload: add %q: the stream belongs to another System: %w", tag, ErrInvalidValue)
	}
	return nil
}

// Remove takes the buffer tagged tag out of the set; it must be awake.
func (s *Set) Remove(tag string) error {
	if s == nil {
		return fmt.Errorf("offload: remove %q: nil set: %w", tag, ErrInvalidValue)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.own.IsClosed() {
		return fmt.Errorf("offload: remove %q: %w", tag, ErrClosed)
	}
	defer s.publish()
	s.reap()
	e := s.find(tag)
	if e == nil {
		return fmt.Errorf("offload: remove %q: no such tag: %w", tag, ErrInvalidValue)
	}
	if e.asleep {
		return fmt.Errorf("offload: remove %q: it is asleep (wake it first): %w", tag, ErrAsleep)
	}
	s.entries = slices.DeleteFunc(s.entries, func(x *entry) bool { return x == e })
	return nil
}

func (s *Set) find(tag string) *entry {
	for _, e := range s.entries {
		if e.tag == tag {
			return e
		}
	}
	return nil
}

// Tags lists the tags in the order they were added (none for a nil set).
func (s *Set) Tags() []string {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.entries))
	for _, e := range s.entries {
		out = append(out, e.tag)
	}
	return out
}

// Asleep reports whether the buffer tagged tag is asleep (false for a nil set).
func (s *Set) Asleep(tag string) bool {
	if s == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.find(tag)
	return e != nil && e.asleep
}

// BackupBytes is the pinned host memory the set holds: backups of sleeping buffers plus the slots
// pooled for the next sleep (0 for a nil set).
func (s *Set) BackupBytes() uint64 {
	if s == nil {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	n := s.pool.bytes() + s.pool.heldBytes()
	for _, e := range s.entries {
		for _, sl := range e.backup {
			n += sl.size
		}
	}
	return n
}

// TrimPool frees the pinned slots pooled for the next sleep (backups of sleeping buffers stay). A
// slot that fails to be unpinned is handed to the System (System.Keep), which retries it. It is
// safe on nil, which holds nothing.
func (s *Set) TrimPool() error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.publish()
	s.pool.settle()
	return s.pool.trim()
}

// selectEntries returns the entries named by tags (all when none is given), in the set's order; the
// caller holds s.mu.
func (s *Set) selectEntries(op string, tags []string) ([]*entry, error) {
	if s.own.IsClosed() {
		return nil, fmt.Errorf("offload: %s: %w", op, ErrClosed)
	}
	if len(tags) == 0 {
		return slices.Clone(s.entries), nil
	}
	var out []*entry
	for _, t := range tags {
		e := s.find(t)
		if e == nil {
			return nil, fmt.Errorf("offload: %s: no buffer tagged %q: %w", op, t, ErrInvalidValue)
		}
		if !slices.Contains(out, e) {
			out = append(out, e)
		}
	}
	slices.SortFunc(out, func(a, b *entry) int { return slices.Index(s.entries, a) - slices.Index(s.entries, b) })
	return out, nil
}

// stream is the set's copy stream for d; the caller holds s.mu.
func (s *Set) stream(d *vmm.Device) (*vmm.Stream, error) {
	if st := s.streams[d]; st != nil {
		return st, nil
	}
	st, err := d.CreateStream(vmm.StreamOptions{NonBlocking: true})
	if err != nil {
		return nil, fmt.Errorf("offload: copy stream for %s: %w", d, err)
	}
	s.streams[d] = st
	return st, nil
}

// catchUp is how a call that uses the entries or the pool begins (the caller holds s.mu): it drops
// the entries closed while asleep (reap) and pools again the slots a failed call held, once their
// device is idle (hostPool.settle).
func (s *Set) catchUp() {
	s.reap()
	s.pool.settle()
}

// reap drops the sleeping entries whose buffers were closed while asleep and frees their backups;
// the caller holds s.mu.
func (s *Set) reap() {
	s.entries = slices.DeleteFunc(s.entries, func(e *entry) bool {
		if !e.asleep || s.pendingOpen(e) || e.released.Load() == 0 || e.closed.Load() < e.released.Load() {
			return false
		}
		if len(e.busy) > 0 {
			_ = s.pool.hold(e.backup, e.busy...) // pooled once the devices synchronize, else the System's
		} else {
			s.pool.free(e.backup)
		}
		e.backup, e.chunks, e.busy = nil, nil, nil
		return true
	})
}

// pendingOpen reports whether a chunk of e that a failed Wake left mapped (chunkState.pending) is
// still open. One the caller closed meanwhile no longer waits for the System: it counts as
// released and closed, like a sleeping chunk closed. The caller holds s.mu, and no allocation lock
// of e's sleeping chunks' (see onChunkClosed): a pending chunk is mapped, so its lock is not that.
func (s *Set) pendingOpen(e *entry) bool {
	open := false
	for i := range e.chunks {
		cs := &e.chunks[i]
		switch {
		case !cs.pending:
		case cs.alloc.Closed():
			cs.pending = false
			e.released.Add(1)
			e.closed.Add(1)
		default:
			open = true
		}
	}
	return open
}

// onChunkClosed is what a sleeping chunk's allocation runs when it is closed (under the
// allocation's lock): once the whole buffer is closed, its backup is freed now if the set is idle,
// else by the next call on the set.
func (s *Set) onChunkClosed(e *entry) func() {
	return func() {
		if e.closed.Add(1) < e.released.Load() {
			return
		}
		if s.mu.TryLock() {
			s.reap()
			s.publish() // Stats without the closed buffer and its backup at once
			s.mu.Unlock()
		}
	}
}

// Close frees the pooled slots and the copy streams. It fails with an error wrapping vmm.ErrInUse,
// freeing nothing, while a buffer of the set sleeps: wake it, or close the buffer (which frees its
// backup), first, so that no content is dropped by accident. The buffers stay the caller's. A copy
// stream that fails to be destroyed is handed to the System, whose Close frees it (vmm.UndoClose),
// and so is a pooled slot that fails to be unpinned (System.Keep).
// Close is idempotent and safe on nil.
func (s *Set) Close() error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.publish()
	if s.own.IsClosed() {
		return nil
	}
	s.reap()
	for _, e := range s.entries {
		if e.asleep {
			return fmt.Errorf("offload: close: %s is asleep (wake it or close it first): %w", e, vmm.ErrInUse)
		}
	}
	s.pool.settle()
	errs := []error{s.pool.trim(), s.pool.handOver()}
	for d, st := range s.streams {
		errs = append(errs, vmm.UndoClose(st)) // a stream that fails to go is the System's to free
		delete(s.streams, d)
	}
	// Nothing is left to retry here: slots and streams that failed to be freed are the System's.
	s.own.Shut()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("offload: close: %w", err)
	}
	return nil
}

func sizeOf(chunks []vmm.Chunk) uint64 {
	var n uint64
	for _, c := range chunks {
		n += c.Allocation.Size()
	}
	return n
}

func (e *entry) String() string {
	return fmt.Sprintf("%q (%s, %s at %#x)", e.tag, e.policy, units.FormatSize(e.buf.Len()), uint64(e.buf.Ptr()))
}

// Mappings makes a reservation's mappings a buffer a Set can hold: Ptr is the reservation's start,
// the chunks are its mappings' allocations at their offsets, Len the end of the last one. The
// mappings must not change while the buffer is in a set.
func Mappings(r *vmm.Reservation) vmm.Chunked {
	if r == nil {
		return nil
	}
	return reservationChunks{r}
}

type reservationChunks struct{ r *vmm.Reservation }

func (c reservationChunks) Ptr() driver.DevicePtr { return c.r.Ptr() }

func (c reservationChunks) Len() uint64 {
	ms := c.r.Mappings()
	if len(ms) == 0 {
		return 0
	}
	last := ms[len(ms)-1]
	return last.Offset() + last.Size()
}

func (c reservationChunks) Chunks() []vmm.Chunk {
	ms := c.r.Mappings()
	out := make([]vmm.Chunk, len(ms))
	for i, m := range ms {
		out[i] = vmm.Chunk{Offset: m.Offset(), Allocation: m.Allocation()}
	}
	return out
}
