package broker_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/pinned/broker"
	"github.com/cuvmm/cuvmm/vmm"
)

// A broker owns one pinned region and copies between it and the device memory of its workers. Here
// the broker and one worker share a process and a simulator; in a service they are separate
// processes, and the worker's view of the region costs it no GPU memory.
func Example() {
	ctx := context.Background()
	s := sim.New()
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)

	// The broker.
	region, err := pinned.New(dev, 64<<20, pinned.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer region.Close()
	dir, _ := os.MkdirTemp("", "broker-example-") // private: mode 0700
	defer os.RemoveAll(dir)
	srv, err := broker.Listen(region, filepath.Join(dir, "broker.sock"), broker.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve() }()

	// A worker: a device buffer whose chunks can be exported, and the region seen by the CPU only.
	buf, _ := growbuf.New(dev, growbuf.Options{MaxSize: 64 << 20, HandleTypes: driver.HandleTypePosixFD})
	defer buf.Close()
	_ = buf.Grow(4 << 20)
	c, err := broker.Dial(srv.Path())
	if err != nil {
		fmt.Println(err)
		return
	}
	view, _ := c.Region(ctx, dev, pinned.OpenOptions{}) // no grant: the CPU alone
	reg, _ := c.Register(ctx, buf)
	copy(view.Bytes()[1<<20:], "through the broker")
	err = c.Copy(ctx, broker.Request{Buffer: reg.ID(), Dir: broker.ToDevice, HostOffset: 1 << 20, Length: 4 << 20})
	out := make([]byte, 18)
	_ = dev.CopyDtoH(out, buf.Ptr())
	fmt.Printf("%v: %q\n", err, out)

	_ = reg.Close()
	_ = view.Close()
	_ = c.Close()
	_ = srv.Close()
	fmt.Println("served:", <-served)
	// Output:
	// <nil>: "through the broker"
	// served: <nil>
}
