package stripe_test

import (
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/stripe"
	"github.com/cuvmm/cuvmm/vmm"
)

// One range of 64 MiB over two (simulated) GPUs in 8 MiB stripes: each GPU writes its own stripes,
// and each reads the whole range.
func ExampleNew() {
	s := sim.New(sim.Devices(2))
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	d0, _ := sys.Device(0)
	d1, _ := sys.Device(1)

	r, err := stripe.New([]*vmm.Device{d0, d1}, 60<<20, stripe.Interleaved{Stripe: 8 << 20}, stripe.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer r.Close()
	owner, _ := r.Owner(20 << 20)
	fmt.Println("size:", r.Size()>>20, "MiB; the byte at 20 MiB is on device", owner.Ordinal())
	for _, d := range r.Devices() {
		for _, seg := range r.Segments(d) {
			_ = d.Fill(r.Ptr()+driver.DevicePtr(seg.Offset), seg.Size, seg.Offset, 1)
		}
	}
	for _, d := range r.Devices() {
		bad, _ := d.Verify(r.Ptr(), r.Size(), 0, 1)
		fmt.Printf("device %d: %d segments, %d wrong words in the whole range\n", d.Ordinal(), len(r.Segments(d)), bad)
	}
	// Output:
	// size: 60 MiB; the byte at 20 MiB is on device 0
	// device 0: 4 segments, 0 wrong words in the whole range
	// device 1: 4 segments, 0 wrong words in the whole range
}
