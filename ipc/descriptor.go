package ipc

import (
	"encoding/binary"
	"fmt"
	"unicode/utf8"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
)

// Limits of a Descriptor.
const (
	// MaxChunks is the most chunks a descriptor may list.
	MaxChunks = 16384
	// MaxNameLen is the longest buffer name, in bytes.
	MaxNameLen = 255
	// chunkAlign is what every chunk offset and size must be a multiple of on the wire: the host
	// page. The importing device's granularity (2 MiB on current GPUs) is checked by Open.
	chunkAlign = 4096
)

// Descriptor describes a whole buffer made of chunks: what the receiver needs besides the chunks'
// file descriptors to rebuild the same layout.
type Descriptor struct {
	// Name is the name the buffer is published under (empty when sent directly).
	Name string
	// Size is the mapped capacity in bytes: every chunk lies inside [0, Size).
	Size uint64
	// Len is the exporter's length, the bytes in use (at most Size; a growable buffer's capacity
	// may run past it). Descriptors of version 1 do not carry it: they decode with Len = Size.
	Len uint64
	// Chunks are the buffer's allocations in increasing offset order, not overlapping. The i-th file
	// sent with the descriptor is the i-th chunk's handle.
	Chunks []ChunkDesc
}

// ChunkDesc is one allocation of a buffer.
type ChunkDesc struct {
	// Offset is the chunk's offset from the buffer's first address.
	Offset uint64
	// Size is the allocation's size (a multiple of its granularity).
	Size uint64
	// Location is where the memory lives, as the exporter sees it: a device ordinal or a host NUMA
	// node.
	Location driver.Location
	// HandleType is the type of the handle sent for this chunk. Version 1 sends
	// driver.HandleTypePosixFD, the only type that is a file descriptor.
	HandleType driver.HandleType
}

// Wire format of a descriptor (little-endian), version 2:
//
//	0   4  magic "CVMD"
//	4   2  version (2; version 1 is read too)
//	6   2  flags, zero
//	8   8  size (the mapped capacity)
//	16  4  number of chunks
//	20  2  name length
//	22  2  reserved, zero
//	24  8  length in use (version 2 only: version 1 has no such field, and its length is the size)
//	..  n  name (UTF-8)
//	..  32 per chunk: offset u64, size u64, location type i32, location id i32, handle type i32,
//	        reserved u32 (zero)
const (
	descMagic      uint32 = 'C' | 'V'<<8 | 'M'<<16 | 'D'<<24
	descHeaderSize        = 24
	chunkEntrySize        = 32
	// DescriptorVersion is the descriptor encoding MarshalBinary writes; UnmarshalBinary also reads
	// version 1.
	DescriptorVersion = 2
)

// descHeader is the size of a version's fixed part, before the name.
func descHeader(version uint16) int {
	if version == 1 {
		return descHeaderSize
	}
	return descHeaderSize + 8
}

// validName checks a buffer name: 1 to MaxNameLen bytes of UTF-8 without control characters.
func validName(name string) error {
	if name == "" {
		return fmt.Errorf("%w: empty buffer name", ErrProtocol)
	}
	if len(name) > MaxNameLen {
		return fmt.Errorf("%w: buffer name of %d bytes (limit %d)", ErrTooLarge, len(name), MaxNameLen)
	}
	if !utf8.ValidString(name) {
		return fmt.Errorf("%w: buffer name %q is not UTF-8", ErrProtocol, name)
	}
	for _, r := range name {
		if r < 0x20 || r == 0x7f {
			return fmt.Errorf("%w: buffer name %q has a control character", ErrProtocol, name)
		}
	}
	return nil
}

