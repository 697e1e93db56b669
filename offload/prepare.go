package offload

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"github.com/cuvmm/cuvmm/vmm"
)

// Prepare pins, ahead of time, the backup slots that a Sleep of the Keep buffers tagged tags (every
// buffer when none is given) would need, and keeps them in the set's pool: the first Sleep is then as
// fast as a warm one. A service that knows it will sleep calls it at start, while nothing waits (on
// a host whose memory is slow to hand out the first time, that is where the time goes). Slots
// already pooled count; buffers asleep need none. TrimPool gives the slots back.
func (s *Set) Prepare(ctx context.Context, tags ...string) error {
	if s == nil {
		return fmt.Errorf("offload: prepare: nil set: %w", ErrInvalidValue)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.publish()
	s.catchUp()
	es, err := s.selectEntries("prepare", tags)
	if err != nil {
		return err
	}
	need, err := s.slotsNeeded(es)
	if err != nil {
		return err
	}
	for _, sz := range need {
		// The pool is shared by size (backup slots are pinned for every device), so each device's
		// slots come on top of the ones before it; each device pins its own, on its own node.
		total := 0
		for _, dn := range sz.devs {
			total += dn.n
			if err := s.pool.fill(ctx, dn.dev, sz.size, total); err != nil {
				return fmt.Errorf("offload: prepare: %w", err)
			}
		}
	}
	return nil
}

// sizeNeed is how many slots of one size a Sleep of some entries takes, device by device.
type sizeNeed struct {
	size uint64
	devs []devNeed
}

type devNeed struct {
	dev *vmm.Device
	n   int
}

// slotsNeeded counts the backup slots a Sleep of the awake Keep entries of es takes, by slot size
// and device, in a fixed order.
func (s *Set) slotsNeeded(es []*entry) ([]sizeNeed, error) {
	counts := map[uint64]map[*vmm.Device]int{}
	for _, e := range es {
		if e.asleep || e.policy != Keep {
			continue
		}
		perDev, err := bytesPerDevice(e, "prepare")
		if err != nil {
			return nil, err
		}
		for d, bytes := range perDev {
			size := unitSlotSize(s.opts.SlotSize, bytes)
			if counts[size] == nil {
				counts[size] = map[*vmm.Device]int{}
			}
			counts[size][d] += int((bytes + size - 1) / size)
		}
	}
	var out []sizeNeed
	for size, devs := range counts {
		sn := sizeNeed{size: size}
		for d, n := range devs {
			sn.devs = append(sn.devs, devNeed{d, n})
		}
		slices.SortFunc(sn.devs, func(a, b devNeed) int { return a.dev.Ordinal() - b.dev.Ordinal() })
		out = append(out, sn)
	}
	slices.SortFunc(out, func(a, b sizeNeed) int { return cmp.Compare(a.size, b.size) })
	return out, nil
}

// bytesPerDevice is how many bytes of e's buffer live on each device; a chunk without an allocation
// is refused.
func bytesPerDevice(e *entry, op string) (map[*vmm.Device]uint64, error) {
	perDev := map[*vmm.Device]uint64{}
	for i, c := range e.buf.Chunks() {
		if c.Allocation == nil {
			return nil, fmt.Errorf("offload: %s %s: chunk %d has no allocation: %w", op, e, i, ErrInvalidValue)
		}
		perDev[c.Allocation.Device()] += c.Allocation.Size()
	}
	return perDev, nil
}

// pruneSlotSizes frees the pooled slots of sizes that no buffer of the set uses now (a buffer that
// grew or shrank between sleeps left slots of its old size, which no later Sleep would take).
func (s *Set) pruneSlotSizes() {
	keep := map[uint64]bool{s.opts.SlotSize: true}
	for _, e := range s.entries {
		perDev, err := bytesPerDevice(e, "prune")
		if err != nil {
			return // keep everything; the next Sleep reports the buffer
		}
		for _, bytes := range perDev {
			keep[unitSlotSize(s.opts.SlotSize, bytes)] = true
		}
	}
	s.pool.keepSizes(keep)
}

// fill pins slots of size until the pool holds n of them (pinned through dev).
func (p *hostPool) fill(ctx context.Context, dev *vmm.Device, size uint64, n int) error {
	p.mu.Lock()
	have := len(p.idle[size])
	p.mu.Unlock()
	if have >= n {
		return nil
	}
	f := p.feed(ctx, dev, n, size) // takes the pooled ones first
	defer f.finish()
	var got []*slot
	for i := 0; i < n; i++ {
		sl, err := f.take()
		if err != nil {
			p.put(got...)
			return err
		}
		got = append(got, sl)
	}
	p.put(got...)
	return nil
}
