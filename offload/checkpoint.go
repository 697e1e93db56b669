package offload

import (
	"bufio"
	"cmp"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"slices"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// A checkpoint is:
//
//	magic "CUVMMCKP" | version uint32 | header length uint32 | header (JSON) | CRC-32C of the header
//	then, for every entry and every chunk in header order: the chunk's bytes | their CRC-32C
//
// Integers are little-endian. The header describes the layout (tags, policies, addresses, chunk
// offsets, sizes, properties and access), so that a checkpoint can be checked against a set before
// any byte is restored, and the buffers recreated in a new process.
const (
	checkpointMagic   = "CUVMMCKP"
	checkpointVersion = 1
	maxHeader         = 64 << 20
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

type ckHeader struct {
	Entries []ckEntry `json:"entries"`
}

type ckEntry struct {
	Tag    string    `json:"tag"`
	Policy string    `json:"policy"`
	Ptr    uint64    `json:"ptr"`
	Len    uint64    `json:"len"`
	Chunks []ckChunk `json:"chunks"`
}

type ckChunk struct {
	Offset        uint64     `json:"offset"`
	Size          uint64     `json:"size"`
	Device        int        `json:"device"`
	LocationType  int32      `json:"location_type"`
	LocationID    int32      `json:"location_id"`
	HandleTypes   int32      `json:"handle_types"`
	Compression   bool       `json:"compression,omitempty"`
	GPUDirectRDMA bool       `json:"gpu_direct_rdma,omitempty"`
	Access        []ckAccess `json:"access"`
}

type ckAccess struct {
	LocationType int32 `json:"location_type"`
	LocationID   int32 `json:"location_id"`
	Flags        int32 `json:"flags"`
}

func (c ckChunk) allocOptions() vmm.AllocOptions {
	return vmm.AllocOptions{Location: driver.Location{Type: driver.LocationType(c.LocationType), ID: c.LocationID},
		HandleTypes: driver.HandleType(c.HandleTypes), Compression: c.Compression, GPUDirectRDMA: c.GPUDirectRDMA}
}

func (c ckChunk) access() []vmm.Access {
	out := make([]vmm.Access, len(c.Access))
	for i, a := range c.Access {
		out[i] = vmm.Access{Location: driver.Location{Type: driver.LocationType(a.LocationType), ID: a.LocationID}, Flags: driver.AccessFlags(a.Flags)}
	}
	return out
}

// describe builds the header entry of e (awake) and the chunk list it describes.
func describe(e *entry) (ckEntry, []chunkState, error) {
	ce := ckEntry{Tag: e.tag, Policy: e.policy.String(), Ptr: uint64(e.buf.Ptr()), Len: e.buf.Len()}
	var states []chunkState
	for i, c := range e.buf.Chunks() {
		a := c.Allocation
		if a == nil || a.Asleep() {
			return ce, nil, fmt.Errorf("offload: checkpoint %s: chunk %d is asleep or missing: %w", e, i, ErrAsleep)
		}
		ptr := e.buf.Ptr() + ptrOff(c.Offset)
		acc, err := a.AccessAt(ptr)
		if err != nil {
			return ce, nil, fmt.Errorf("offload: checkpoint %s: chunk %d: %w", e, i, err)
		}
		ce.Chunks = append(ce.Chunks, chunkRecord(a, c.Offset, acc))
		states = append(states, chunkState{alloc: a, ptr: ptr, size: a.Size(), access: acc})
	}
	return ce, states, nil
}

// describeAsleep builds the header entry of a sleeping Keep entry from what its sleep recorded.
func describeAsleep(e *entry) ckEntry {
	ce := ckEntry{Tag: e.tag, Policy: e.policy.String(), Ptr: uint64(e.buf.Ptr()), Len: e.buf.Len()}
	for _, cs := range e.chunks {
		ce.Chunks = append(ce.Chunks, chunkRecord(cs.alloc, uint64(cs.ptr-e.buf.Ptr()), cs.access))
	}
	return ce
}

// end is where the entry's last chunk ends: the size of the range its buffer needs.
func (ce ckEntry) end() uint64 {
	var end uint64
	for _, c := range ce.Chunks {
		end = max(end, c.Offset+c.Size)
	}
	return end
}

// size is the sum of the entry's chunks.
func (ce ckEntry) size() uint64 {
	var n uint64
	for _, c := range ce.Chunks {
		n += c.Size
	}
	return n
}

// check refuses an entry that no buffer could have written: no chunks, an empty chunk or one past
// the end of the address space, chunks that overlap, or a length in use beyond the end of its
// chunks.
func (ce ckEntry) check() error {
	if len(ce.Chunks) == 0 {
		return fmt.Errorf("offload: checkpoint entry %q: no chunks: %w", ce.Tag, ErrBadCheckpoint)
	}
	for i, c := range ce.Chunks {
		if c.Size == 0 || c.Offset+c.Size < c.Offset {
			return fmt.Errorf("offload: checkpoint entry %q: chunk %d of %d bytes at offset %#x: %w", ce.Tag, i, c.Size, c.Offset, ErrBadCheckpoint)
		}
	}
	order := make([]int, len(ce.Chunks))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return cmp.Compare(ce.Chunks[a].Offset, ce.Chunks[b].Offset) })
	for k := 1; k < len(order); k++ {
		prev, c := ce.Chunks[order[k-1]], ce.Chunks[order[k]]
		if c.Offset < prev.Offset+prev.Size {
			return fmt.Errorf("offload: checkpoint entry %q: chunk %d (%d bytes at offset %#x) overlaps chunk %d (%d bytes at offset %#x): %w",
				ce.Tag, order[k], c.Size, c.Offset, order[k-1], prev.Size, prev.Offset, ErrBadCheckpoint)
		}
	}
	if end := ce.end(); ce.Len > end {
		return fmt.Errorf("offload: checkpoint entry %q: length %d is beyond its chunks, which end at %d: %w", ce.Tag, ce.Len, end, ErrBadCheckpoint)
	}
	return nil
}

