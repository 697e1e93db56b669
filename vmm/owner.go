package vmm

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
)

// owner is the close-once state of the simple owning types (streams, events, plain and host buffers,
// host registrations): one driver object freed by one call, counted as a child of its device.
type owner struct {
	dev *Device
	own lifetime.Owner
}

// Device is the device the object belongs to.
func (o *owner) Device() *Device { return o.dev }

func (o *owner) lifetimeOwner() *lifetime.Owner { return &o.own }

// begin counts a call that passes the object's handle to the driver, until end is called; once the
// owner is closed, or while its Close waits for the calls in progress, it fails with ErrClosed,
// naming op. Close frees the object only after every such call has ended, so that the handle is
// neither destroyed during the call nor, by then, the driver's name for an object made since. It
// holds no lock in between: calls on one object still run concurrently.
func (o *owner) begin(op string) (end func(), err error) {
	if !o.own.Begin() {
		return nil, fmt.Errorf("vmm: %s: %w", op, ErrClosed)
	}
	return o.own.End, nil
}

// close frees the object with free (run with the device's context bound) the first time it succeeds;
// what names the object in the error. A failed free leaves the owner open so Close can be retried.
func (o *owner) close(what string, free func(api driver.API) error) error {
	return o.own.Close("vmm: device "+fmt.Sprint(o.dev.ordinal)+": free "+what, func() error {
		if err := o.dev.do(free); err != nil {
			return fmt.Errorf("vmm: device %d: free %s: %w", o.dev.ordinal, what, err)
		}
		return nil
	})
}

// create runs fn with the device's context bound and, when it succeeds, counts o (of kind) as the
// device's child before the context is let go, so that System.Close, which waits for calls in flight,
// never misses an object being made.
func (d *Device) create(o *lifetime.Owner, kind string, fn func(api driver.API) error) error {
	return d.do(func(api driver.API) error {
		if err := fn(api); err != nil {
			return err
		}
		o.Init(&d.own, kind)
		return nil
	})
}

// adoptee is an object whose clean-up failed during an undo: the System keeps it and retries its
// Close in System.Close, so that no failure leaves an object no API can free.
type adoptee struct {
	what    string
	own     *lifetime.Owner // nil when unknown
	close   func() error
	lo, hi  driver.DevicePtr // the addresses it holds, for a reservation (else empty)
	mapping *Mapping         // the mapping itself, for a mapping (else nil)
}

func (a adoptee) done() bool { return a.own != nil && a.own.IsClosed() }

// adopt hands an object whose clean-up failed to the System. what names it; close is its idempotent
// Close. The returned error names it for the caller's error message.
func (s *System) adopt(what string, own *lifetime.Owner, close func() error) error {
	return s.keepAdoptee(adoptee{what: what, own: own, close: close})
}

// adoptReservation hands the System a reservation whose free failed, remembering its addresses so
// that a Reserve hinted there retries it first (retryIn).
func (s *System) adoptReservation(r *Reservation) error {
	return s.keepAdoptee(adoptee{what: r.String(), own: &r.own, close: r.Close, lo: r.ptr, hi: r.End()})
}

// adoptMapping hands the System a mapping that a failed undo could not close, remembering it so that
// a release of its allocation retries it first (RetryOrphansMapping), wherever its range is.
func (s *System) adoptMapping(m *Mapping) error {
	m.orphan.Store(true)
	return s.keepAdoptee(adoptee{what: m.String(), own: &m.own, close: m.Close, mapping: m})
}

func (s *System) keepAdoptee(a adoptee) error {
	s.adoptMu.Lock()
	s.adopted = append(s.adopted, a)
	s.adoptMu.Unlock()
	return fmt.Errorf("vmm: %s is kept by the System, and its Close retries freeing it", a.what)
}

// adoptedNow copies the list of adopted objects. Whether one is closed is asked of its own lock,
// which an object's method may hold while it hands the System something (keepOrphan), so it is
// asked of the copy, never under s.adoptMu.
func (s *System) adoptedNow() []adoptee {
	s.adoptMu.Lock()
	defer s.adoptMu.Unlock()
	return slices.Clone(s.adopted)
}

// adoptedWhere lists the adopted objects not yet closed that match.
func (s *System) adoptedWhere(match func(adoptee) bool) []adoptee {
	var out []adoptee
	for _, a := range s.adoptedNow() {
		if !a.done() && match(a) {
			out = append(out, a)
		}
	}
	return out
}

// retryIn retries freeing the adopted reservations that hold addresses in [lo, hi): one left there
// by a failed undo is in the way of a Reserve hinted at lo (a buffer growing in place, say), or
// maps an allocation its owner is about to release (RetryOrphansMapping). Those still failing stay
// adopted; their errors are returned.
func (s *System) retryIn(lo, hi driver.DevicePtr) error {
	var errs []error
	for _, a := range s.adoptedWhere(func(a adoptee) bool { return a.lo < hi && lo < a.hi }) {
		errs = append(errs, a.close())
	}
	return errors.Join(errs...)
}

