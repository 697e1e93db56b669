package sim_test

import (
	"errors"
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/vmm"
)

// Code written against driver.API runs on the simulator: here two simulated H200s under package vmm.
// Live counts what is still allocated, which is how tests check for leaks.
func Example() {
	s := sim.New(sim.Devices(2))
	defer s.Close()
	sys, _ := vmm.Open(s)
	dev, _ := sys.Device(1)
	fmt.Println(sys.DeviceCount(), "devices;", dev.Name())

	res, _ := sys.Reserve(4<<20, vmm.ReserveOptions{})
	m, _ := res.MapNew(0, 4<<20, dev, vmm.AllocOptions{}, vmm.ReadWrite(dev))
	_ = dev.Fill(m.Ptr(), m.Size(), 0, 7)
	bad, _ := dev.Verify(m.Ptr(), m.Size(), 0, 7)
	l := s.Live() // also counts what Fill loaded: the pattern kernels, their scratch memory and stream
	fmt.Println("mismatches:", bad, "allocations:", l.Allocations, "reservations:", l.Reservations, "mappings:", l.Mappings)

	_ = m.Close()
	_ = res.Close()
	_ = sys.Close()
	fmt.Println("after Close:", s.Live(), s.Live().Zero())
	// Output:
	// 2 devices; Simulated H200 (cuvmm sim)
	// mismatches: 0 allocations: 1 reservations: 1 mappings: 1
	// after Close: none true
}

// FailNth makes the n-th call of a driver function fail, to test undo paths: here cuMemSetAccess
// fails inside MapNew, which then unmaps and releases what it made, leaving nothing behind.
func ExampleSim_FailNth() {
	s := sim.New()
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)
	res, _ := sys.Reserve(2<<20, vmm.ReserveOptions{})
	defer res.Close()

	s.FailNth("cuMemSetAccess", 1, driver.ErrorOutOfMemory)
	_, err := res.MapNew(0, 2<<20, dev, vmm.AllocOptions{}, vmm.ReadWrite(dev))
	fmt.Println(errors.Is(err, driver.ErrOutOfMemory))
	fmt.Println("calls:", s.Calls("cuMemCreate"), s.Calls("cuMemMap"), s.Calls("cuMemUnmap"), s.Calls("cuMemRelease"))
	l := s.Live()
	fmt.Println("allocations:", l.Allocations, "mappings:", l.Mappings, "reservations:", l.Reservations)
	// Output:
	// true
	// calls: 1 1 1 1
	// allocations: 0 mappings: 0 reservations: 1
}
