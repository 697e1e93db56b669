package sim

import (
	"time"

	"github.com/cuvmm/cuvmm/driver"
)

// stream is a CUstream. Work queued on it completes before the queuing call returns, so a stream has
// no queue: FIFO order holds trivially.
type stream struct {
	dev   *device
	flags uint32
}

// event is a CUevent: the time of its last record.
type event struct {
	dev      *device
	flags    uint32
	recorded bool
	at       time.Time
}

// freeList holds the values of destroyed streams or events, the last destroyed last, for ReuseHandles;
// the caller holds s.mu.
type freeList []uint64

// keep remembers h, just destroyed, when reuse is on.
func (l *freeList) keep(h uint64, reuse bool) {
	if reuse {
		*l = append(*l, h)
	}
}

// take is the value of the object destroyed last, or a new one.
func (l *freeList) take() uint64 {
	n := len(*l)
	if n == 0 {
		return newHandle()
	}
	h := (*l)[n-1]
	*l = (*l)[:n-1]
	return h
}

// StreamCreate calls cuStreamCreate (flags DEFAULT or NON_BLOCKING).
func (s *Sim) StreamCreate(flags uint32) (driver.Stream, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.begin("cuStreamCreate", ctxBound)
	if err != nil {
		return 0, err
	}
	if flags&^driver.StreamNonBlocking != 0 {
		return 0, driver.ErrorInvalidValue
	}
	h := driver.Stream(s.freedStreams.take())
	s.streams[h] = &stream{dev: d, flags: flags}
	return h, nil
}

// StreamDestroy calls cuStreamDestroy_v2; an unknown stream is CUDA_ERROR_INVALID_HANDLE.
func (s *Sim) StreamDestroy(st driver.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuStreamDestroy", ctxBound); err != nil {
		return err
	}
	if _, ok := s.streams[st]; !ok {
		return driver.ErrorInvalidHandle
	}
	delete(s.streams, st)
	delete(s.graphs.captures, st) // the driver ends an open capture with its stream
	if s.as != nil {
		// DeferWork: the driver finishes a destroyed stream's work; run what can run now (work
		// behind a hold stays queued and runs when an event recorded after it is waited for).
		s.drive(s.as.waits[st])
	}
	if s.as != nil && len(s.as.queue[st]) == 0 {
		delete(s.as.waits, st)
		delete(s.as.holds, st)
	}
	s.streamGone(st)
	return nil
}

// streamGone offers the value of st, destroyed, for reuse (ReuseHandles), unless work queued on it
// still waits to run: the value still names that work's queue here, so it is never given again.
func (s *Sim) streamGone(st driver.Stream) {
	if s.as == nil || len(s.as.queue[st]) == 0 {
		s.freedStreams.keep(uint64(st), s.cfg.reuse)
	}
}

// StreamSynchronize calls cuStreamSynchronize; an unknown stream is CUDA_ERROR_INVALID_HANDLE.
func (s *Sim) StreamSynchronize(st driver.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.begin("cuStreamSynchronize", ctxBound)
	if err != nil {
		return err
	}
	if !s.validStream(st) {
		return driver.ErrorInvalidHandle
	}
	if s.invalidateCapture(st) {
		return driver.ErrorStreamCaptureUnsupported
	}
	if s.legacyDuringCapture("cuStreamSynchronize", &st, d) {
		return driver.ErrorStreamCaptureImplicit
	}
	s.waitFor(func() bool { return s.streamIdle(st) })
	s.syncPoint(d)
	return s.asyncErr()
}

// EventCreate calls cuEventCreate (flags BLOCKING_SYNC, DISABLE_TIMING, INTERPROCESS).
func (s *Sim) EventCreate(flags uint32) (driver.Event, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.begin("cuEventCreate", ctxBound)
	if err != nil {
		return 0, err
	}
	const interprocess = 4 // must come with DISABLE_TIMING, as in the driver
	if flags&^(driver.EventBlockingSync|driver.EventDisableTiming|interprocess) != 0 ||
		(flags&interprocess != 0 && flags&driver.EventDisableTiming == 0) {
		return 0, driver.ErrorInvalidValue
	}
	h := driver.Event(s.freedEvents.take())
	s.events[h] = &event{dev: d, flags: flags}
	s.eventsMade[flags]++
	return h, nil
}

// EventRecord calls cuEventRecord: the event takes the current time (the stream's earlier work is
// already done). Unknown events or streams, and an event and stream of different contexts (the
// legacy and per-thread streams are the current context's), are CUDA_ERROR_INVALID_HANDLE.
func (s *Sim) EventRecord(e driver.Event, st driver.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.begin("cuEventRecord", ctxBound)
	if err != nil {
		return err
	}
	ev, ok := s.events[e]
	if !ok || s.streamDevice(st, d) != ev.dev {
		return driver.ErrorInvalidHandle
	}
	if s.legacyDuringCapture("cuEventRecord", &st, d) {
		return driver.ErrorStreamCaptureImplicit
	}
	ev.recorded = true
	ev.at = time.Now()
	s.recorded(e, st, ev.dev) // completes when st passes this point (async.go)
	return nil
}

// EventSynchronize calls cuEventSynchronize; an unknown event is CUDA_ERROR_INVALID_HANDLE.
func (s *Sim) EventSynchronize(e driver.Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.begin("cuEventSynchronize", ctxBound)
	if err != nil {
		return err
	}
	if _, ok := s.events[e]; !ok {
		return driver.ErrorInvalidHandle
	}
	s.waitFor(func() bool { return s.eventDone(e) })
	s.syncPoint(d)
	return s.asyncErr()
}

// EventElapsedTime calls cuEventElapsedTime: milliseconds between the two records (monotonic clock).
// Unknown or never-recorded events, events made with DISABLE_TIMING, and two events of different
// contexts are CUDA_ERROR_INVALID_HANDLE, as in the driver; while either event's last record has not completed
// (a held stream), CUDA_ERROR_NOT_READY.
func (s *Sim) EventElapsedTime(start, end driver.Event) (float32, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuEventElapsedTime", ctxBound); err != nil {
		return 0, err
	}
	a, ok1 := s.events[start]
	b, ok2 := s.events[end]
	if !ok1 || !ok2 || a.dev != b.dev || !a.recorded || !b.recorded ||
		a.flags&driver.EventDisableTiming != 0 || b.flags&driver.EventDisableTiming != 0 {
		return 0, driver.ErrorInvalidHandle
	}
	if !s.eventDone(start) || !s.eventDone(end) {
		return 0, driver.ErrorNotReady
	}
	return float32(b.at.Sub(a.at).Seconds() * 1000), nil
}

// EventDestroy calls cuEventDestroy_v2; an unknown event is CUDA_ERROR_INVALID_HANDLE.
func (s *Sim) EventDestroy(e driver.Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuEventDestroy", ctxBound); err != nil {
		return err
	}
	if _, ok := s.events[e]; !ok {
		return driver.ErrorInvalidHandle
	}
	delete(s.events, e)
	s.freedEvents.keep(uint64(e), s.cfg.reuse)
	if s.as != nil {
		delete(s.as.events, e)
	}
	return nil
}
