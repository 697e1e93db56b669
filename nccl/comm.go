package nccl

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/vmm"
)

// Options tunes NewComm.
type Options struct {
	// Config is passed to ncclCommInitRankConfig; nil means DefaultConfig. Blocking is always set
	// to 0: NewComm and every operation poll the communicator so that a context can abort them.
	Config *Config
	// CloseTimeout bounds Close's wait for ncclCommFinalize; past it Close aborts the communicator
	// (0: DefaultCloseTimeout).
	CloseTimeout time.Duration
}

// DefaultCloseTimeout is how long Close waits for the communicator to finalize before aborting it.
const DefaultCloseTimeout = 30 * time.Second

// Comm is an NCCL communicator of one rank on one device (ncclComm_t). Its methods may be called from
// any goroutine; they are serialized, as NCCL requires of one communicator.
type Comm struct {
	lib    API
	dev    *vmm.Device
	h      CommHandle
	rank   int
	nranks int
	opts   Options

	abortReq  chan struct{} // closed by Abort: a call in progress aborts at its next poll (within about a millisecond)
	abortOnce sync.Once

	// dependent ends the communicator's count as its device's dependent (vmm.Device.AddDependent);
	// called when own closes.
	dependent func()

	// mu is the communicator's lock, held by every call that uses h (NCCL requires one call at a
	// time per communicator); it guards the fields below and own's closed flag. Close only tries it,
	// and the calls with a context stop waiting for it when theirs ends (callLock.lockCtx).
	mu      callLock
	own     lifetime.Owner // closed once Close is done; its own lock is not used
	aborted error          // why the communicator was aborted, nil while usable
	// abortLeft: the communicator was aborted but ncclCommAbort could not run (binding the device
	// failed): Close, or the System after a failed NewComm, runs it again.
	abortLeft bool
	regs      map[*Registration]struct{}
}

// NewComm joins the communicator id as rank of nranks, on dev: ncclCommInitRankConfig with a
// non-blocking configuration, then ncclCommGetAsyncError polled until the communicator is ready.
// Every rank must call it (in its own process or goroutine) with the same id and nranks. When ctx ends
// first, the communicator is aborted (ncclCommAbort) and the error wraps both ErrAborted and ctx's
// error; a rank that never joins therefore costs the others their deadline, never a hang.
func NewComm(ctx context.Context, lib API, id UniqueID, rank, nranks int, dev *vmm.Device, opts ...Options) (*Comm, error) {
	if lib == nil || dev == nil {
		return nil, fmt.Errorf("nccl: new communicator: nil library or device: %w", ErrInvalidValue)
	}
	if nranks < 1 || rank < 0 || rank >= nranks {
		return nil, fmt.Errorf("nccl: new communicator: rank %d of %d: %w", rank, nranks, ErrInvalidValue)
	}
	if nranks > math.MaxInt32 { // NCCL takes an int: a larger count would reach it truncated
		return nil, fmt.Errorf("nccl: new communicator: %d ranks: more than NCCL's %d: %w", nranks, math.MaxInt32, ErrInvalidValue)
	}
	c := &Comm{lib: lib, dev: dev, rank: rank, nranks: nranks, regs: map[*Registration]struct{}{}, abortReq: make(chan struct{})}
	if len(opts) > 0 {
		c.opts = opts[0]
	}
	cfg := DefaultConfig()
	if c.opts.Config != nil {
		cfg = *c.opts.Config
	}
	cfg.Blocking = 0
	// Counted before NCCL holds the device, so that no System.Close releases the device's context
	// under the communicator; ended once it is closed or released (markClosed, release).
	done, err := dev.AddDependent("nccl communicator")
	if err != nil {
		return nil, fmt.Errorf("nccl: new communicator on %s: %w", dev, err)
	}
	c.dependent = done
	var initErr error
	if err := dev.Raw(func(driver.API) error {
		c.h, initErr = lib.CommInitRankConfig(nranks, id, rank, dev.Handle(), &cfg)
		return nil
	}); err != nil {
		done()
		return nil, fmt.Errorf("nccl: new communicator on %s: %w", dev, err)
	}
	if initErr != nil && !errors.Is(initErr, ErrInProgress) {
		err := fmt.Errorf("nccl: new communicator, rank %d of %d on %s: %w", rank, nranks, dev, initErr)
		if c.h == 0 {
			done()
			return nil, err
		}
		return nil, errors.Join(err, c.release()) // NCCL asks for an abort of what it handed back
	}
	c.mu.Lock()
	err = c.waitLocked(ctx, "initialize the communicator")
	c.mu.Unlock()
	if err != nil {
		return nil, errors.Join(err, c.release())
	}
	c.own.Init(nil, "nccl communicator")
	lifetime.Track(c, &c.own)
	return c, nil
}

