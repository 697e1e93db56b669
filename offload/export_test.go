package offload

import "github.com/cuvmm/cuvmm/vmm"

// BusyDevices lists the devices whose queued copies may still read the backup of tag (entry.busy).
func BusyDevices(s *Set, tag string) []*vmm.Device {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.find(tag); e != nil {
		return append([]*vmm.Device(nil), e.busy...)
	}
	return nil
}
