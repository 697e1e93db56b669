// Package vmm is the safe layer over the CUDA driver's virtual memory management: devices, physical
// allocations, address reservations, mappings, access rights, shareable handles as *os.File, dma-buf
// export, host registration, streams, events, CUDA graphs captured from a stream, copies and the
// project's pattern kernels.
//
// Every owning type (Allocation, Reservation, Mapping, Stream, Event, Graph, GraphExec, PlainBuffer,
// HostRegistration, HostBuffer) has Close, which is idempotent and safe on a nil receiver. A child
// keeps its parent alive: closing an Allocation or Reservation that still has mappings, or a System
// whose devices still own objects, returns an error wrapping ErrInUse and frees nothing. Teardown
// order is unmap, release, address free. A clean-up that fails during an undo never orphans its
// object: the owner keeps it, or the System does (Orphans), and a later Close retries it. Built with
// the cuvmmleak tag, owners that become unreachable without Close are reported with the stack that
// made them.
//
// After a queued copy fails, Stream.Drain waits for what is still queued (retrying a failed
// synchronization) before the memory the copy used is freed or reused; when it cannot, its error
// wraps ErrNotDrained and that memory must be held until a later synchronization succeeds.
//
// Thread rule: the driver's current context is per OS thread and goroutines move between threads, so
// every call that needs a context locks the goroutine to its thread, binds the device's primary
// context with cuCtxSetCurrent for the duration of the call, and unlocks. There is no hidden
// package-level current device.
//
// The same code runs on the real driver (driver.Open) and on the simulator (sim.New).
package vmm

import (
	"errors"
	"fmt"
	"runtime"
	"sync"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
)

// Sentinel errors of this package. Driver failures keep their driver sentinel (driver.ErrOutOfMemory,
// driver.ErrNotSupported, ...), and argument checks made here wrap ErrInvalidValue, which is
// driver.ErrInvalidValue, so one errors.Is covers both.
var (
	// ErrClosed: a method was called on an object after its Close.
	ErrClosed = lifetime.ErrClosed
	// ErrInUse: Close of a parent that still has live children (mappings, buffers, registrations).
	ErrInUse = lifetime.ErrInUse
	// ErrInvalidValue is driver.ErrInvalidValue.
	ErrInvalidValue = driver.ErrInvalidValue
	// ErrNoDevice is driver.ErrNoDevice: an ordinal out of range.
	ErrNoDevice = driver.ErrNoDevice
)

// System is one driver (real or simulated) with its devices. It is safe for concurrent use.
type System struct {
	api     driver.API
	version int
	count   int

	mu      sync.Mutex
	devices []*Device // opened lazily, index = ordinal

	// gate is read-held by every call that runs with a device's context bound (Device.do) and
	// write-held by Close while it checks what the devices own and releases them, so that no object
	// can be made between the check and the release.
	gate    sync.RWMutex
	closeMu sync.Mutex // serializes Close

	adoptMu sync.Mutex
	adopted []adoptee // objects whose undo failed, retried by Close

	own   lifetime.Owner // leak tracking: closed by Close
	stats statsTable     // what the devices' counting APIs recorded (Stats)
}

// Open initialises the driver (cuInit) and reads its version and device count. Devices are opened
// (their primary contexts retained) on first use by Device.
func Open(api driver.API) (*System, error) {
	if api == nil {
		return nil, fmt.Errorf("vmm: open: nil driver: %w", ErrInvalidValue)
	}
	if err := api.Init(0); err != nil {
		return nil, fmt.Errorf("vmm: cuInit: %w", err)
	}
	v, err := api.DriverGetVersion()
	if err != nil {
		return nil, fmt.Errorf("vmm: cuDriverGetVersion: %w", err)
	}
	n, err := api.DeviceGetCount()
	if err != nil {
		return nil, fmt.Errorf("vmm: cuDeviceGetCount: %w", err)
	}
	s := &System{api: api, version: v, count: n, devices: make([]*Device, n)}
	s.own.Init(nil, "system")
	lifetime.Track(s, &s.own)
	return s, nil
}

// DriverVersion is cuDriverGetVersion's answer, for example 13000 for CUDA 13.0.
func (s *System) DriverVersion() int { return s.version }

// DeviceCount is the number of devices the driver reports.
func (s *System) DeviceCount() int { return s.count }

// OpenedDevices lists, in order, the ordinals of the devices opened in s (Device, Devices): those
// whose primary contexts s holds, and so those where registered and cuMemHostAlloc memory is
// visible and costs page tables (Stats).
func (s *System) OpenedDevices() []int {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []int
	for i, d := range s.devices {
		if d != nil {
			out = append(out, i)
		}
	}
	return out
}

