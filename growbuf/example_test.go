package growbuf_test

import (
	"fmt"

	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/vmm"
)

// A buffer grows in place: its address stays, the bytes already written stay where they are, and
// memory is never held twice. With the default geometric policy the capacity doubles, in chunks of
// up to 256 MiB.
func Example() {
	s := sim.New()
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)

	buf, err := growbuf.New(dev, growbuf.Options{MaxSize: 1 << 30})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer buf.Close()
	_ = buf.Grow(3 << 20)
	ptr := buf.Ptr()
	_ = dev.Fill(ptr, buf.Len(), 0, 9) // a kernel writes the first 3 MiB
	fmt.Printf("len %d MiB, cap %d MiB in %d chunks\n", buf.Len()>>20, buf.Cap()>>20, len(buf.Chunks()))

	_ = buf.Grow(100 << 20)
	bad, _ := dev.Verify(ptr, 3<<20, 0, 9)
	fmt.Printf("len %d MiB, cap %d MiB in %d chunks; same address: %v; first 3 MiB intact: %v\n",
		buf.Len()>>20, buf.Cap()>>20, len(buf.Chunks()), buf.Ptr() == ptr, bad == 0)

	_ = buf.Shrink(10 << 20) // waits for queued work, then releases whole chunks past 10 MiB
	fmt.Printf("len %d MiB, cap %d MiB\n", buf.Len()>>20, buf.Cap()>>20)
	// Output:
	// len 3 MiB, cap 4 MiB in 2 chunks
	// len 100 MiB, cap 128 MiB in 7 chunks; same address: true; first 3 MiB intact: true
	// len 10 MiB, cap 16 MiB
}

// With fixed chunks the capacity follows the length exactly when the buffer grows by whole chunks.
func ExampleFixedChunks() {
	s := sim.New()
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)

	buf, _ := growbuf.New(dev, growbuf.Options{MaxSize: 256 << 20, Chunk: growbuf.FixedChunks(8 << 20)})
	defer buf.Close()
	for i := 1; i <= 3; i++ {
		_ = buf.Grow(uint64(i) * 8 << 20)
		fmt.Println(buf.Len()>>20, buf.Cap()>>20, len(buf.Chunks()))
	}
	_, err := growbuf.New(dev, growbuf.Options{Chunk: growbuf.FixedChunks(3 << 20)})
	fmt.Println(err != nil)
	// Output:
	// 8 8 1
	// 16 16 2
	// 24 24 3
	// true
}