// Validate checks the descriptor as UnmarshalBinary does: a size above zero, 1 to MaxChunks chunks
// in increasing offset order that do not overlap and lie inside the size, offsets and sizes multiples
// of 4 KiB, device or host-NUMA locations, POSIX FD handles, and a valid name if any.
func (d *Descriptor) Validate() error {
	if d.Name != "" {
		if err := validName(d.Name); err != nil {
			return err
		}
	}
	if d.Size == 0 {
		return fmt.Errorf("%w: descriptor of size 0", ErrProtocol)
	}
	if d.Len > d.Size {
		return fmt.Errorf("%w: length in use %s above the mapped size %s", ErrProtocol, units.FormatSize(d.Len), units.FormatSize(d.Size))
	}
	if len(d.Chunks) == 0 {
		return fmt.Errorf("%w: descriptor without chunks", ErrProtocol)
	}
	if len(d.Chunks) > MaxChunks {
		return fmt.Errorf("%w: %d chunks (limit %d)", ErrTooLarge, len(d.Chunks), MaxChunks)
	}
	var end uint64
	for i, c := range d.Chunks {
		if c.Size == 0 || c.Size%chunkAlign != 0 || c.Offset%chunkAlign != 0 {
			return fmt.Errorf("%w: chunk %d: offset %#x and size %#x must be non-zero multiples of 4 KiB (size may not be 0)", ErrProtocol, i, c.Offset, c.Size)
		}
		if i > 0 && c.Offset < end {
			return fmt.Errorf("%w: chunk %d at offset %#x overlaps or precedes the previous chunk, which ends at %#x", ErrProtocol, i, c.Offset, end)
		}
		if c.Offset > d.Size || c.Size > d.Size-c.Offset {
			return fmt.Errorf("%w: chunk %d (%s at offset %#x) runs past the buffer's size %s", ErrProtocol, i, units.FormatSize(c.Size), c.Offset, units.FormatSize(d.Size))
		}
		end = c.Offset + c.Size
		switch c.Location.Type {
		case driver.LocationDevice, driver.LocationHostNUMA:
			if c.Location.ID < 0 {
				return fmt.Errorf("%w: chunk %d: location %s has a negative id", ErrProtocol, i, c.Location)
			}
		default:
			return fmt.Errorf("%w: chunk %d: location %s is neither a device nor a host NUMA node", ErrProtocol, i, c.Location)
		}
		if c.HandleType != driver.HandleTypePosixFD {
			return fmt.Errorf("%w: chunk %d: handle type %s (version %d sends posix-fd handles)", ErrProtocol, i, c.HandleType, Version)
		}
	}
	return nil
}

// MarshalBinary encodes the descriptor (version 2) after validating it.
func (d *Descriptor) MarshalBinary() ([]byte, error) {
	if err := d.Validate(); err != nil {
		return nil, fmt.Errorf("ipc: encode descriptor: %w", err)
	}
	hs := descHeader(DescriptorVersion)
	b := make([]byte, hs+len(d.Name)+chunkEntrySize*len(d.Chunks))
	binary.LittleEndian.PutUint32(b[0:], descMagic)
	binary.LittleEndian.PutUint16(b[4:], DescriptorVersion)
	binary.LittleEndian.PutUint64(b[8:], d.Size)
	binary.LittleEndian.PutUint32(b[16:], uint32(len(d.Chunks)))
	binary.LittleEndian.PutUint16(b[20:], uint16(len(d.Name)))
	binary.LittleEndian.PutUint64(b[24:], d.Len)
	copy(b[hs:], d.Name)
	p := b[hs+len(d.Name):]
	for _, c := range d.Chunks {
		binary.LittleEndian.PutUint64(p[0:], c.Offset)
		binary.LittleEndian.PutUint64(p[8:], c.Size)
		binary.LittleEndian.PutUint32(p[16:], uint32(c.Location.Type))
		binary.LittleEndian.PutUint32(p[20:], uint32(c.Location.ID))
		binary.LittleEndian.PutUint32(p[24:], uint32(c.HandleType))
		p = p[chunkEntrySize:]
	}
	return b, nil
}

