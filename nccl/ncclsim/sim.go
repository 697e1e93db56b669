// Package ncclsim is a simulated NCCL with the API of the real library (it implements nccl.API), so
// that code using package nccl is tested without GPUs or NCCL: each rank may live in its own process,
// as with NCCL, and ranks exchange the bytes over Unix sockets (abstract names derived from the unique
// ID); reductions are computed on the ranks' simulated memory, read and written through the driver
// the stand-in is given (normally the simulated driver, driver/sim).
//
// What it models: non-blocking communicators (initialization and every group of operations run in the
// background and report ncclInProgress until done, polled with ncclCommGetAsyncError), groups per OS
// thread, sends and receives matched in order per pair of ranks, the four collectives, user buffer and
// window registrations, ncclCommAbort, and the errors: ranks that disagree on the communicator's size
// or on a transfer's byte count get ncclInvalidUsage, as does a group with a send to the rank itself
// and no matching receive from itself (or the reverse), a peer that exits gets ncclRemoteError, a
// receive whose sender never sends stays in progress (as NCCL hangs) until the caller aborts. It
// also lists the calls made while their communicator's device was not current on the calling
// thread (Unbound), which NCCL would run on the wrong device.
//
// Differences from NCCL: operations complete before the group reports success (NCCL only queues them
// on the stream), window registration is not collective, reductions of 16- and 8-bit floats are
// computed in float32 and rounded once (float8 saturating, as CUDA's __NV_SATFINITE conversion does),
// and data moves at socket speed.
package ncclsim

import (
	"crypto/rand"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/nccl"
)

// DefaultVersion is the NCCL version the stand-in reports unless told otherwise.
const DefaultVersion = 22809

// Lib is the simulated library. It is safe for concurrent use; every rank of a process may share one.
type Lib struct {
	api     driver.API
	version int

	mu     sync.Mutex
	comms  map[nccl.CommHandle]*comm
	next   nccl.CommHandle
	groups map[int]*group // per OS thread (gettid), as ncclGroupStart nests per thread
	// unbound lists the calls made while their communicator's device was not current (see Unbound).
	unbound []string
}

// Option tunes New.
type Option func(*Lib)

// Version makes the stand-in report NCCL version v (an NCCL_VERSION_CODE such as 22700) and refuse
// what is newer: ncclCommInitRankConfig below 2.14, registration below 2.19, windows below 2.27.
func Version(v int) Option { return func(l *Lib) { l.version = v } }

// New returns a simulated NCCL that reaches device memory through api (the simulated driver, or any
// driver.API).
func New(api driver.API, opts ...Option) *Lib {
	l := &Lib{api: api, version: DefaultVersion, comms: map[nccl.CommHandle]*comm{}, groups: map[int]*group{}}
	for _, o := range opts {
		o(l)
	}
	return l
}

// Live counts what the stand-in holds: communicators not yet destroyed or aborted, registrations,
// windows, and open sockets.
type Live struct {
	Comms, Registrations, Windows, Conns int
}

// Zero reports whether nothing is live.
func (l Live) Zero() bool { return l == Live{} }

func (l Live) String() string {
	return fmt.Sprintf("comms=%d registrations=%d windows=%d conns=%d", l.Comms, l.Registrations, l.Windows, l.Conns)
}

// Live reports what is still held, for leak checks at the end of a test.
func (l *Lib) Live() Live {
	l.mu.Lock()
	comms := make([]*comm, 0, len(l.comms))
	for _, c := range l.comms {
		comms = append(comms, c)
	}
	l.mu.Unlock()
	var out Live
	for _, c := range comms {
		c.mu.Lock()
		out.Comms++
		out.Registrations += len(c.regs)
		out.Windows += len(c.wins)
		out.Conns += c.openConns()
		c.mu.Unlock()
	}
	return out
}

func (l *Lib) Version() int { return l.version }

func (l *Lib) GetErrorString(r nccl.Result) string { return "" }

func (l *Lib) GetLastError(h nccl.CommHandle) string {
	if c := l.comm(h); c != nil {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.last
	}
	return ""
}

// needs refuses a feature newer than the simulated version.
func (l *Lib) needs(feature string, v int) error {
	if l.version < v {
		return &nccl.VersionError{Feature: feature, Need: v, Have: l.version}
	}
	return nil
}

var idMagic = [8]byte{'n', 'c', 'c', 'l', 's', 'i', 'm', 1}

func (l *Lib) GetUniqueID() (nccl.UniqueID, error) {
	var id nccl.UniqueID
	copy(id[:], idMagic[:])
	if _, err := rand.Read(id[8:24]); err != nil {
		return id, nccl.SystemError
	}
	return id, nil
}

func (l *Lib) comm(h nccl.CommHandle) *comm {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.comms[h]
}

