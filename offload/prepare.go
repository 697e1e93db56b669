package offload

import (
	"context"
	"fmt"

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
	s.reap()
	es, err := s.selectEntries("prepare", tags)
	if err != nil {
		return err
	}
	need := map[slotKey]int{}
	for _, e := range es {
		if e.asleep || e.policy != Keep {
			continue
		}
		perDev := map[*vmm.Device]uint64{}
		for _, c := range e.buf.Chunks() {
			perDev[c.Allocation.Device()] += c.Allocation.Size()
		}
		for d, bytes := range perDev {
			size := min(s.opts.SlotSize, (bytes+hugePage-1)/hugePage*hugePage)
			need[slotKey{d, size}] += int((bytes + size - 1) / size)
		}
	}
	for k, n := range need {
		if err := s.pool.fill(ctx, k.dev, k.size, n); err != nil {
			return fmt.Errorf("offload: prepare: %w", err)
		}
	}
	return nil
}

type slotKey struct {
	dev  *vmm.Device
	size uint64
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