// UnmarshalBinary decodes a descriptor of version 1 or 2 strictly: the magic, zero flags and
// reserved fields, the exact length for the chunk count, and everything Validate checks. A version 1
// descriptor's Len is its Size. On error d is left unchanged.
func (d *Descriptor) UnmarshalBinary(b []byte) error {
	if len(b) < descHeaderSize {
		return fmt.Errorf("ipc: decode descriptor: %d bytes, shorter than its %d-byte header: %w", len(b), descHeaderSize, ErrProtocol)
	}
	if m := binary.LittleEndian.Uint32(b[0:]); m != descMagic {
		return fmt.Errorf("ipc: decode descriptor: magic %#08x, want %#08x \"CVMD\": %w", m, descMagic, ErrProtocol)
	}
	v := binary.LittleEndian.Uint16(b[4:])
	if v != 1 && v != DescriptorVersion {
		return fmt.Errorf("ipc: decode descriptor: version %d, this side reads versions 1 and %d: %w", v, DescriptorVersion, ErrProtocol)
	}
	if f := binary.LittleEndian.Uint16(b[6:]); f != 0 {
		return fmt.Errorf("ipc: decode descriptor: unknown flags %#x: %w", f, ErrProtocol)
	}
	if r := binary.LittleEndian.Uint16(b[22:]); r != 0 {
		return fmt.Errorf("ipc: decode descriptor: reserved field %#x, want 0: %w", r, ErrProtocol)
	}
	hs := descHeader(v)
	size := binary.LittleEndian.Uint64(b[8:])
	n := binary.LittleEndian.Uint32(b[16:])
	nameLen := int(binary.LittleEndian.Uint16(b[20:]))
	if n > MaxChunks {
		return fmt.Errorf("ipc: decode descriptor: %d chunks (limit %d): %w", n, MaxChunks, ErrTooLarge)
	}
	if nameLen > MaxNameLen {
		return fmt.Errorf("ipc: decode descriptor: name of %d bytes (limit %d): %w", nameLen, MaxNameLen, ErrTooLarge)
	}
	if want := hs + nameLen + chunkEntrySize*int(n); len(b) != want {
		return fmt.Errorf("ipc: decode descriptor: %d bytes, want %d for a version %d descriptor of %d chunks and a %d-byte name: %w", len(b), want, v, n, nameLen, ErrProtocol)
	}
	out := Descriptor{Size: size, Len: size, Name: string(b[hs : hs+nameLen]), Chunks: make([]ChunkDesc, n)}
	if v >= 2 {
		out.Len = binary.LittleEndian.Uint64(b[24:])
	}
	if err := decodeChunks(b[hs+nameLen:], out.Chunks); err != nil {
		return err
	}
	if nameLen > 0 {
		if err := validName(out.Name); err != nil {
			return fmt.Errorf("ipc: decode descriptor: %w", err)
		}
	}
	if err := out.Validate(); err != nil {
		return fmt.Errorf("ipc: decode descriptor: %w", err)
	}
	*d = out
	return nil
}

// decodeChunks decodes the chunk table p into out.
func decodeChunks(p []byte, out []ChunkDesc) error {
	for i := range out {
		if r := binary.LittleEndian.Uint32(p[28:]); r != 0 {
			return fmt.Errorf("ipc: decode descriptor: chunk %d: reserved field %#x, want 0: %w", i, r, ErrProtocol)
		}
		out[i] = ChunkDesc{
			Offset: binary.LittleEndian.Uint64(p[0:]),
			Size:   binary.LittleEndian.Uint64(p[8:]),
			Location: driver.Location{
				Type: driver.LocationType(int32(binary.LittleEndian.Uint32(p[16:]))),
				ID:   int32(binary.LittleEndian.Uint32(p[20:])),
			},
			HandleType: driver.HandleType(int32(binary.LittleEndian.Uint32(p[24:]))),
		}
		p = p[chunkEntrySize:]
	}
	return nil
}

func (d Descriptor) String() string {
	name := d.Name
	if name == "" {
		name = "(unnamed)"
	}
	return fmt.Sprintf("buffer %s of %s in %d chunks", name, units.FormatSize(d.Size), len(d.Chunks))
}
