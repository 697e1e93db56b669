package offload_test

import (
	"context"
	"fmt"

	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/vmm"
)

// A buffer sleeps: its GPU memory goes back to the driver, its content to pinned host memory; it
// wakes at the same address with the same bytes. On a GPU host, open driver.Open() instead of the
// simulator.
func Example() {
	s := sim.New(sim.MemoryPerDevice(1 << 30))
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)

	weights, _ := growbuf.New(dev, growbuf.Options{MaxSize: 1 << 30, Chunk: growbuf.FixedChunks(16 << 20)})
	defer weights.Close()
	_ = weights.Grow(64 << 20)
	_ = dev.Fill(weights.Ptr(), 64<<20, 0, 42)
	ptr := weights.Ptr()

	set := offload.NewSet(sys, offload.Options{SlotSize: 32 << 20})
	defer set.Close()
	_ = set.Add("weights", weights, offload.Keep, offload.EntryOptions{})

	ctx := context.Background()
	before, _, _ := dev.MemInfo()
	fmt.Println("sleep:", set.Sleep(ctx))
	after, _, _ := dev.MemInfo()
	fmt.Println("freed MiB:", (after-before)>>20, "(64 MiB less the backup's page tables)")

	fmt.Println("wake:", set.Wake(ctx))
	bad, _ := dev.Verify(ptr, 64<<20, 0, 42)
	fmt.Println("same address:", weights.Ptr() == ptr, "words changed:", bad)
	// Output:
	// sleep: <nil>
	// freed MiB: 63 (64 MiB less the backup's page tables)
	// wake: <nil>
	// same address: true words changed: 0
}
