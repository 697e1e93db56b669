package nccl

import (
	"context"
	"errors"
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// RegisterOptions tunes Register.
type RegisterOptions struct {
	// Window registers each chunk as an NCCL window (ncclCommWindowRegister, NCCL 2.27+) instead of
	// a user buffer (ncclCommRegister). Window registration is collective: every rank must register
	// buffers of the same chunk count, in the same order.
	Window bool
	// WindowFlags are ncclCommWindowRegister's flags (NCCL_WIN_DEFAULT 0, NCCL_WIN_COLL_SYMMETRIC 1).
	WindowFlags int
}

// Registration is a buffer registered with a communicator, one NCCL registration per chunk. It holds
// every chunk's allocation (vmm.Allocation.Hold), so closing or shrinking the buffer fails with an
// error wrapping vmm.ErrInUse until the registration is closed.
type Registration struct {
	c      *Comm
	buf    vmm.Chunked
	ptr    driver.DevicePtr
	pieces []regPiece
	window bool
	// own is closed once the holds are released. The communicator's lock (c.mu) guards the
	// registration's state and is held whenever own is closed; own's lock only makes its closed flag
	// readable.
	own lifetime.Owner
}

type regPiece struct {
	off, size uint64
	handle    RegHandle
	win       Window
	release   func() // drops the hold on the chunk's allocation
}

// Register registers every chunk of buf with the communicator: ncclCommRegister (NCCL 2.19+) of
// each chunk's whole allocation, or ncclCommWindowRegister (2.27+) with opts.Window. NCCL itself looks
// up one allocation per registered range (cuMemGetAddressRange), so a buffer of several chunks
// registered in one call would have only its first chunk registered; one call per chunk registers
// them all. Operations use the registrations when each lies inside one chunk: move registered
// buffers with SendChunks and RecvChunks. Registering a buffer that overlaps one already registered
// with this communicator fails with ErrAlreadyRegistered, and one with a chunk closed or asleep
// (released to sleep, as offload does) with ErrInvalidValue and vmm.ErrClosed or vmm.ErrAsleep; a
// failure part-way deregisters what was done. The communicator's Close deregisters what is left.
func (c *Comm) Register(ctx context.Context, buf vmm.Chunked, opts ...RegisterOptions) (*Registration, error) {
	var o RegisterOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	chunks, err := c.chunksOf("register buffer", buf)
	if err != nil {
		return nil, err
	}
	what := fmt.Sprintf("register %d-chunk buffer at %#x", len(chunks), uint64(buf.Ptr()))
	// Held before waiting for the communicator, so that no Shrink, Close or sleep frees a chunk
	// meanwhile; a chunk freed or asleep before its hold is refused. Holds not handed to a piece are
	// released on return.
	holds := make([]func(), len(chunks))
	defer func() {
		for _, release := range holds {
			if release != nil {
				release()
			}
		}
	}()
	for i, ch := range chunks {
		release, err := ch.Allocation.Hold("an NCCL registration")
		if err != nil {
			return nil, fmt.Errorf("nccl: %s: chunk %d (offset %s) has no memory to register: %w: %w", what, i, units.FormatSize(ch.Offset), err, ErrInvalidValue)
		}
		holds[i] = release
	}
	need, call := VersionRegister, "ncclCommRegister"
	if o.Window {
		need, call = VersionWindow, "ncclCommWindowRegister"
	}
	if v := c.lib.Version(); v < need {
		return nil, &VersionError{Feature: call, Need: need, Have: v}
	}
	if err := c.lockCtx(ctx, what); err != nil {
		return nil, err
	}
	defer c.mu.Unlock()
	if err := c.use(what); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil { // before anything is registered: the communicator stays healthy
		return nil, fmt.Errorf("nccl: %s: nothing registered, the context had ended: %w", what, err)
	}
	r := &Registration{c: c, buf: buf, ptr: buf.Ptr(), window: o.Window}
	r.own.Init(nil, "nccl registration")
	if err := c.overlapping(r, chunks); err != nil {
		return nil, err
	}
	for i, ch := range chunks {
		p := regPiece{off: ch.Offset, size: ch.Allocation.Size()}
		if err := c.registerPiece(ctx, r, &p, o); err != nil {
			rbErr := r.deregisterLocked()
			return nil, errors.Join(fmt.Errorf("nccl: %s: chunk %d (offset %s, %s): %w", what, i,
				units.FormatSize(p.off), units.FormatSize(p.size), err), rbErr)
		}
		p.release, holds[i] = holds[i], nil
		r.pieces = append(r.pieces, p)
	}
	c.regs[r] = struct{}{}
	lifetime.Track(r, &r.own)
	return r, nil
}

// overlapping refuses a buffer whose range meets one already registered. c.mu is held.
func (c *Comm) overlapping(r *Registration, chunks []vmm.Chunk) error {
	last := chunks[len(chunks)-1]
	lo, hi := uint64(r.ptr), uint64(r.ptr)+last.Offset+last.Allocation.Size()
	for other := range c.regs {
		olo, ohi := other.bounds()
		if lo < ohi && olo < hi {
			return fmt.Errorf("nccl: register buffer [%#x, %#x): it overlaps the registered buffer [%#x, %#x): %w",
				lo, hi, olo, ohi, ErrAlreadyRegistered)
		}
	}
	return nil
}

func (r *Registration) bounds() (lo, hi uint64) {
	if len(r.pieces) == 0 {
		return uint64(r.ptr), uint64(r.ptr)
	}
	last := r.pieces[len(r.pieces)-1]
	return uint64(r.ptr), uint64(r.ptr) + last.off + last.size
}

// registerPiece makes one registration call on the bound thread and waits for a window's collective
// registration. c.mu is held.
func (c *Comm) registerPiece(ctx context.Context, r *Registration, p *regPiece, o RegisterOptions) error {
	ptr := r.ptr + driver.DevicePtr(p.off)
	var callErr error
	var window func() Window
	if err := c.dev.Raw(func(driver.API) error {
		if o.Window {
			window, callErr = c.lib.CommWindowRegister(c.h, ptr, p.size, o.WindowFlags)
		} else {
			p.handle, callErr = c.lib.CommRegister(c.h, ptr, p.size)
		}
		return nil
	}); err != nil {
		return err
	}
	// A window's registration is a group of its own: on a non-blocking communicator NCCL returns
	// ncclSuccess while the group still runs (seen with 2.28), and the next call on the communicator
	// fails until it is done. So a window is always waited for.
	if errors.Is(callErr, ErrInProgress) || (o.Window && callErr == nil) {
		callErr = c.waitLocked(ctx, "window registration")
	}
	if callErr == nil && window != nil {
		p.win = window()
	}
	return callErr
}

// Chunks is the number of NCCL registrations (one per chunk): 0 once the registration is closed or
// its communicator closed or aborted.
func (r *Registration) Chunks() int {
	r.c.mu.Lock()
	defer r.c.mu.Unlock()
	return len(r.pieces)
}

// Window reports whether the chunks are registered as NCCL windows.
func (r *Registration) Window() bool { return r.window }

// Buffer is the registered buffer.
func (r *Registration) Buffer() vmm.Chunked { return r.buf }

// Close deregisters every chunk (ncclCommDeregister or ncclCommWindowDeregister) and releases the
// holds on the buffer's allocations. After the communicator's Close or Abort it only releases the
// holds. It waits for a call that another goroutine is making on the communicator (Abort interrupts
// one that hangs). A deregistration that NCCL answers with an error, or whose wait fails (which
// aborts the communicator), is reported, but the holds are released all the same: Close is not
// retried. Idempotent and safe on nil.
func (r *Registration) Close() error {
	if r == nil {
		return nil
	}
	r.c.mu.Lock()
	defer r.c.mu.Unlock()
	if r.own.IsClosed() {
		return nil
	}
	delete(r.c.regs, r)
	return r.deregisterLocked()
}

// deregisterLocked undoes every registration of r while the communicator is usable and releases
// every hold once. r.pieces is emptied first: a deregistration whose wait fails aborts the
// communicator, whose dropRegistrations must then find nothing more of r to release, and the
// chunks not reached yet are only released (NCCL freed them with the communicator). c.mu is held.
func (r *Registration) deregisterLocked() error {
	pieces := r.pieces
	r.pieces = nil
	var errs []error
	for i := len(pieces) - 1; i >= 0; i-- {
		p := pieces[i]
		if r.c.usable() {
			if err := r.deregisterPiece(p); err != nil {
				errs = append(errs, fmt.Errorf("nccl: deregister chunk at offset %s: %w", units.FormatSize(p.off), err))
			}
		}
		if p.release != nil {
			p.release()
		}
	}
	r.own.Shut()
	return errors.Join(errs...)
}

func (r *Registration) deregisterPiece(p regPiece) error {
	c := r.c
	err := c.dev.Raw(func(driver.API) error {
		if r.window {
			return c.lib.CommWindowDeregister(c.h, p.win)
		}
		return c.lib.CommDeregister(c.h, p.handle)
	})
	if errors.Is(err, ErrInProgress) {
		ctx, cancel := context.WithTimeout(context.Background(), c.closeTimeout())
		defer cancel()
		err = c.waitLocked(ctx, "deregistration")
	}
	return err
}

// forget releases the holds of a registration whose communicator was aborted (NCCL freed the
// registrations). c.mu is held.
func (r *Registration) forget() {
	pieces := r.pieces
	r.pieces = nil
	for _, p := range pieces {
		if p.release != nil {
			p.release()
		}
	}
	r.own.Shut()
}
