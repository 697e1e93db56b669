package ipc_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// A server publishes a buffer of four chunks; a client fetches and maps it. Here both sides run in
// one process on two simulators; in a real service they are two processes.
func Example() {
	// The exporting side.
	s1 := sim.New()
	defer s1.Close()
	sys1, _ := vmm.Open(s1)
	defer sys1.Close()
	dev1, _ := sys1.Device(0)
	res, _ := sys1.Reserve(8<<20, vmm.ReserveOptions{})
	types, _ := ipc.HandleTypes(dev1, driver.Location{})
	for off := uint64(0); off < 8<<20; off += 2 << 20 {
		if _, err := res.MapNew(off, 2<<20, dev1, vmm.AllocOptions{HandleTypes: types}, vmm.ReadWrite(dev1)); err != nil {
			fmt.Println(err)
			return
		}
	}
	_ = dev1.Fill(res.Ptr(), 8<<20, 0, 42)

	dir, _ := os.MkdirTemp("", "ipc-example-") // private: mode 0700
	defer os.RemoveAll(dir)
	srv, err := ipc.Listen(filepath.Join(dir, "weights.sock"), ipc.ServerOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}
	_ = srv.Publish("weights", ipc.FromReservation(res))
	go srv.Serve()

	// The importing side.
	s2 := sim.New()
	defer s2.Close()
	sys2, _ := vmm.Open(s2)
	defer sys2.Close()
	dev2, _ := sys2.Device(0)
	c, _ := ipc.Dial(srv.Path())
	buf, err := c.Open(dev2, "weights", vmm.ReadOnly(dev2))
	if err != nil {
		fmt.Println(err)
		return
	}
	_, err = c.Fetch("biases")
	fmt.Println("biases:", errors.Is(err, ipc.ErrNotFound))
	c.Close()

	// The exporter unpublishes and frees its memory; the importer's mapping stays valid.
	_ = srv.Close()
	_ = res.UnmapRange(0, 8<<20)
	_ = res.Close()
	bad, _ := dev2.Verify(buf.Ptr(), buf.Len(), 0, 42)
	fmt.Printf("%s with handle type %s: %d mismatches\n", buf.Descriptor().String(), types, bad)
	_ = buf.Close()
	// Output:
	// biases: true
	// buffer weights of 8 MiB in 4 chunks with handle type posix-fd: 0 mismatches
}
