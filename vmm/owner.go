package vmm

import (
	"fmt"
	"sync"

	"github.com/cuvmm/cuvmm/driver"
)

// owner is the close-once state of the simple owning types (streams, events, plain and host buffers,
// host registrations): one driver object freed by one call, counted as a child of its device.
type owner struct {
	dev    *Device
	mu     sync.Mutex
	closed bool
}

// use reports ErrClosed, naming op, once the owner is closed.
func (o *owner) use(op string) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return fmt.Errorf("vmm: %s: %w", op, ErrClosed)
	}
	return nil
}

// close frees the object with free (run with the device's context bound) the first time it succeeds;
// what names the object in the error. A failed free leaves the owner open so Close can be retried.
func (o *owner) close(what string, free func(api driver.API) error) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return nil
	}
	if err := o.dev.do(free); err != nil {
		return fmt.Errorf("vmm: device %d: free %s: %w", o.dev.ordinal, what, err)
	}
	o.closed = true
	o.dev.children.Add(-1)
	return nil
}
