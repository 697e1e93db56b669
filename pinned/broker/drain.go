package broker

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/cuvmm/cuvmm/vmm"
)

// A copy whose queuing or wait failed may still be queued on its stream: handing the stream to the
// next request would give that request the copy's error (another worker's, maybe), and releasing the
// buffer would let an unregister unmap it under the copy engine. So the stream is drained first, and
// a stream that cannot be drained is retired: it leaves the lane (a new stream takes its place) and
// keeps a use of the buffer, and the copy's place in the copy gates, until one of its
// synchronizations succeeds or the server closes: an end of the connection or Server.Close waits
// for it as for any copy queued on a stream.

// The first and the longest pause between a retired stream's synchronizations.
const (
	retireFirstRetry = time.Millisecond
	retireMaxRetry   = time.Second
)

// drain synchronizes the stream, up to vmm.DrainAttempts times, until every copy queued on it is
// complete. Its error wraps vmm.ErrNotDrained: a stream that drained on a later attempt is fine.
func (c *copyStream) drain() error {
	if err := c.st.Drain(vmm.DrainAttempts); errors.Is(err, vmm.ErrNotDrained) {
		return err
	}
	return nil
}

// settle gives back the stream and the buffer of a copy that failed and ends the copy's place in
// the gates (end), once the stream is drained. When it cannot be drained, it retires the stream
// (retire keeps the buffer in use and calls end once it gives the stream up) and says so.
func (s *Server) settle(b *regBuffer, cs *copyStream, end func()) error {
	err := cs.drain()
	if err == nil {
		b.giveBack(cs)
		end()
		return nil
	}
	replaced := s.replaceStream(b)
	go s.retire(b, cs, replaced, end)
	return fmt.Errorf("its stream could not be drained and is retired, the buffer held until it drains: %w", err)
}

// replaceStream puts a new stream into the lane of b in place of a retired one. It reports whether
// it could; if not, the retired stream comes back to the lane once drained.
func (s *Server) replaceStream(b *regBuffer) bool {
	l := b.lane
	c, err := newCopyStream(l.dev)
	if err != nil {
		s.logf("broker: %s: replacing a copy stream of %s that could not be drained: %v (the lane has one stream fewer until it drains)", s.path, l.dev, err)
		return false
	}
	s.own.Lock()
	l.streams = append(l.streams, c)
	s.own.Unlock()
	l.free <- c // the retired stream's slot
	return true
}

// retire synchronizes a stream that could not be drained, with growing pauses, until it drains or
// the server closes; then it gives the stream up, lets go of the buffer and ends the copy's place in
// the gates (end). A stream still not drained when the server closes marks the buffer stuck:
// release keeps it mapped (see keepStuck).
func (s *Server) retire(b *regBuffer, cs *copyStream, replaced bool, end func()) {
	defer end()
	defer b.users.Done()
	for pause := retireFirstRetry; ; pause = min(2*pause, retireMaxRetry) {
		closing := false
		select {
		case <-s.quit:
			closing = true
		case <-time.After(pause):
		}
		if err := cs.st.Synchronize(); err == nil {
			s.dropRetired(b.lane, cs, replaced)
			return
		} else if closing {
			b.stuck.Store(true)
			s.logf("broker: %s: a copy stream of %s still cannot be drained at close: %v", s.path, b.lane.dev, err)
			if !replaced {
				// No stream took its place: a copy waiting on the lane must not wait forever (it
				// fails on this stream, and closeLanes destroys it).
				b.lane.free <- cs
			}
			return
		}
	}
}

// dropRetired disposes of a retired stream that drained: back to the lane when no new stream took
// its place, else destroyed (a stream whose destroy fails stays for closeLanes).
func (s *Server) dropRetired(l *lane, cs *copyStream, replaced bool) {
	if !replaced {
		l.free <- cs
		return
	}
	if err := cs.close(); err != nil {
		s.logf("broker: %s: destroying a retired copy stream: %v (retried at Close)", s.path, err)
		return
	}
	s.own.Lock()
	l.streams = slices.DeleteFunc(l.streams, func(c *copyStream) bool { return c == cs })
	s.own.Unlock()
}

// keepStuck hands a buffer that a copy may still target to the System instead of unmapping it: the
// System frees it (System.RetryOrphans, System.Close) after a device synchronization succeeds.
func (w *worker) keepStuck(b *regBuffer) error {
	dev := b.buf.Device()
	kept := dev.System().Keep(fmt.Sprintf("broker buffer %d of worker pid %d (%s), a copy may be queued into it", b.id, w.cred.Pid, b.buf),
		func() error {
			if err := dev.Synchronize(); err != nil {
				return err
			}
			return b.buf.Close()
		})
	return fmt.Errorf("broker: buffer %d kept mapped: a copy into it may still be queued on a stream that could not be drained (%v): %w",
		b.id, kept, ErrInternal)
}
