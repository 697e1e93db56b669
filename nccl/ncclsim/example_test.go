package ncclsim_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/nccl"
	"github.com/cuvmm/cuvmm/nccl/ncclsim"
	"github.com/cuvmm/cuvmm/vmm"
)

// The stand-in can play an older NCCL, so that a program's handling of a missing feature is tested
// without the old library: here NCCL 2.18, which predates user buffer registration (2.19). Live
// shows that nothing is left once the communicator is closed.
func ExampleVersion() {
	drv := sim.New(sim.Devices(1))
	defer drv.Close()
	sys, _ := vmm.Open(drv)
	defer sys.Close()
	dev, _ := sys.Device(0)
	lib := ncclsim.New(drv, ncclsim.Version(21800))

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	id, _ := lib.GetUniqueID()
	comm, err := nccl.NewComm(ctx, lib, id, 0, 1, dev)
	if err != nil {
		fmt.Println("new comm:", err)
		return
	}
	buf, _ := growbuf.New(dev, growbuf.Options{MaxSize: 1 << 30})
	_ = buf.Grow(4 << 20)
	_, err = comm.Register(ctx, buf)
	fmt.Println("register on NCCL 2.18 is unsupported:", errors.Is(err, nccl.ErrNotSupported))
	fmt.Println("close:", comm.Close(), buf.Close())
	fmt.Println("nothing left:", lib.Live().Zero())
	// Output:
	// register on NCCL 2.18 is unsupported: true
	// close: <nil> <nil>
	// nothing left: true
}