// Rank is this rank's number in the communicator.
func (c *Comm) Rank() int { return c.rank }

// NRanks is the communicator's size.
func (c *Comm) NRanks() int { return c.nranks }

// Device is the device the rank runs on.
func (c *Comm) Device() *vmm.Device { return c.dev }

// Handle is the raw ncclComm_t, for calls this package does not wrap. It must not be used after
// Close or Abort.
func (c *Comm) Handle() CommHandle { return c.h }

// Library is the NCCL the communicator was made with.
func (c *Comm) Library() API { return c.lib }

func (c *Comm) String() string {
	return fmt.Sprintf("nccl communicator rank %d of %d on %s", c.rank, c.nranks, c.dev)
}

// usable reports, with c.mu held, whether the communicator is neither closed nor aborted.
func (c *Comm) usable() bool { return !c.own.Closed() && c.aborted == nil }

// use checks, with c.mu held, that the communicator may be used.
func (c *Comm) use(op string) error {
	if c.own.Closed() {
		return fmt.Errorf("nccl: %s: %w", op, ErrClosed)
	}
	if c.aborted != nil {
		return fmt.Errorf("nccl: %s: the communicator was aborted earlier (%v): %w", op, c.aborted, ErrAborted)
	}
	return nil
}

// waitLocked polls ncclCommGetAsyncError, with Wait's pauses (see pause), until the communicator
// has left ncclInProgress. When ctx ends first (after syncGrace, as in Wait: queuing that is about
// to end must not cost a healthy communicator), or the communicator reports an error, it aborts the
// communicator. c.mu is held.
func (c *Comm) waitLocked(ctx context.Context, op string) error {
	start := time.Now()
	var graceEnd time.Time
	for {
		err := c.lib.CommGetAsyncError(c.h)
		if err == nil {
			return nil
		}
		if !errors.Is(err, ErrInProgress) {
			c.abortLocked(err)
			return fmt.Errorf("nccl: %s (%v), communicator aborted: %w", op, c, errors.Join(ErrAborted, err))
		}
		if ctxErr := graceOver(ctx, &graceEnd); ctxErr != nil {
			c.abortLocked(ctxErr)
			return fmt.Errorf("nccl: %s (%v): still in progress when the context ended, communicator aborted: %w", op, c, errors.Join(ErrAborted, ctxErr))
		}
		if c.abortRequested() {
			c.abortLocked(errAbortCalled)
			return fmt.Errorf("nccl: %s (%v): Abort was called: %w", op, c, ErrAborted)
		}
		pause(time.Since(start))
	}
}

var errAbortCalled = errors.New("Abort was called")

// graceOver returns ctx's error once syncGrace has passed since a poll first found ctx ended (kept
// in *end), and nil before: the polls of Wait and waitLocked give the work that long to end.
func graceOver(ctx context.Context, end *time.Time) error {
	err := ctx.Err()
	switch {
	case err == nil:
		return nil
	case end.IsZero():
		*end = time.Now().Add(syncGrace)
		return nil
	case time.Now().After(*end):
		return err
	}
	return nil
}

// lockCtx takes c.mu for the call op, or fails, aborting nothing, when ctx ends while another call
// on the communicator still holds it: the error wraps ErrInUse and ctx's error.
func (c *Comm) lockCtx(ctx context.Context, op string) error {
	if err := c.mu.lockCtx(ctx); err != nil {
		return fmt.Errorf("nccl: %s on %v: another call on the communicator was still running when the context ended: %w: %w", op, c, ErrInUse, err)
	}
	return nil
}

func (c *Comm) abortRequested() bool {
	select {
	case <-c.abortReq:
		return true
	default:
		return false
	}
}

// abortLocked aborts the communicator (ncclCommAbort) and remembers why. c.mu is held.
func (c *Comm) abortLocked(why error) {
	if c.aborted != nil || c.own.Closed() {
		return
	}
	c.aborted = why
	c.dropRegistrations()
	_ = c.ncclAbort()
}

// ncclAbort runs ncclCommAbort and records whether it could (abortLeft). c.mu is held.
func (c *Comm) ncclAbort() error {
	err := c.dev.Raw(func(driver.API) error { return c.lib.CommAbort(c.h) })
	c.abortLeft = err != nil
	return err
}

// dropRegistrations forgets every registration: an aborted or destroyed communicator releases them
// itself. c.mu is held.
func (c *Comm) dropRegistrations() {
	for r := range c.regs {
		r.forget()
	}
	clear(c.regs)
}

