package vmm

import (
	"slices"
	"sort"
	"sync"

	"github.com/cuvmm/cuvmm/driver"
)

// statsTable is the System's record of the driver objects alive, kept by countingAPI as calls
// succeed. Its zero value is ready; mu guards everything.
type statsTable struct {
	mu         sync.Mutex
	handles    map[driver.MemHandle]*handleInfo
	mapped     map[driver.DevicePtr]*mappedRange // by first address
	reserved   map[driver.DevicePtr]sized
	kinds      []kindRange // sorted by start, not overlapping
	registered map[uintptr]sized
	hostAllocs map[uintptr]sized
	plain      map[driver.DevicePtr]sized
	streams    map[driver.Stream]int
	events     map[driver.Event]int
}

// sized is an object's size and the ordinal of the device whose context made it.
type sized struct {
	size    uint64
	ordinal int
}

type handleInfo struct {
	size     uint64
	loc      driver.Location
	imported bool
	counted  bool // made by cuMemCreate: its size is in CreatedBytes / NUMACreatedBytes
	refs     int  // cuMemRetainAllocationHandle adds one; cuMemRelease removes one
	ordinal  int
}

type mappedRange struct {
	size    uint64
	loc     driver.Location
	kind    string // the reservation's mark, else base
	base    string // KindVMM, KindImported or KindUnknown
	ordinal int
	granted []int32 // CUdevice IDs with access
}

type kindRange struct {
	start, end driver.DevicePtr
	kind       string
}

func (t *statsTable) lock() {
	t.mu.Lock()
	if t.handles == nil {
		t.handles = map[driver.MemHandle]*handleInfo{}
		t.mapped = map[driver.DevicePtr]*mappedRange{}
		t.reserved = map[driver.DevicePtr]sized{}
		t.registered = map[uintptr]sized{}
		t.hostAllocs = map[uintptr]sized{}
		t.plain = map[driver.DevicePtr]sized{}
		t.streams = map[driver.Stream]int{}
		t.events = map[driver.Event]int{}
	}
}

func (t *statsTable) addHandle(h driver.MemHandle, info handleInfo) {
	t.lock()
	defer t.mu.Unlock()
	info.refs = 1
	t.handles[h] = &info
}

// setHandleLocation fills in an imported handle's location once its properties are read.
func (t *statsTable) setHandleLocation(h driver.MemHandle, loc driver.Location) {
	t.lock()
	defer t.mu.Unlock()
	if info := t.handles[h]; info != nil && info.imported {
		info.loc = loc
	}
}

// retain records cuMemRetainAllocationHandle(addr) = h.
func (t *statsTable) retain(h driver.MemHandle, addr driver.DevicePtr, ordinal int) {
	t.lock()
	defer t.mu.Unlock()
	if info := t.handles[h]; info != nil {
		info.refs++
		return
	}
	info := &handleInfo{refs: 1, ordinal: ordinal}
	if r := t.rangeAt(addr); r != nil {
		info.size, info.loc, info.imported = r.size, r.loc, r.base == KindImported
	}
	t.handles[h] = info
}

func (t *statsTable) release(h driver.MemHandle) {
	t.lock()
	defer t.mu.Unlock()
	if info := t.handles[h]; info != nil {
		if info.refs--; info.refs <= 0 {
			delete(t.handles, h)
		}
	}
}

// rangeAt finds the mapping containing addr; the caller holds mu.
func (t *statsTable) rangeAt(addr driver.DevicePtr) *mappedRange {
	for start, r := range t.mapped {
		if addr >= start && addr < start+driver.DevicePtr(r.size) {
			return r
		}
	}
	return nil
}

func (t *statsTable) kindAt(p driver.DevicePtr) string {
	i := sort.Search(len(t.kinds), func(i int) bool { return t.kinds[i].end > p })
	if i < len(t.kinds) && t.kinds[i].start <= p {
		return t.kinds[i].kind
	}
	return ""
}

func (t *statsTable) mapRange(ptr driver.DevicePtr, size uint64, h driver.MemHandle, ordinal int) {
	t.lock()
	defer t.mu.Unlock()
	r := &mappedRange{size: size, ordinal: ordinal, base: KindUnknown}
	if info := t.handles[h]; info != nil {
		r.loc, r.base = info.loc, KindVMM
		if info.imported {
			r.base = KindImported
		}
	}
	if r.kind = t.kindAt(ptr); r.kind == "" {
		r.kind = r.base
	}
	t.mapped[ptr] = r
}