// Device opens device ordinal (retaining its primary context) or returns the one already open.
func (s *System) Device(ordinal int) (*Device, error) {
	if s == nil {
		return nil, fmt.Errorf("vmm: device %d: nil System: %w", ordinal, ErrClosed)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.own.IsClosed() {
		return nil, fmt.Errorf("vmm: device %d: %w", ordinal, ErrClosed)
	}
	if ordinal < 0 || ordinal >= s.count {
		return nil, fmt.Errorf("vmm: device %d out of range (the driver reports %d devices): %w", ordinal, s.count, ErrNoDevice)
	}
	if d := s.devices[ordinal]; d != nil {
		return d, nil
	}
	d, err := openDevice(s, ordinal)
	if err != nil {
		return nil, err
	}
	s.devices[ordinal] = d
	return d, nil
}

// Devices opens every device, in ordinal order.
func (s *System) Devices() ([]*Device, error) {
	if s == nil {
		return nil, fmt.Errorf("vmm: devices: nil System: %w", ErrClosed)
	}
	out := make([]*Device, 0, s.count)
	for i := 0; i < s.count; i++ {
		d, err := s.Device(i)
		if err != nil {
			return nil, err
		}
		out = append(out, d)
	}
	return out, nil
}

// anyDevice is the device used to bind a context for calls that act on the unified address space
// rather than on one device (reserving addresses, importing handles): the lowest open ordinal, or
// device 0.
func (s *System) anyDevice() (*Device, error) {
	if s == nil {
		return nil, fmt.Errorf("vmm: nil System: %w", ErrClosed)
	}
	s.mu.Lock()
	for _, d := range s.devices {
		if d != nil {
			s.mu.Unlock()
			return d, nil
		}
	}
	s.mu.Unlock()
	return s.Device(0)
}

// Close releases the primary contexts of the open devices. It first retries the clean-ups that
// failed during undos (Orphans). It fails with ErrInUse, releasing nothing and naming what remains
// per device, while any device still owns allocations, reservations, streams or other objects, or
// while a failed clean-up still fails (so that it keeps a context to be retried with). A context
// whose release fails stays retained, its device refusing calls, and a later Close retries it.
// What is still owned is looked at first, at once: a Close that will fail does not wait for the
// calls in flight (a stream's Synchronize, say), nor make the calls of other goroutines wait behind
// it. Otherwise the calls in flight finish before the final check; later calls fail with ErrClosed.
func (s *System) Close() error {
	if s == nil {
		return nil
	}
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	s.mu.Lock()
	closed := s.own.IsClosed()
	s.mu.Unlock()
	if closed {
		return nil
	}
	retryErr := s.retryAdopted()
	s.mu.Lock()
	left := s.remaining()
	s.mu.Unlock()
	if left != "" {
		return s.stillOwned(left, retryErr)
	}
	s.gate.Lock()
	defer s.gate.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	if left := s.remaining(); left != "" || retryErr != nil {
		return s.stillOwned(left, retryErr)
	}
	retained, err := s.releaseDevices()
	if !retained {
		s.own.Lock()
		s.own.MarkClosed()
		s.own.Unlock()
	}
	return err
}

// stillOwned is Close's error while left (what the devices still own) or the retried clean-ups'
// failure retryErr keeps the System open.
func (s *System) stillOwned(left string, retryErr error) error {
	if left == "" {
		// Kept objects (Keep) have no device owner but still need a context to be freed.
		left = fmt.Sprintf("failed clean-ups %q", s.Orphans())
	}
	err := fmt.Errorf("vmm: close system: still owned: %s: %w", left, ErrInUse)
	if retryErr != nil {
		err = fmt.Errorf("%w (retrying failed clean-ups: %w)", err, retryErr)
	}
	return err
}

// releaseDevices releases the open devices' contexts; the caller holds the gate for writing and
// s.mu. A context whose release fails stays retained (retained: the System stays open) for Close
// to retry.
func (s *System) releaseDevices() (retained bool, err error) {
	var errs []error
	for _, d := range s.devices {
		if d == nil {
			continue
		}
		if err := d.release(); err != nil {
			errs = append(errs, err)
		}
		retained = retained || !d.ctxGone
	}
	return retained, errors.Join(errs...)
}

// bind runs fn on a locked OS thread with ctx current (the thread rule in the package doc).
func bind(api driver.API, ctx driver.Context, fn func(api driver.API) error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := api.CtxSetCurrent(ctx); err != nil {
		return fmt.Errorf("vmm: cuCtxSetCurrent: %w", err)
	}
	return fn(api)
}