// release frees a communicator that failed to initialize: ncclCommAbort with its device bound, unless
// waitLocked aborted it already. When ncclCommAbort could not run, the System keeps retrying it
// (System.Keep), and the error says so.
func (c *Comm) release() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.aborted == nil {
		c.abortLocked(errors.New("initialization failed"))
	}
	c.own.MarkClosed()
	defer c.dependent() // after Keep: an abort still to run is then the System's, which stays open for it
	if !c.abortLeft {
		return nil
	}
	return c.dev.System().Keep(fmt.Sprintf("%v, whose ncclCommAbort failed", c), func() error {
		c.mu.Lock()
		defer c.mu.Unlock()
		if !c.abortLeft {
			return nil
		}
		return c.ncclAbort()
	})
}

// Abort aborts the communicator (ncclCommAbort): operations still queued on the device stop, other
// ranks' operations with this rank fail or hang until their own deadlines, and every registration
// is released. It may be called from any goroutine while another call waits on the communicator
// (a watchdog's way out of a hang): that call returns an error wrapping ErrAborted at once, and
// Abort returns once it has. Afterwards every method fails with ErrAborted; Close is still allowed
// (and does nothing more, unless ncclCommAbort could not run: Abort's error says so, and Close runs
// it again). Abort is idempotent and safe on nil.
func (c *Comm) Abort() error {
	if c == nil {
		return nil
	}
	c.abortOnce.Do(func() { close(c.abortReq) })
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.own.Closed() || c.aborted != nil {
		return nil
	}
	c.aborted = errAbortCalled
	c.dropRegistrations()
	if err := c.ncclAbort(); err != nil {
		return fmt.Errorf("nccl: abort %v (Close retries it): %w", c, err)
	}
	return nil
}

// Close deregisters what is still registered, finalizes the communicator (ncclCommFinalize, polled
// for at most Options.CloseTimeout, after which it aborts) and destroys it (ncclCommDestroy). After
// an abort it only marks the communicator closed, once ncclCommAbort has run (an abort whose
// device binding failed runs it again here, and a Close that fails to can be retried). Close is
// idempotent and safe on nil.
//
// Close does not wait for a call that another goroutine is making on the communicator (an
// operation, Wait, Register, a registration's Close, or another Close): it returns at once an error
// wrapping ErrInUse and leaves the communicator as it was, so Close can be called again once that
// call has returned. Abort interrupts a call that hangs.
//
// When ranks live in several processes, every rank should Close at about the same time, as a
// collective: NCCL's destroy waits until the ranks of other processes that talk to this one have
// closed theirs (or exited). A process that waits for its peer to exit before closing its own
// communicator deadlocks with a peer doing the same; Close bounds that wait by CloseTimeout and then
// returns an error wrapping ErrInUse (see destroy).
func (c *Comm) Close() error {
	if c == nil {
		return nil
	}
	if !c.mu.TryLock() {
		return fmt.Errorf("nccl: close %v: another call is using the communicator (Abort interrupts it): %w", c, ErrInUse)
	}
	defer c.mu.Unlock()
	if c.own.Closed() {
		return nil
	}
	if c.aborted != nil && c.abortLeft {
		if err := c.ncclAbort(); err != nil {
			return fmt.Errorf("nccl: close %v: ncclCommAbort (a later Close retries it): %w", c, err)
		}
	}
	// Closed on every other way out (finalized and destroyed, or aborted), unless an abort on the way
	// could not run: then the next Close retries it, above.
	defer c.markClosed()
	if c.aborted != nil {
		return nil
	}
	// Deregistered before the finalize, while NCCL's proxies still run: the release of a peer's
	// import of a registered buffer goes through them, and the cleanup that ncclCommDestroy does of
	// what is still registered comes after they stopped (seen with NCCL 2.28: the buffer's memory
	// stayed mapped for the life of the process).
	regErr := c.deregisterAll()
	if c.aborted != nil {
		return regErr // a deregistration's wait failed and aborted the communicator
	}
	return errors.Join(regErr, c.finalize())
}

// markClosed marks the communicator closed unless ncclCommAbort is still to run. c.mu is held.
func (c *Comm) markClosed() {
	if !c.abortLeft {
		c.own.MarkClosed()
		c.dependent()
	}
}

// closeTimeout is Options.CloseTimeout, or DefaultCloseTimeout when it is not set.
func (c *Comm) closeTimeout() time.Duration {
	if c.opts.CloseTimeout > 0 {
		return c.opts.CloseTimeout
	}
	return DefaultCloseTimeout
}