// Unbound lists the calls that came while their communicator's device was not current on the
// calling OS thread, each naming the call and the rank: NCCL makes its CUDA calls in the calling
// thread's current context (and may change it), so a caller must bind the device first, on a
// locked thread. The stand-in still runs such calls; tests check that the list is empty, as they
// check Live. Checked: ncclCommInitRankConfig, ncclCommFinalize, ncclCommDestroy, ncclCommAbort,
// the registrations and the operations.
func (l *Lib) Unbound() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.unbound...)
}

// bound records call in Unbound when c's device (its primary context) is not current on the
// calling thread.
func (l *Lib) bound(call string, c *comm) {
	cur, err := l.api.CtxGetCurrent()
	if err == nil && cur == c.ctx {
		return
	}
	what := fmt.Sprintf("%s on rank %d of device %d: current context %#x", call, c.rank, c.dev, uintptr(cur))
	if err != nil {
		what = fmt.Sprintf("%s on rank %d of device %d: cuCtxGetCurrent: %v", call, c.rank, c.dev, err)
	}
	l.mu.Lock()
	l.unbound = append(l.unbound, what)
	l.mu.Unlock()
}

// fail records text as the communicator's last error and returns r as a call error.
func fail(call string, r nccl.Result, format string, args ...any) error {
	return &nccl.CallError{Call: call, Result: r, Last: fmt.Sprintf(format, args...)}
}

func (l *Lib) CommInitRankConfig(nranks int, id nccl.UniqueID, rank int, dev driver.Device, cfg *nccl.Config) (nccl.CommHandle, error) {
	const call = "ncclCommInitRankConfig"
	if err := l.needs(call, nccl.MinVersion); err != nil {
		return 0, err
	}
	if [8]byte(id[:8]) != idMagic {
		return 0, fail(call, nccl.InvalidArgument, "the unique ID was not made by the simulated NCCL")
	}
	if nranks < 1 || rank < 0 || rank >= nranks {
		return 0, fail(call, nccl.InvalidArgument, "rank %d of %d", rank, nranks)
	}
	ctx, err := l.api.DevicePrimaryCtxRetain(dev)
	if err != nil {
		return 0, fail(call, nccl.UnhandledCudaError, "cuDevicePrimaryCtxRetain(%d): %v", dev, err)
	}
	l.mu.Lock()
	l.next++
	c := newComm(l, l.next, id, rank, nranks, dev, ctx)
	l.comms[c.h] = c
	l.mu.Unlock()
	l.bound(call, c) // NCCL takes the current device as the communicator's
	c.wait.Add(1)
	if cfg != nil && cfg.Blocking == 0 {
		go c.connect()
		return c.h, nccl.InProgress
	}
	c.connect()
	return c.h, c.asyncError()
}

func (l *Lib) CommGetAsyncError(h nccl.CommHandle) error {
	c := l.comm(h)
	if c == nil {
		return fail("ncclCommGetAsyncError", nccl.InvalidArgument, "unknown communicator")
	}
	return c.asyncError()
}

func (l *Lib) CommFinalize(h nccl.CommHandle) error {
	c := l.comm(h)
	if c == nil {
		return fail("ncclCommFinalize", nccl.InvalidArgument, "unknown communicator")
	}
	l.bound("ncclCommFinalize", c)
	return c.finalize()
}

func (l *Lib) CommDestroy(h nccl.CommHandle) error { return l.drop("ncclCommDestroy", h) }
func (l *Lib) CommAbort(h nccl.CommHandle) error   { return l.drop("ncclCommAbort", h) }

// drop aborts what the communicator still does, closes its sockets and forgets it.
func (l *Lib) drop(call string, h nccl.CommHandle) error {
	l.mu.Lock()
	c := l.comms[h]
	delete(l.comms, h)
	l.mu.Unlock()
	if c == nil {
		return fail(call, nccl.InvalidArgument, "unknown communicator")
	}
	l.bound(call, c)
	c.shutdown(nccl.RemoteError, "the communicator was "+map[bool]string{true: "aborted", false: "destroyed"}[call == "ncclCommAbort"])
	c.wait.Wait()
	if err := l.api.DevicePrimaryCtxRelease(c.dev); err != nil {
		return fail(call, nccl.UnhandledCudaError, "cuDevicePrimaryCtxRelease: %v", err)
	}
	return nil
}

func (l *Lib) commInt(call string, h nccl.CommHandle, f func(c *comm) int) (int, error) {
	c := l.comm(h)
	if c == nil {
		return 0, fail(call, nccl.InvalidArgument, "unknown communicator")
	}
	return f(c), nil
}

func (l *Lib) CommCount(h nccl.CommHandle) (int, error) {
	return l.commInt("ncclCommCount", h, func(c *comm) int { return c.nranks })
}

func (l *Lib) CommCuDevice(h nccl.CommHandle) (int, error) {
	return l.commInt("ncclCommCuDevice", h, func(c *comm) int { return int(c.dev) })
}

func (l *Lib) CommUserRank(h nccl.CommHandle) (int, error) {
	return l.commInt("ncclCommUserRank", h, func(c *comm) int { return c.rank })
}

// tid is the calling OS thread, which keys group state as NCCL's thread-local variables do.
func tid() int { return unix.Gettid() }
