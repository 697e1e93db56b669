package measure_test

import (
	"errors"
	"fmt"

	"github.com/cuvmm/cuvmm/measure"
)

// Grow on the simulator: grow a buffer to 16 MiB in 4 MiB steps, verified after each step, against
// realloc-and-copy. The times are the simulator's; the result's JSON is `vmmdemo grow --json`'s.
func ExampleGrow() {
	b, err := measure.OpenSim(1)
	if err != nil {
		panic(err)
	}
	defer b.Close()
	res, err := measure.Grow(measure.GrowOptions{Env: measure.Env{Backend: b}, To: 16 << 20, Step: 4 << 20})
	if err != nil {
		panic(err)
	}
	fmt.Println(res.Steps, "steps,", res.ChunkPolicy, "chunks, verified:", res.Verified)
	fmt.Println("growbuf peak", res.GrowbufPeakBytes>>20, "MiB, realloc peak", res.ReallocPeakBytes>>20, "MiB")

	// Options are checked before anything is allocated.
	_, err = measure.Grow(measure.GrowOptions{Env: measure.Env{Backend: b}, To: 16 << 20, Step: 3})
	fmt.Println(errors.Is(err, measure.ErrInvalidOption))
	// Output:
	// 4 steps, fixed 4 MiB chunks, verified: true
	// growbuf peak 16 MiB, realloc peak 28 MiB
	// true
}
