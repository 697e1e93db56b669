package offload

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/cuvmm/cuvmm/vmm"
)

// Stats is a snapshot of a set as its last call left it: its buffers, the pinned host memory it
// holds, and what its sleeps and wakes have done. Package metrics exports it (metrics.NewSet).
type Stats struct {
	Buffers     []BufferStats // in the order added
	AsleepBytes uint64        // GPU memory of the sleeping buffers, given back to the driver
	// BackupBytes is the pinned host memory the set holds: the backups of sleeping Keep buffers and
	// PooledBytes, the slots pooled for the next sleep or wake (TrimPool gives those back).
	BackupBytes uint64
	PooledBytes uint64
	// Sleeps and Wakes count the calls that slept or woke at least one buffer; a call with nothing to
	// do counts as neither. SleepFailures and WakeFailures count the calls that returned an error.
	Sleeps, Wakes               uint64
	SleepFailures, WakeFailures uint64
	// SleptBytes and WokenBytes are the GPU memory the successful calls gave back and got again.
	SleptBytes, WokenBytes uint64
	// SleepTime and WakeTime sum the time of every counted call, failed ones included; LastSleep
	// and LastWake are the last successful call's.
	SleepTime, WakeTime time.Duration
	LastSleep, LastWake time.Duration
	// LastSleepSteps is how the last successful Sleep spent LastSleep, step by step.
	LastSleepSteps SleepSteps
}

// SleepSteps is how a Sleep spent its time, step by step.
type SleepSteps struct {
	// Wait is checking the buffers and waiting for the work queued on them (not Set.Prepare, which
	// pins a backup ahead of a sleep).
	Wait time.Duration
	// Copy is copying their content out (backups, the file), every device at once, and releasing
	// each Keep chunk as soon as its copy is done.
	Copy time.Duration
	// Release is unmapping and releasing the rest of their GPU memory (Discard and File chunks),
	// one chunk after the other, once every copy is done.
	Release time.Duration
	// StagedBytes is the GPU memory of the Keep buffers whose backup this Sleep staged
	// (FirstSleepStage): their backup was still being registered, in the background, when Sleep
	// returned.
	StagedBytes uint64
}

// BufferStats is one buffer of a set: its GPU memory (the bytes of its chunks) and whether it sleeps.
type BufferStats struct {
	Tag    string
	Policy Policy
	Bytes  uint64
	Asleep bool
}

// setStats is what Stats returns, kept apart from the set's lock so that asking never waits for a
// Sleep or Wake in progress.
type setStats struct {
	mu sync.Mutex
	st Stats
}

// Stats returns the set's statistics as its last call left them, without waiting for one in
// progress (a zero Stats for a nil set).
func (s *Set) Stats() Stats {
	if s == nil {
		return Stats{}
	}
	s.stats.mu.Lock()
	defer s.stats.mu.Unlock()
	st := s.stats.st
	st.Buffers = slices.Clone(st.Buffers)
	return st
}

// publish records the buffers and the pinned memory for Stats (none once the set is closed); the
// caller holds s.mu.
func (s *Set) publish() {
	var bufs []BufferStats
	var asleep, backup uint64
	entries := s.entries
	if s.own.IsClosed() {
		entries = nil
	}
	for _, e := range entries {
		b := BufferStats{Tag: e.tag, Policy: e.policy, Asleep: e.asleep}
		if e.asleep {
			for _, cs := range e.chunks {
				b.Bytes += cs.size
				if !cs.live { // a live chunk's memory was never given back
					asleep += cs.size
				}
			}
		} else {
			b.Bytes = mappedBytes(e.buf)
		}
		for _, sl := range e.backup {
			backup += sl.size
		}
		bufs = append(bufs, b)
	}
	pooled, held := s.pool.bytes(), s.pool.heldBytes() // held: kept out of the pool until a device synchronizes
	s.stats.mu.Lock()
	defer s.stats.mu.Unlock()
	s.stats.st.Buffers, s.stats.st.AsleepBytes = bufs, asleep
	s.stats.st.BackupBytes, s.stats.st.PooledBytes = backup+pooled+held, pooled
}

// counted runs call (s.sleep, or s.wake when wake is set) under the set's lock, counts it for
// Stats and publishes the set's state as the call left it.
func (s *Set) counted(ctx context.Context, tags []string, wake bool, call func(context.Context, []string) (uint64, error)) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.publish()
	start := time.Now()
	n, err := call(ctx, tags)
	s.count(wake, start, n, err)
	return err
}

// count records a Sleep (wake false) or Wake that began at start and moved n bytes of GPU memory or
// failed with err; a call that did nothing (n 0, no error) is not counted.
func (s *Set) count(wake bool, start time.Time, n uint64, err error) {
	if n == 0 && err == nil {
		return
	}
	took := time.Since(start)
	s.stats.mu.Lock()
	defer s.stats.mu.Unlock()
	st := &s.stats.st
	calls, failures, bytes, total, last := &st.Sleeps, &st.SleepFailures, &st.SleptBytes, &st.SleepTime, &st.LastSleep
	if wake {
		calls, failures, bytes, total, last = &st.Wakes, &st.WakeFailures, &st.WokenBytes, &st.WakeTime, &st.LastWake
	}
	*total += took
	if err != nil {
		*failures++
		return
	}
	*calls++
	*bytes += n
	*last = took
	if !wake {
		st.LastSleepSteps = s.steps
	}
}

// mappedBytes is the size of buf's chunks, skipping any without an allocation (which Sleep refuses).
func mappedBytes(buf vmm.Chunked) uint64 {
	var n uint64
	for _, c := range buf.Chunks() {
		if c.Allocation != nil {
			n += c.Allocation.Size()
		}
	}
	return n
}
