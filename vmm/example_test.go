package vmm_test

import (
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/vmm"
)

// Reserve addresses, back them with physical memory, grant access, and share the memory as a file
// descriptor that another process (here the same one) imports and maps at a second address. On a GPU
// host, open driver.Open() instead of the simulator.
func Example() {
	s := sim.New()
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)

	res, _ := sys.Reserve(64<<20, vmm.ReserveOptions{}) // addresses only, no memory yet
	defer res.Close()
	alloc, err := dev.Allocate(3<<20, vmm.AllocOptions{HandleTypes: driver.HandleTypePosixFD})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer alloc.Close()
	fmt.Println("allocated", alloc.Size()>>20, "MiB") // rounded up to the 2 MiB granularity
	m, _ := res.MapAccess(0, alloc, vmm.ReadWrite(dev))
	defer m.Close()
	_ = dev.Fill(m.Ptr(), m.Size(), 0, 1)

	f, _ := alloc.Export(driver.HandleTypePosixFD) // an *os.File: send it over a Unix socket
	imp, _ := dev.Import(f, alloc.Size(), driver.HandleTypePosixFD)
	_ = f.Close()
	defer imp.Close()
	res2, _ := sys.Reserve(imp.Size(), vmm.ReserveOptions{})
	defer res2.Close()
	m2, _ := res2.MapAccess(0, imp, vmm.ReadOnly(dev))
	defer m2.Close()
	bad, _ := dev.Verify(m2.Ptr(), m2.Size(), 0, 1)
	fmt.Println("same bytes at a second address:", m2.Ptr() != m.Ptr(), bad == 0)
	// Output:
	// allocated 4 MiB
	// same bytes at a second address: true true
}

// Stats is a snapshot of what the System holds and of the driver calls it made; package metrics
// exports it to Prometheus.
func ExampleSystem_Stats() {
	s := sim.New(sim.Devices(2))
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)

	res, _ := sys.Reserve(16<<20, vmm.ReserveOptions{})
	defer res.Close()
	res.SetKind("weights")
	m, _ := res.MapNew(0, 8<<20, dev, vmm.AllocOptions{}, vmm.ReadWrite(dev))
	defer m.Close()
	host, _ := dev.HostAlloc(1<<30, driver.HostAllocPortable)
	defer host.Close()

	st := sys.Stats()
	d := st.Devices[0]
	fmt.Println("reserved", d.ReservedBytes>>20, "MiB; mapped", d.MappedByKind["weights"]>>20, "MiB of weights")
	fmt.Println("pinned host", st.Host.PinnedBytes>>20, "MiB; page tables on device 0:", d.PageTableBytes>>20, "MiB")
	fmt.Println("device 1 opened:", st.Devices[1].Opened, "page tables there:", st.Devices[1].PageTableBytes)
	fmt.Println("cuMemCreate calls:", d.Ops[vmm.OpCreate].Calls, "bytes:", d.Ops[vmm.OpCreate].Bytes>>20, "MiB")
	// Output:
	// reserved 16 MiB; mapped 8 MiB of weights
	// pinned host 1024 MiB; page tables on device 0: 2 MiB
	// device 1 opened: false page tables there: 0
	// cuMemCreate calls: 1 bytes: 8 MiB
}
