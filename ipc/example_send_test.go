package ipc_test

import (
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// examplePair is a connected pair of Unix sockets, as a parent gives a child process it starts.
func examplePair() (*net.UnixConn, *net.UnixConn) {
	fds, _ := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "socketpair")
		defer f.Close()
		c, _ := net.FileConn(f)
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

// Without a server: Export a growable buffer (every chunk as a file descriptor), Send it over a
// connected socket, Receive and Open it on the other side.
func ExampleSend() {
	s := sim.New()
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)

	buf, _ := growbuf.New(dev, growbuf.Options{MaxSize: 1 << 30, HandleTypes: driver.HandleTypePosixFD})
	defer buf.Close()
	_ = buf.Grow(6 << 20)
	_ = dev.Fill(buf.Ptr(), buf.Len(), 0, 3)

	a, b := examplePair()
	defer a.Close()
	defer b.Close()
	exp, err := ipc.Export(buf)
	if err != nil {
		fmt.Println(err)
		return
	}
	go func() {
		_ = ipc.Send(a, exp)
		_ = exp.Close() // the receiver has its own descriptors
	}()

	rcv, err := ipc.Receive(b)
	if err != nil {
		fmt.Println(err)
		return
	}
	shared, err := ipc.Open(dev, rcv, vmm.ReadOnly(dev))
	_ = rcv.Close()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer shared.Close()
	bad, _ := dev.Verify(shared.Ptr(), buf.Len(), 0, 3)
	fmt.Printf("%d chunks, %d MiB mapped at another address: %v, mismatches: %d\n",
		len(shared.Chunks()), shared.Descriptor().Size>>20, shared.Ptr() != buf.Ptr(), bad)
	// Output:
	// 3 chunks, 8 MiB mapped at another address: true, mismatches: 0
}