// finalize finalizes the communicator (aborting it when that fails) and destroys it, within
// Options.CloseTimeout. c.mu is held and the communicator usable.
func (c *Comm) finalize() error {
	ctx, cancel := context.WithTimeout(context.Background(), c.closeTimeout())
	defer cancel()
	err := c.dev.Raw(func(driver.API) error { return c.lib.CommFinalize(c.h) })
	if err == nil || errors.Is(err, ErrInProgress) {
		err = c.waitLocked(ctx, "finalize") // the owner is still open, so this may abort
	}
	if err != nil {
		if c.aborted == nil {
			c.aborted = err
			_ = c.ncclAbort()
		}
		if c.abortLeft {
			return fmt.Errorf("nccl: close %v: ncclCommFinalize, and ncclCommAbort after it failed (a later Close retries it): %w", c, err)
		}
		return fmt.Errorf("nccl: close %v: ncclCommFinalize: %w", c, err)
	}
	return c.destroy(ctx)
}

// deregisterAll deregisters every registration still open (each releases its holds even when
// NCCL's deregistration fails). A deregistration whose wait fails aborts the communicator, which
// forgets the registrations not reached yet (releasing their holds). c.mu is held and the
// communicator usable.
func (c *Comm) deregisterAll() error {
	var errs []error
	for r := range c.regs {
		delete(c.regs, r)
		errs = append(errs, r.deregisterLocked())
	}
	return errors.Join(errs...)
}

// destroy calls ncclCommDestroy, waiting for it until ctx ends. NCCL's proxy thread, which the
// destroy joins, keeps serving the ranks of other processes that connected to it until they close
// their communicators (or exit): a Close in one process therefore returns only once its peers close
// too. When they have not by ctx's end, destroy returns an error wrapping ErrInUse and the destroy
// finishes in the background as soon as they do (a peer that exits counts); the communicator is
// closed either way. Abort, a watchdog's way out, ends the wait the same way (without calling
// ncclCommAbort on a communicator being destroyed). The device's vmm.System.Close waits for a
// destroy still in the background.
func (c *Comm) destroy(ctx context.Context) error {
	done := make(chan error, 1)
	go func() { done <- c.dev.Raw(func(driver.API) error { return c.lib.CommDestroy(c.h) }) }()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("nccl: close %v: ncclCommDestroy: %w", c, err)
		}
		return nil
	case <-ctx.Done():
	case <-c.abortReq:
	}
	return fmt.Errorf("nccl: close %v: ncclCommDestroy still waits for the ranks of other processes to close their communicators; it ends in the background when they do: %w",
		c, ErrInUse)
}

// Wait waits until the work queued on s is done, watching ctx and the communicator meanwhile: when
// ctx ends first, or the communicator reports an asynchronous error (a peer that died over a network
// transport), it aborts the communicator, which stops NCCL's kernels, and returns an error wrapping
// ErrAborted (and ctx's error). Use it instead of s.Synchronize after NCCL operations, whose kernels
// wait for their peers and would otherwise wait forever. When ctx ends while Wait still waits for
// another call on the communicator to return, it aborts nothing: the error wraps ErrInUse and ctx's.
//
// Wait records an event on s and polls it (cuEventQuery: back to back for the first millisecond,
// then after sleeps of a sixteenth of the time waited so far, from about 60 µs up to 1 ms, so
// that it sees the end at most about 6 % late plus the kernel's timer slack). Once it returns, no
// call of its own is left on the stream: after an abort it waits for the stream at most about
// 10 s, and a kernel that still has not stopped then delays neither s.Close nor anything else. A
// nil s (the legacy default stream) waits for the whole device (cuCtxSynchronize, which has no
// non-blocking form): after an abort whose kernels do not stop that call keeps running on another
// goroutine past Wait, and System.Close waits for it.
func (c *Comm) Wait(ctx context.Context, s *vmm.Stream) (err error) {
	if err := c.lockCtx(ctx, "wait"); err != nil {
		return err
	}
	defer c.mu.Unlock()
	if err := c.use("wait"); err != nil {
		return err
	}
	if s == nil {
		return c.watch(ctx, c.deviceDone())
	}
	ev, err := s.Device().NewEvent(false)
	if err != nil {
		return fmt.Errorf("nccl: wait on %v: %w", c, err)
	}
	defer func() { err = errors.Join(err, ev.Close()) }()
	if err := ev.Record(s); err != nil {
		return fmt.Errorf("nccl: wait on %v: %w", c, err)
	}
	return c.watch(ctx, ev.Query)
}