// eachMapping calls fn for the mappings that make up [ptr, ptr+size) (the driver unmaps and sets
// access over whole mappings only); the caller holds mu.
func (t *statsTable) eachMapping(ptr driver.DevicePtr, size uint64, fn func(driver.DevicePtr, *mappedRange)) {
	end := ptr + driver.DevicePtr(size)
	for p := ptr; p < end; {
		r := t.mapped[p]
		if r == nil || r.size == 0 {
			return
		}
		fn(p, r)
		p += driver.DevicePtr(r.size)
	}
}

// unmap forgets the mappings in [ptr, ptr+size). A range over several may have gaps (a sleeping
// chunk, released in place, has no entry, and the mappings after it do), so it is searched whole;
// one mapping, the common case, is found at once.
func (t *statsTable) unmap(ptr driver.DevicePtr, size uint64) {
	t.lock()
	defer t.mu.Unlock()
	if r := t.mapped[ptr]; r != nil && r.size == size {
		delete(t.mapped, ptr)
		return
	}
	end := ptr + driver.DevicePtr(size)
	for p := range t.mapped {
		if p >= ptr && p < end {
			delete(t.mapped, p)
		}
	}
}

func (t *statsTable) setAccess(ptr driver.DevicePtr, size uint64, descs []driver.AccessDesc) {
	t.lock()
	defer t.mu.Unlock()
	t.eachMapping(ptr, size, func(_ driver.DevicePtr, r *mappedRange) {
		for _, d := range descs {
			if d.Location.Type != driver.LocationDevice {
				continue
			}
			i := slices.Index(r.granted, d.Location.ID)
			switch {
			case d.Flags == driver.AccessNone && i >= 0:
				r.granted = slices.Delete(r.granted, i, i+1)
			case d.Flags != driver.AccessNone && i < 0:
				r.granted = append(r.granted, d.Location.ID)
			}
		}
	})
}

func (t *statsTable) reserve(ptr driver.DevicePtr, size uint64, ordinal int) {
	t.lock()
	defer t.mu.Unlock()
	t.reserved[ptr] = sized{size, ordinal}
}

// freeAddress forgets a reservation and the kind marks inside it.
func (t *statsTable) freeAddress(ptr driver.DevicePtr, size uint64) {
	t.lock()
	defer t.mu.Unlock()
	delete(t.reserved, ptr)
	end := ptr + driver.DevicePtr(size)
	t.kinds = slices.DeleteFunc(t.kinds, func(k kindRange) bool { return k.start >= ptr && k.start < end })
}

func (t *statsTable) setKind(ptr driver.DevicePtr, size uint64, kind string) {
	t.lock()
	defer t.mu.Unlock()
	end := ptr + driver.DevicePtr(size)
	t.kinds = slices.DeleteFunc(t.kinds, func(k kindRange) bool { return k.start < end && k.end > ptr })
	if kind != "" {
		i := sort.Search(len(t.kinds), func(i int) bool { return t.kinds[i].start >= ptr })
		t.kinds = slices.Insert(t.kinds, i, kindRange{ptr, end, kind})
	}
	for p, r := range t.mapped {
		if p >= ptr && p < end {
			r.kind = kind
			if kind == "" {
				r.kind = r.base
			}
		}
	}
}

// sizedAdd and sizedDel keep a map of sized objects.
func sizedAdd[K comparable](t *statsTable, m func() map[K]sized, k K, size uint64, ordinal int) {
	t.lock()
	defer t.mu.Unlock()
	m()[k] = sized{size, ordinal}
}

func sizedDel[K comparable](t *statsTable, m func() map[K]sized, k K) {
	t.lock()
	defer t.mu.Unlock()
	delete(m(), k)
}

func (t *statsTable) addStream(s driver.Stream, ordinal int) {
	t.lock()
	defer t.mu.Unlock()
	t.streams[s] = ordinal
}

func (t *statsTable) delStream(s driver.Stream) {
	t.lock()
	defer t.mu.Unlock()
	delete(t.streams, s)
}

func (t *statsTable) addEvent(e driver.Event, ordinal int) {
	t.lock()
	defer t.mu.Unlock()
	t.events[e] = ordinal
}

