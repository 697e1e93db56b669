package pool_test

import (
	"context"
	"fmt"

	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/pool"
	"github.com/cuvmm/cuvmm/vmm"
)

// A pool on a simulated GPU: blocks come from pages mapped on demand, a freed block is reused at
// once on its stream, and when the free memory is scattered a large request is served by stitching
// idle pages into one range instead of failing.
func Example() {
	s := sim.New(sim.MemoryPerDevice(1 << 30))
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)

	p, err := pool.New(dev, pool.Options{Limit: 16 << 20, HighWater: ^uint64(0)})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer p.Close()
	stream, _ := dev.NewStream(true)
	defer stream.Close()

	// Eight 2 MiB blocks fill the limit; free every other one.
	var blocks, keep []*pool.Block
	for i := 0; i < 8; i++ {
		b, _ := p.Alloc(2<<20, stream)
		blocks = append(blocks, b)
	}
	for i, b := range blocks {
		if i%2 == 0 {
			_ = p.Free(b, stream)
		} else {
			keep = append(keep, b)
		}
	}
	// 8 MiB are free but no two free pages are adjacent: the pool stitches them.
	big, err := p.AllocTag(8<<20, stream, "scratch")
	if err != nil {
		fmt.Println(err)
		return
	}
	st := p.Stats()
	fmt.Printf("mapped %d MiB, allocated %d MiB, stitches %d, new pages %d\n", st.Mapped>>20, st.Allocated>>20, st.Stitches, st.NewPages)

	_ = p.Free(big, stream)
	for _, b := range keep {
		_ = p.Free(b, stream)
	}
	released, _ := p.Trim()
	fmt.Printf("trim released %d MiB\n", released>>20)
	// Output:
	// mapped 16 MiB, allocated 16 MiB, stitches 1, new pages 8
	// trim released 16 MiB
}

// A service that sleeps its GPU memory (package offload) adds the pool's mapped pages to a set: the
// set gives the memory back to the driver and restores it at the same offsets, so every live block
// keeps its address and its content.
func ExamplePool_Chunked() {
	s := sim.New(sim.MemoryPerDevice(1 << 30))
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)
	p, _ := pool.New(dev, pool.Options{Limit: 256 << 20})
	defer p.Close()
	stream, _ := dev.NewStream(true)
	defer stream.Close()

	kv, _ := p.AllocTag(48<<20, stream, "kv")
	_ = dev.Fill(kv.Ptr, kv.Size, 0, 5)
	addr := kv.Ptr

	set := offload.NewSet(sys, offload.Options{SlotSize: 16 << 20})
	defer set.Close()
	_ = set.Add("pool", p.Chunked(), offload.Keep, offload.EntryOptions{})
	ctx := context.Background()
	before, _, _ := dev.MemInfo()
	fmt.Println("sleep:", set.Sleep(ctx))
	after, _, _ := dev.MemInfo()
	fmt.Println("pool mapped MiB:", p.Stats().Mapped>>20, "freed MiB:", (after-before)>>20, "(less the backup's page tables)")
	fmt.Println("wake:", set.Wake(ctx))
	bad, _ := dev.Verify(kv.Ptr, kv.Size, 0, 5)
	fmt.Println("same address:", kv.Ptr == addr, "words changed:", bad)
	_ = set.Remove("pool")
	fmt.Println("free:", p.Free(kv, stream))
	// Output:
	// sleep: <nil>
	// pool mapped MiB: 48 freed MiB: 47 (less the backup's page tables)
	// wake: <nil>
	// same address: true words changed: 0
	// free: <nil>
}
