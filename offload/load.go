package offload

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/vmm"
)

// Load recreates the buffers of a checkpoint written by Save, in this process: for each buffer a
// reservation at the saved address when the driver grants it (else elsewhere: Restored.Moved), and
// one chunk per saved chunk with the same properties, device and access, filled with the saved bytes
// after checking each checksum. It returns a set holding them (Keep and Discard as saved; File
// buffers come back as Keep, since the file is the checkpoint) and the buffers, which the caller
// closes after the set. Options.Progress is called as the bytes reach the GPU. On any error, a
// truncated or corrupted checkpoint included, everything made is released: nothing is left mapped,
// and what fails to be freed is handed to sys, which frees it in its Close (vmm.UndoClose). The one
// exception is a buffer that a copy may still be writing when the copy stream could not be drained
// (and the device not synchronized): it stays mapped, handed to sys, whose RetryOrphans and Close
// synchronize the device first, then free it.
func Load(ctx context.Context, sys *vmm.System, r io.Reader, opts Options) (*Set, []*Restored, error) {
	if sys == nil {
		return nil, nil, fmt.Errorf("offload: load: nil system: %w", ErrInvalidValue)
	}
	hdr, err := readHeader(r)
	if err != nil {
		return nil, nil, err
	}
	policies := make([]Policy, len(hdr.Entries)) // checked before anything is made
	for i, ce := range hdr.Entries {
		if policies[i], err = loadPolicy(ce); err != nil {
			return nil, nil, err
		}
	}
	set := NewSet(sys, opts)
	var bufs []*Restored
	fail := func(err error) (*Set, []*Restored, error) {
		errs := []error{err, set.Close()}
		for _, b := range bufs {
			errs = append(errs, b.undo())
		}
		return nil, nil, errors.Join(errs...)
	}
	prog := &progress{fn: set.opts.Progress}
	for _, ce := range hdr.Entries {
		prog.total += ce.size()
	}
	for i, ce := range hdr.Entries {
		b, err := reserve(sys, ce)
		if err != nil {
			return fail(err)
		}
		if err := set.fill(ctx, r, ce, b, prog); err != nil {
			if errors.Is(err, errNotDrained) {
				// A copy into b may still be queued: unmapping it now would leave the copy writing
				// to freed addresses. The System frees it once its devices are idle.
				return fail(errors.Join(err, keepBusy(sys, b)))
			}
			bufs = append(bufs, b)
			return fail(err)
		}
		bufs = append(bufs, b)
		if err := set.Add(ce.Tag, b, policies[i], EntryOptions{}); err != nil {
			return fail(err)
		}
	}
	return set, bufs, nil
}

// keepBusy hands b, which copies queued on its devices may still write into (the device could not
// be synchronized: see drainOrHold), to sys, whose RetryOrphans and Close synchronize those
// devices, then close b (unmap, release, address free; a step that fails is retried the next
// time); the error says so.
func keepBusy(sys *vmm.System, b *Restored) error {
	var devs []*vmm.Device
	for _, c := range b.Chunks() {
		if d := c.Allocation.Device(); !slices.Contains(devs, d) {
			devs = append(devs, d)
		}
	}
	idle := func() error {
		for _, d := range devs {
			if err := d.Synchronize(); err != nil {
				return err
			}
		}
		return nil
	}
	return sys.Keep(fmt.Sprintf("offload: restored buffer %q that copies queued on its devices may still write", b.tag), func() error {
		if err := idle(); err != nil {
			return err
		}
		return b.Close()
	})
}

// loadPolicy is the policy Load gives a saved entry (File becomes Keep).
func loadPolicy(ce ckEntry) (Policy, error) {
	policy, err := ParsePolicy(ce.Policy)
	if err != nil {
		return 0, fmt.Errorf("offload: checkpoint entry %q: %w: %w", ce.Tag, ErrBadCheckpoint, err)
	}
	if policy == File {
		policy = Keep
	}
	return policy, nil
}

// reserve reserves the entry's range, at its saved address when granted. fill maps the chunks as
// their bytes come, so that a checkpoint whose header claims more than its bytes hold fails at the
// first missing chunk, not after mapping every chunk it claims. The entry's layout was checked by
// readHeader.
func reserve(sys *vmm.System, ce ckEntry) (*Restored, error) {
	res, err := sys.Reserve(ce.end(), vmm.ReserveOptions{Hint: driver.DevicePtr(ce.Ptr)})
	if err != nil {
		return nil, fmt.Errorf("offload: load %q: %w", ce.Tag, err)
	}
	res.SetKind("checkpoint")
	return &Restored{tag: ce.Tag, res: res, len: ce.Len, moved: res.Ptr() != driver.DevicePtr(ce.Ptr)}, nil
}

// mapChunk maps chunk i of the entry into b with its saved properties, device and access.
func mapChunk(sys *vmm.System, ce ckEntry, i int, b *Restored) (*vmm.Allocation, error) {
	c := ce.Chunks[i]
	d, err := sys.Device(c.Device)
	if err != nil {
		return nil, fmt.Errorf("offload: load %s: %w", chunkName(ce.Tag, i, c), err)
	}
	m, err := b.res.MapNew(c.Offset, c.Size, d, c.allocOptions(), c.access()...)
	if err != nil {
		return nil, fmt.Errorf("offload: load %s: %w", chunkName(ce.Tag, i, c), err)
	}
	b.maps = append(b.maps, m)
	return m.Allocation(), nil
}

// fill maps an entry's chunks into b one at a time and streams each one's bytes from r through one
// staging slot, checking each checksum.
func (s *Set) fill(ctx context.Context, r io.Reader, ce ckEntry, b *Restored, prog *progress) error {
	var largest uint64 // one staging size for the entry, so that its chunks reuse one slot
	for _, c := range ce.Chunks {
		largest = max(largest, c.Size)
	}
	for i, c := range ce.Chunks {
		a, err := mapChunk(s.sys, ce, i, b)
		if err != nil {
			return err
		}
		err = s.withStaging(ctx, a.Device(), largest, func(stage *slot) error {
			return s.fillChunk(r, ce.Tag, i, c, b.Ptr()+driver.DevicePtr(c.Offset), a.Device(), stage, prog)
		})
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	}
	return nil
}

func (s *Set) fillChunk(r io.Reader, tag string, i int, c ckChunk, ptr driver.DevicePtr, d *vmm.Device, stage *slot, prog *progress) error {
	st, err := s.stream(d)
	if err != nil {
		return err
	}
	// Read and check the whole chunk piece by piece; a piece is copied to the device before the next
	// is read into the same slot, and a bad checksum at the end fails the load (the new buffers are
	// released, so a bad chunk never stays mapped).
	crcReader := &chunkReader{r: r}
	for off := uint64(0); off < c.Size; off += stage.size {
		n := min(stage.size, c.Size-off)
		if err := crcReader.read(stage.mem[:n], chunkName(tag, i, c)); err != nil {
			return err
		}
		if err := s.copyWait(ptr+driver.DevicePtr(off), stage.ptr(0), n, st, stage); err != nil {
			return fmt.Errorf("offload: load %s: %w", chunkName(tag, i, c), err)
		}
		prog.add(n)
	}
	return crcReader.check(chunkName(tag, i, c))
}
