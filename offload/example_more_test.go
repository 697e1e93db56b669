package offload_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/vmm"
)

// A wake that finds the memory taken fails with an error wrapping driver.ErrOutOfMemory and leaves
// the buffer asleep, its backup intact: once the memory is free again, the same Wake succeeds.
func ExampleSet_Wake_outOfMemory() {
	s := sim.New(sim.MemoryPerDevice(256 << 20))
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)

	kv, _ := growbuf.New(dev, growbuf.Options{MaxSize: 1 << 30, Chunk: growbuf.FixedChunks(16 << 20)})
	defer kv.Close()
	_ = kv.Grow(128 << 20)
	_ = dev.Fill(kv.Ptr(), 128<<20, 0, 7)

	set := offload.NewSet(sys, offload.Options{SlotSize: 32 << 20})
	defer set.Close()
	_ = set.Add("kv", kv, offload.Keep, offload.EntryOptions{})
	ctx := context.Background()
	_ = set.Sleep(ctx)

	other, err := dev.Allocate(192<<20, vmm.AllocOptions{}) // another job takes the memory
	fmt.Println("other job allocated:", err == nil)
	err = set.Wake(ctx)
	fmt.Println("wake out of memory:", errors.Is(err, driver.ErrOutOfMemory), "still asleep:", set.Asleep("kv"))

	_ = other.Close() // the other job is done
	fmt.Println("wake again:", set.Wake(ctx))
	bad, _ := dev.Verify(kv.Ptr(), 128<<20, 0, 7)
	fmt.Println("words changed:", bad)
	// Output:
	// other job allocated: true
	// wake out of memory: true still asleep: true
	// wake again: <nil>
	// words changed: 0
}

// A File buffer sleeps into a file (any io.ReaderAt and io.WriterAt) instead of pinned memory, and
// wakes from it. Its parts pass through pinned staging slots, which the set pools for the next
// sleep or wake until TrimPool gives them back.
func ExampleSet_Add_file() {
	s := sim.New(sim.MemoryPerDevice(1 << 30))
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)

	buf, _ := growbuf.New(dev, growbuf.Options{MaxSize: 1 << 30, Chunk: growbuf.FixedChunks(16 << 20)})
	defer buf.Close()
	_ = buf.Grow(64 << 20)
	_ = dev.Fill(buf.Ptr(), 64<<20, 0, 3)

	f, _ := os.CreateTemp("", "offload-example-*.bin")
	defer os.Remove(f.Name())
	defer f.Close()

	set := offload.NewSet(sys, offload.Options{SlotSize: 32 << 20})
	defer set.Close()
	_ = set.Add("activations", buf, offload.File, offload.EntryOptions{File: f})
	ctx := context.Background()
	fmt.Println("sleep:", set.Sleep(ctx))
	st, _ := f.Stat()
	fmt.Println("file MiB:", st.Size()>>20, "pinned staging pooled, MiB:", set.BackupBytes()>>20)
	_ = set.TrimPool() // a sleeping File buffer needs no pinned memory
	fmt.Println("pinned after TrimPool:", set.BackupBytes())
	fmt.Println("wake:", set.Wake(ctx))
	bad, _ := dev.Verify(buf.Ptr(), 64<<20, 0, 3)
	fmt.Println("words changed:", bad)
	// Output:
	// sleep: <nil>
	// file MiB: 64 pinned staging pooled, MiB: 64
	// pinned after TrimPool: 0
	// wake: <nil>
	// words changed: 0
}

// A checkpoint written by Save is loaded by another process with Load, which recreates the buffers
// at the saved addresses where the driver grants them. Here the first buffer is closed first, so
// its address is free again.
func ExampleLoad() {
	s := sim.New(sim.MemoryPerDevice(1 << 30))
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)
	ctx := context.Background()

	weights, _ := growbuf.New(dev, growbuf.Options{MaxSize: 256 << 20, Chunk: growbuf.FixedChunks(16 << 20)})
	_ = weights.Grow(32 << 20)
	_ = dev.Fill(weights.Ptr(), 32<<20, 0, 9)
	saved := weights.Ptr()
	set := offload.NewSet(sys, offload.Options{})
	_ = set.Add("weights", weights, offload.Keep, offload.EntryOptions{})
	var ckpt bytes.Buffer
	fmt.Println("save:", set.Save(ctx, &ckpt))
	_ = set.Close()
	_ = weights.Close()

	loaded, bufs, err := offload.Load(ctx, sys, &ckpt, offload.Options{})
	fmt.Println("load:", err, "buffers:", len(bufs), "tag:", bufs[0].Tag())
	bad, _ := dev.Verify(bufs[0].Ptr(), 32<<20, 0, 9)
	fmt.Println("same address:", bufs[0].Ptr() == saved, "moved:", bufs[0].Moved(), "words changed:", bad)
	_ = loaded.Close()
	_ = bufs[0].Close()
	// Output:
	// save: <nil>
	// load: <nil> buffers: 1 tag: weights
	// same address: true moved: false words changed: 0
}