// retryMappingsOf retries closing the adopted mappings of a that a failed undo left in ranges the
// System does not keep, ranges still in use (a kept range's own Close, in retryIn, retries those in
// it). Each is closed without first retrying what blocks its own release, as Mapping.Close would:
// that is a's release, the caller's, and an orphan owning a would come back here. Those still
// failing stay adopted; their errors are returned.
func (s *System) retryMappingsOf(a *Allocation) error {
	list := s.adoptedNow()
	var errs []error
	for _, o := range list {
		if o.mapping != nil && o.mapping.alloc == a && !o.done() && !keeps(list, &o.mapping.res.own) {
			errs = append(errs, o.mapping.closeWithoutUnblock())
		}
	}
	return errors.Join(errs...)
}

// keeps reports whether the object own belongs to is in list and not yet closed.
func keeps(list []adoptee, own *lifetime.Owner) bool {
	return slices.ContainsFunc(list, func(a adoptee) bool { return a.own == own && !a.done() })
}

// RetryOrphansMapping retries closing the orphaned mappings of a and freeing the orphaned
// reservations in which a is still mapped (see Orphans): a failed undo that could not unmap a, from
// a new range or from one still in use, keeps a from being released until that mapping goes.
// Allocation.Close, Mapping.Close and Reservation.UnmapRange of a mapping that owns a, and
// Reservation.Close for the mappings whose release it retries, call it before they release a, so
// owners need not; it remains for a caller that wants the errors of those
// that still fail, which it returns. The caller holds no reservation's lock: the retries take them.
func (s *System) RetryOrphansMapping(a *Allocation) error {
	if s == nil || a == nil {
		return nil
	}
	// The ranges first: freeing one closes the orphans in it, which a retry of those alone would
	// leave in a range no longer found through a's mappings.
	var errs []error
	for _, p := range a.mappings.snapshot() {
		errs = append(errs, s.retryIn(p, p+driver.DevicePtr(a.size)))
	}
	errs = append(errs, s.retryMappingsOf(a))
	return errors.Join(errs...)
}

// retryAdopted closes the adopted objects, pass after pass while a pass frees something (a mapping
// must go before its reservation), and keeps those that still fail. The closes run without the
// list's lock, so that one may hand the System something new.
func (s *System) retryAdopted() error {
	s.adoptMu.Lock()
	list := s.adopted
	s.adopted = nil
	s.adoptMu.Unlock()
	var errs []error
	for progress := true; progress && len(list) > 0; {
		progress = false
		errs = errs[:0]
		left := list[:0]
		for _, a := range list {
			if err := a.close(); err != nil {
				errs = append(errs, err)
				left = append(left, a)
				continue
			}
			progress = true
		}
		clear(list[len(left):])
		list = left
	}
	s.adoptMu.Lock()
	s.adopted = append(list, s.adopted...)
	s.adoptMu.Unlock()
	return errors.Join(errs...)
}

// Keep hands the System an object of another package whose clean-up failed while a failed operation
// was being undone, so that no API loses it: close (idempotent) is retried by RetryOrphans and Close,
// and what names it in Orphans until close succeeds. The returned error says so, for the caller's
// error message. A closed System retries nothing: there close is tried once, at once, and its error
// returned.
func (s *System) Keep(what string, close func() error) error {
	if s.own.IsClosed() {
		if err := close(); err != nil {
			return fmt.Errorf("vmm: %s could not be freed, and its System is closed, so nothing retries it: %w", what, err)
		}
		return nil
	}
	return s.adopt(what, nil, close)
}

// RetryOrphans retries freeing the objects in Orphans now (System.Close does it too), for services
// that run long; it returns the errors of those that still fail.
func (s *System) RetryOrphans() error { return s.retryAdopted() }

// Orphans lists the objects whose clean-up failed during an undo and that the System keeps to retry
// in Close (empty when every undo succeeded or a retry, by the System or by their owner, worked).
func (s *System) Orphans() []string {
	done := make(map[*lifetime.Owner]bool)
	for _, a := range s.adoptedNow() {
		if a.done() {
			done[a.own] = true
		}
	}
	s.adoptMu.Lock()
	defer s.adoptMu.Unlock()
	s.adopted = slices.DeleteFunc(s.adopted, func(a adoptee) bool { return a.own != nil && done[a.own] })
	out := make([]string, len(s.adopted))
	for i, a := range s.adopted {
		out[i] = a.what
	}
	return out
}

// remaining describes what the opened devices still own; the caller holds s.mu.
func (s *System) remaining() string {
	var parts []string
	for _, d := range s.devices {
		if d != nil && d.own.Children() > 0 {
			parts = append(parts, fmt.Sprintf("device %d: %s", d.ordinal, d.own.Remaining()))
		}
	}
	return strings.Join(parts, "; ")
}
