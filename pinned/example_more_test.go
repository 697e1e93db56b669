package pinned_test

import (
	"context"
	"fmt"

	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// A pool hands out pinned buffers carved from one region made once: Get and Put cost nothing in the
// driver, and the copies run at pinned speed.
func ExampleCreatePool() {
	s := sim.New()
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)

	pool, err := pinned.CreatePool(dev, 1<<20, 4, pinned.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	res, _ := sys.Reserve(2<<20, vmm.ReserveOptions{})
	defer res.Close()
	m, _ := res.MapNew(0, 2<<20, dev, vmm.AllocOptions{}, vmm.ReadWrite(dev))
	defer m.Close()

	buf, _ := pool.Get(context.Background())
	copy(buf.Bytes(), "pinned")
	_ = dev.Copy(m.Ptr(), buf.Ptr(), buf.Len()) // host to device through the buffer's device address
	_ = pool.Put(buf)
	back, _ := pool.Get(context.Background())
	_ = dev.Copy(back.Ptr(), m.Ptr(), 6)
	fmt.Printf("%s; %d buffers of %d KiB; in use: %d\n", back.Bytes()[:6], pool.Len(), pool.BufferSize()>>10, pool.Stats().InUse)
	_ = pool.Put(back)
	// Output:
	// pinned; 4 buffers of 1024 KiB; in use: 1
}

// Memory the program already owns is pinned in place with Register (cuMemHostRegister): visible to
// every device where the process holds a context, so it costs page tables on each.
func ExampleRegister() {
	s := sim.New(sim.Devices(2))
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)

	mem, _ := pinned.MapAnonymous(64 << 20) // page-aligned, not Go heap memory
	defer pinned.Unmap(mem)
	r, err := pinned.Register(dev, mem, pinned.RegisterOptions{HugePages: true})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(r.Kind(), r.Len()>>20, "MiB, page tables per device:", r.PageTableCost())
	_, _ = sys.Device(1) // a context on device 1 too: the registration reaches it, and costs there
	fmt.Println("with device 1 opened:", r.PageTableCost())
	_, err = pinned.Register(dev, mem, pinned.RegisterOptions{})
	fmt.Println("twice:", err != nil)
	_ = r.Close()
	// Output:
	// registered 64 MiB, page tables per device: [131072 0]
	// with device 1 opened: [131072 131072]
	// twice: true
}