// deviceDone starts cuCtxSynchronize of the communicator's device on another goroutine and returns
// the poll that reports its end.
func (c *Comm) deviceDone() func() (bool, error) {
	done := make(chan error, 1)
	go func() { done <- c.dev.Synchronize() }()
	return func() (bool, error) {
		select {
		case err := <-done:
			return true, err
		default:
			return false, nil
		}
	}
}

// watch polls done, with pause's pauses, until it reports the work done or fails, and aborts
// the communicator when ctx ends first (after syncGrace), when the communicator reports an
// asynchronous error, or when Abort is called. c.mu is held.
func (c *Comm) watch(ctx context.Context, done func() (bool, error)) error {
	var graceEnd time.Time
	start := time.Now()
	for {
		if ok, err := done(); ok || err != nil {
			return c.synchronized(err)
		}
		if err := c.lib.CommGetAsyncError(c.h); err != nil && !errors.Is(err, ErrInProgress) {
			c.abortLocked(err)
			return afterAbort(done, fmt.Errorf("nccl: wait on %v: %w", c, errors.Join(ErrAborted, err)))
		}
		if c.abortRequested() {
			c.abortLocked(errAbortCalled)
			return afterAbort(done, fmt.Errorf("nccl: wait on %v: Abort was called: %w", c, ErrAborted))
		}
		if ctxErr := graceOver(ctx, &graceEnd); ctxErr != nil { // the work may be done first: see syncGrace
			c.abortLocked(ctxErr)
			return afterAbort(done, fmt.Errorf("nccl: wait on %v: the stream's work was not done when the context ended, communicator aborted: %w",
				c, errors.Join(ErrAborted, ctx.Err())))
		}
		pause(time.Since(start))
	}
}

// The polls of Wait and of the calls that wait for NCCL to leave ncclInProgress (waitLocked):
// none between them for the first waitSpin (work that ends then is seen within microseconds, as a
// spinning cuStreamSynchronize sees it), then one after each sleep of a sixteenth of the time waited
// so far (about 60 µs just past the spin), at most waitPollMax; waitPoll is only a floor, should
// waitSpin ever be shortened. Work that ends is so seen at most about 6 % of its time late (plus
// the kernel's timer slack, 50 µs by default), for one cheap query per pause: a wait of a
// millisecond polls every 60-120 µs, a long one (a receive waiting for its peer, NewComm, a
// finalize) about once a millisecond instead of 10,000 times a second.
const (
	waitSpin    = time.Millisecond
	waitPoll    = 50 * time.Microsecond
	waitPollMax = time.Millisecond
)

// pause is pollPause, a variable so that tests can see which waits poll with it.
var pause = pollPause

// pollPause waits before the next poll of Wait or waitLocked, after waiting for elapsed: it yields
// the processor for the first waitSpin, then sleeps pollSleep(elapsed) in the kernel (nanosleep).
// A Go timer would not do: one of under a millisecond, in a process with nothing else to run,
// sleeps a millisecond or more (the runtime's poller waits in whole milliseconds), and they would
// see short work end that late.
func pollPause(elapsed time.Duration) {
	if elapsed < waitSpin {
		runtime.Gosched()
		return
	}
	ts := unix.NsecToTimespec(pollSleep(elapsed).Nanoseconds())
	for unix.Nanosleep(&ts, &ts) == unix.EINTR {
	}
}

// pollSleep is how long pollPause sleeps after waiting for elapsed: elapsed/16, within
// [waitPoll, waitPollMax].
func pollSleep(elapsed time.Duration) time.Duration {
	return min(max(elapsed/16, waitPoll), waitPollMax)
}

func (c *Comm) synchronized(err error) error {
	if err != nil {
		return fmt.Errorf("nccl: wait on %v: %w", c, err)
	}
	return nil
}

// syncGrace is how long Wait (and waitLocked, for NCCL's queuing), once its context has ended, still
// gives the stream's work to finish before it aborts: work that is done shows in microseconds, and a context that ended (or had ended
// before Wait was called) must not abort a healthy communicator.
const syncGrace = 20 * time.Millisecond

// abortWait bounds how long Wait waits for the stream after an abort.
var abortWait = 10 * time.Second

// afterAbort polls done, for at most abortWait, for the work that an abort released, and returns err
// (saying so when the work was not done by then). A failed poll counts as the end of the work.
func afterAbort(done func() (bool, error), err error) error {
	start := time.Now()
	for {
		if ok, pollErr := done(); ok || pollErr != nil {
			return err
		}
		if time.Since(start) > abortWait {
			return fmt.Errorf("%w (the stream was still busy %v after the abort)", err, abortWait)
		}
		pause(time.Since(start))
	}
}