func (t *statsTable) delEvent(e driver.Event) {
	t.lock()
	defer t.mu.Unlock()
	delete(t.events, e)
}

// fill adds the table's totals to st; ids maps CUdevice IDs to ordinals.
func (t *statsTable) fill(st *Stats, ids map[int32]int) {
	t.lock()
	defer t.mu.Unlock()
	f := filler{st: st, ids: ids}
	for _, r := range t.reserved {
		if d := f.dev(r.ordinal); d != nil {
			d.ReservedBytes += r.size
			d.Live.Reservations++
		}
	}
	for _, h := range t.handles {
		if d := f.dev(h.ordinal); d != nil {
			d.Live.Allocations++
		}
		if !h.counted {
			continue
		}
		if d := f.onDevice(h.loc); d != nil {
			d.CreatedBytes += h.size
		} else if isHost(h.loc) {
			st.Host.NUMACreatedBytes += h.size
		}
	}
	t.fillMapped(f)
	t.fillHost(st, f.dev)
}

// filler finds the DeviceStats that a figure belongs to.
type filler struct {
	st  *Stats
	ids map[int32]int // CUdevice to ordinal
}

// dev is the entry of a device ordinal, nil when out of range.
func (f filler) dev(ordinal int) *DeviceStats {
	if ordinal >= 0 && ordinal < len(f.st.Devices) {
		return &f.st.Devices[ordinal]
	}
	return nil
}

// onDevice is the entry of the device memory at loc lives on, nil for host memory.
func (f filler) onDevice(loc driver.Location) *DeviceStats {
	if loc.Type != driver.LocationDevice {
		return nil
	}
	if o, ok := f.ids[loc.ID]; ok {
		return f.dev(o)
	}
	return nil
}

func isHost(loc driver.Location) bool {
	return loc.Type == driver.LocationHostNUMA || loc.Type == driver.LocationHost || loc.Type == driver.LocationHostNUMACurrent
}

// fillMapped adds the mappings: device memory to its device, host memory to the host and to the
// devices granted access to it.
func (t *statsTable) fillMapped(f filler) {
	host := &f.st.Host
	host.NUMAMappedByKind = map[string]uint64{}
	for _, r := range t.mapped {
		if d := f.dev(r.ordinal); d != nil {
			d.Live.Mappings++
		}
		if d := f.onDevice(r.loc); d != nil {
			d.MappedBytes += r.size
			d.MappedByKind[r.kind] += r.size
			continue
		}
		if !isHost(r.loc) {
			continue
		}
		host.NUMAMappedBytes += r.size
		host.NUMAMappedByKind[r.kind] += r.size
		for _, id := range r.granted {
			if d := f.onDevice(driver.Location{Type: driver.LocationDevice, ID: id}); d != nil {
				d.HostVisibleBytes += r.size
			}
		}
	}
}

// fillHost adds registrations, cuMemHostAlloc buffers, cuMemAlloc buffers, streams and events.
func (t *statsTable) fillHost(st *Stats, dev func(int) *DeviceStats) {
	for _, r := range t.registered {
		st.Host.RegisteredBytes += r.size
		if d := dev(r.ordinal); d != nil {
			d.Live.Registrations++
		}
	}
	for _, r := range t.hostAllocs {
		st.Host.HostAllocBytes += r.size
		if d := dev(r.ordinal); d != nil {
			d.Live.HostBuffers++
		}
	}
	st.Host.PinnedBytes = st.Host.RegisteredBytes + st.Host.HostAllocBytes + st.Host.NUMACreatedBytes
	for i := range st.Devices {
		// Registered and cuMemHostAlloc memory is visible to every GPU where the process holds a
		// context (docs/driver-facts.md, section 5).
		if st.Devices[i].Opened {
			st.Devices[i].HostVisibleBytes += st.Host.RegisteredBytes + st.Host.HostAllocBytes
		}
	}
	for _, p := range t.plain {
		if d := dev(p.ordinal); d != nil {
			d.PlainBytes += p.size
			d.Live.PlainBuffers++
		}
	}
	for _, o := range t.streams {
		if d := dev(o); d != nil {
			d.Live.Streams++
		}
	}
	for _, o := range t.events {
		if d := dev(o); d != nil {
			d.Live.Events++
		}
	}
}