func chunkRecord(a *vmm.Allocation, off uint64, acc []vmm.Access) ckChunk {
	p := a.Properties()
	cc := ckChunk{Offset: off, Size: a.Size(), Device: a.Device().Ordinal(), LocationType: int32(p.Location.Type),
		LocationID: p.Location.ID, HandleTypes: int32(p.RequestedHandleTypes), Compression: p.Compression != driver.CompressionNone,
		GPUDirectRDMA: p.GPUDirectRDMACapable}
	for _, x := range acc {
		cc.Access = append(cc.Access, ckAccess{int32(x.Location.Type), x.Location.ID, int32(x.Flags)})
	}
	return cc
}

// Save writes a checkpoint of the buffers tagged tags (every buffer when none is given) to w: the
// header, then each chunk's bytes with its CRC-32C. Awake buffers are read from the GPU once the
// work queued on them is done (their EntryOptions.Stream, else their devices, as Sleep waits; they
// must not be written while Save runs); sleeping Keep buffers from their backup. A sleeping Discard or
// File buffer has no content here: Save fails with an error wrapping ErrAsleep.
func (s *Set) Save(ctx context.Context, w io.Writer, tags ...string) error {
	if s == nil {
		return fmt.Errorf("offload: save: nil set: %w", ErrInvalidValue)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.publish()
	s.catchUp()
	es, err := s.selectEntries("save", tags)
	if err != nil {
		return err
	}
	var hdr ckHeader
	var refs []chunkRef
	var awake []*entry
	defer func() { forget(awake) }()
	for _, e := range es {
		switch {
		case e.asleep && e.policy != Keep:
			return fmt.Errorf("offload: save %s: its content is not in memory while it sleeps: %w", e, ErrAsleep)
		case e.asleep:
			hdr.Entries = append(hdr.Entries, describeAsleep(e))
		default:
			ce, states, err := describe(e)
			if err != nil {
				return err
			}
			hdr.Entries = append(hdr.Entries, ce)
			e.chunks = states
			awake = append(awake, e)
		}
		for i := range e.chunks {
			refs = append(refs, chunkRef{e, i})
		}
	}
	for _, ce := range hdr.Entries { // nothing Load and Restore would refuse is written
		if err := ce.check(); err != nil {
			return fmt.Errorf("offload: save %q: not as it is now (closed, or grown or shrunk while asleep): %v: %w", ce.Tag, err, ErrInvalidValue)
		}
	}
	synced := map[*vmm.Device]bool{} // the work queued on the buffers first, as Sleep does
	for _, e := range awake {
		if err := syncEntry("save", e, synced); err != nil {
			return err
		}
	}
	bw := bufio.NewWriterSize(w, 1<<20)
	if err := writeHeader(bw, &hdr); err != nil {
		return fmt.Errorf("offload: save: %w", err)
	}
	if err := s.saveChunks(ctx, bw, refs); err != nil {
		return fmt.Errorf("offload: save: %w", err)
	}
	if err := bw.Flush(); err != nil {
		return fmt.Errorf("offload: save: %w", err)
	}
	return nil
}

func writeHeader(w io.Writer, hdr *ckHeader) error {
	js, err := json.Marshal(hdr)
	if err != nil {
		return err
	}
	var fixed [16]byte
	copy(fixed[:], checkpointMagic)
	binary.LittleEndian.PutUint32(fixed[8:], checkpointVersion)
	binary.LittleEndian.PutUint32(fixed[12:], uint32(len(js)))
	var sum [4]byte
	binary.LittleEndian.PutUint32(sum[:], crc32.Checksum(js, castagnoli))
	for _, b := range [][]byte{fixed[:], js, sum[:]} {
		if _, err := w.Write(b); err != nil {
			return err
		}
	}
	return nil
}

// saveChunks streams each chunk through one pinned staging slot to w.
func (s *Set) saveChunks(ctx context.Context, w io.Writer, refs []chunkRef) error {
	if len(refs) == 0 {
		return nil
	}
	prog := &progress{fn: s.opts.Progress}
	var staged uint64 // the largest chunk copied through the staging slot
	for _, r := range refs {
		prog.total += r.state().size
		if fromDevice(r) {
			staged = max(staged, r.state().size)
		}
	}
	return s.withStaging(ctx, refs[0].state().alloc.Device(), staged, func(stage *slot) error {
		for _, r := range refs {
			if fromDevice(r) {
				if err := s.saveAwake(ctx, w, r, stage, prog); err != nil {
					return err
				}
			} else if err := saveBackup(ctx, w, r.state(), prog); err != nil {
				return fmt.Errorf("write %s chunk %d: %w", r.e, r.i, err)
			}
		}
		return nil
	})
}

// saveAwake copies an awake chunk to w through stage, a slot at a time, then writes its checksum.
// No copy is left running into stage when it returns, even on failure (copyWait), unless the error
// wraps errNotDrained: then stage is held out of the pool.
func (s *Set) saveAwake(ctx context.Context, w io.Writer, r chunkRef, stage *slot, prog *progress) error {
	cs := r.state()
	d := cs.alloc.Device()
	st, err := s.stream(d)
	if err != nil {
		return err
	}
	crc := uint32(0)
	for off := uint64(0); off < cs.size; off += stage.size {
		n := min(stage.size, cs.size-off)
		if err := s.copyWait(stage.ptr(0), cs.ptr+ptrOff(off), n, st, stage); err != nil {
			return fmt.Errorf("copy %s chunk %d: %w", r.e, r.i, err)
		}
		crc = crc32.Update(crc, castagnoli, stage.mem[:n])
		if _, err := w.Write(stage.mem[:n]); err != nil {
			return fmt.Errorf("write %s chunk %d: %w", r.e, r.i, err)
		}
		prog.add(n)
		if err := ctx.Err(); err != nil {
			return err
		}
	}
	var sum [4]byte
	binary.LittleEndian.PutUint32(sum[:], crc)
	if _, err := w.Write(sum[:]); err != nil {
		return fmt.Errorf("write %s chunk %d: %w", r.e, r.i, err)
	}
	return nil
}

// saveBackup writes a sleeping chunk's bytes from its backup, and their checksum; the end of ctx
// stops it between pieces.
func saveBackup(ctx context.Context, w io.Writer, cs *chunkState, prog *progress) error {
	crc := uint32(0)
	for _, hp := range cs.backup {
		b := hp.slot.mem[hp.slotOff : hp.slotOff+hp.n]
		crc = crc32.Update(crc, castagnoli, b)
		if _, err := w.Write(b); err != nil {
			return err
		}
		prog.add(hp.n)
		if err := ctx.Err(); err != nil {
			return err
		}
	}
	var sum [4]byte
	binary.LittleEndian.PutUint32(sum[:], crc)
	_, err := w.Write(sum[:])
	return err
}

// fromDevice reports whether Save reads r's content from the device: an awake chunk, or a live one
// (whose content is in it, maybe in no backup); the others come from their backup.
func fromDevice(r chunkRef) bool { return !r.e.asleep || r.state().live }

// withStaging runs fn with a staging slot for chunks of up to n bytes (the set's slot size, or n
// rounded up to a huge page when smaller) taken from the pool (pinning one if needed) and pools it
// again after, unless fn's error wraps errNotDrained: a copy may then still use the slot, which
// copyWait has held out of the pool. With n 0 nothing is staged: fn gets nil.
func (s *Set) withStaging(ctx context.Context, d *vmm.Device, n uint64, fn func(stage *slot) error) error {
	if n == 0 {
		return fn(nil)
	}
	f := s.pool.feed(ctx, d, 1, unitSlotSize(s.opts.SlotSize, n))
	stage, err := f.take()
	f.finish()
	if err != nil {
		return err
	}
	err = fn(stage)
	if !errors.Is(err, errNotDrained) {
		s.pool.put(stage) // every copy into or from it has finished: copyWait waits or drains
	}
	return err
}

// readHeader reads and checks a checkpoint's header, the tags (not empty, none twice) and the
// layout of each of its entries.
func readHeader(r io.Reader) (*ckHeader, error) {
	var fixed [16]byte
	if _, err := io.ReadFull(r, fixed[:]); err != nil {
		return nil, fmt.Errorf("offload: checkpoint header: %w: %w", ErrBadCheckpoint, err)
	}
	if string(fixed[:8]) != checkpointMagic {
		return nil, fmt.Errorf("offload: not a cuvmm offload checkpoint (magic %q): %w", fixed[:8], ErrBadCheckpoint)
	}
	if v := binary.LittleEndian.Uint32(fixed[8:]); v != checkpointVersion {
		return nil, fmt.Errorf("offload: checkpoint version %d, want %d: %w", v, checkpointVersion, ErrBadCheckpoint)
	}
	n := binary.LittleEndian.Uint32(fixed[12:])
	if n > maxHeader {
		return nil, fmt.Errorf("offload: checkpoint header of %d bytes: too large: %w", n, ErrBadCheckpoint)
	}
	// Read what comes rather than make room for the length claimed, which only its checksum vouches
	// for: a short or foreign stream costs the bytes it holds.
	js, err := io.ReadAll(io.LimitReader(r, int64(n)+4))
	if err == nil && len(js) < int(n)+4 {
		err = io.ErrUnexpectedEOF
	}
	if err != nil {
		return nil, fmt.Errorf("offload: checkpoint header truncated: %w: %w", ErrBadCheckpoint, err)
	}
	if got, want := crc32.Checksum(js[:n], castagnoli), binary.LittleEndian.Uint32(js[n:]); got != want {
		return nil, fmt.Errorf("offload: checkpoint header checksum %#x, want %#x: %w", got, want, ErrBadCheckpoint)
	}
	var hdr ckHeader
	if err := json.Unmarshal(js[:n], &hdr); err != nil {
		return nil, fmt.Errorf("offload: checkpoint header: %w: %w", ErrBadCheckpoint, err)
	}
	seen := make(map[string]int, len(hdr.Entries))
	for i, ce := range hdr.Entries {
		if ce.Tag == "" {
			return nil, fmt.Errorf("offload: checkpoint entry %d: empty tag: %w", i, ErrBadCheckpoint)
		}
		if err := ce.check(); err != nil {
			return nil, err
		}
		if j, dup := seen[ce.Tag]; dup {
			return nil, fmt.Errorf("offload: checkpoint entry %d: tag %q is entry %d's too: %w", i, ce.Tag, j, ErrBadCheckpoint)
		}
		seen[ce.Tag] = i
	}
	return &hdr, nil
}

// chunkReader reads a chunk's bytes in pieces, then its checksum, which must match.
type chunkReader struct {
	r   io.Reader
	crc uint32
}

func (c *chunkReader) read(b []byte, what string) error {
	if _, err := io.ReadFull(c.r, b); err != nil {
		return fmt.Errorf("offload: checkpoint truncated in %s: %w: %w", what, ErrBadCheckpoint, err)
	}
	c.crc = crc32.Update(c.crc, castagnoli, b)
	return nil
}

func (c *chunkReader) check(what string) error {
	var sum [4]byte
	if _, err := io.ReadFull(c.r, sum[:]); err != nil {
		return fmt.Errorf("offload: checkpoint truncated in %s: %w: %w", what, ErrBadCheckpoint, err)
	}
	if want := binary.LittleEndian.Uint32(sum[:]); c.crc != want {
		return fmt.Errorf("offload: %s: checksum %#x, want %#x (corrupted): %w", what, c.crc, want, ErrBadCheckpoint)
	}
	return nil
}

// readChunk reads a chunk into dst pieces (slices of pinned memory, in order), reporting each to
// prog, and verifies its checksum; the error names the chunk.
func readChunk(r io.Reader, dst [][]byte, what string, prog *progress) error {
	c := &chunkReader{r: r}
	for _, b := range dst {
		if err := c.read(b, what); err != nil {
			return err
		}
		prog.add(uint64(len(b)))
	}
	return c.check(what)
}

func chunkName(tag string, i int, c ckChunk) string {
	return fmt.Sprintf("%q chunk %d (%s at offset %#x)", tag, i, units.FormatSize(c.Size), c.Offset)
}
