package vmm

import (
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
)

// Query reports whether the work captured by the event's last Record has completed, without waiting
// (cuEventQuery). An event never recorded counts as complete.
func (e *Event) Query() (bool, error) {
	end, err := e.begin("query")
	if err != nil {
		return false, err
	}
	defer end()
	var done bool
	if err := e.dev.do(func(api driver.API) error {
		var err error
		done, err = api.EventQuery(e.e)
		return err
	}); err != nil {
		return false, fmt.Errorf("vmm: device %d: cuEventQuery: %w", e.dev.ordinal, err)
	}
	return done, nil
}

// WaitEvent makes work queued on s from now on wait until e's last Record has completed, without
// blocking the caller (cuStreamWaitEvent). s nil is the legacy default stream.
func (s *Stream) WaitEvent(e *Event) error {
	end, err := s.begin("wait for event")
	if err != nil {
		return err
	}
	defer end()
	endE, err := e.begin("wait for event")
	if err != nil {
		return err
	}
	defer endE()
	if err := e.dev.do(func(api driver.API) error { return api.StreamWaitEvent(s.Handle(), e.e, 0) }); err != nil {
		return fmt.Errorf("vmm: device %d: cuStreamWaitEvent: %w", e.dev.ordinal, err)
	}
	return nil
}
