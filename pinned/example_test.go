package pinned_test

import (
	"bytes"
	"context"
	"fmt"

	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// A pinned region, its page-table cost per device, and a transfer from the device to an io.Writer
// through a stager. On a GPU host, open driver.Open() instead of the simulator.
func Example() {
	s := sim.New(sim.Devices(2))
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)

	// Host-NUMA where supported: visible to device 0 only, so device 1 pays nothing.
	r, _ := pinned.New(dev, 1<<30, pinned.Options{})
	fmt.Println(r.Kind(), r.Len()>>20, "MiB, page tables per device:", r.PageTableCost())
	copy(r.Bytes(), "hello from the CPU")
	_ = r.Close()

	// Device memory out to a writer, through two pinned buffers on a copy stream.
	res, _ := sys.Reserve(4<<20, vmm.ReserveOptions{})
	m, _ := res.MapNew(0, 4<<20, dev, vmm.AllocOptions{}, vmm.ReadWrite(dev))
	_ = dev.Memset(m.Ptr(), 'x', 4<<20)
	st, _ := pinned.NewStager(dev, pinned.StagerOptions{BufferSize: 1 << 20})
	var out bytes.Buffer
	n, err := st.DeviceToWriter(context.Background(), &out, m.Ptr(), 4<<20)
	fmt.Println(n, err, out.String()[:3])
	_ = st.Close()
	_ = m.Close()
	_ = res.Close()
	// Output:
	// host-numa 1024 MiB, page tables per device: [2097152 0]
	// 4194304 <nil> xxx
}
