package pattern

import (
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/kernels"
)

// LaunchVerify queues the verify kernel over n words at ptr on stream s without waiting: it adds
// the number of words that differ from the pattern to the uint64 at counter. Not waiting is what
// lets a stream capture record it into a graph.
func (k *Kernels) LaunchVerify(api driver.API, s driver.Stream, ptr driver.DevicePtr, n, firstWord, seed uint64, counter driver.DevicePtr) error {
	if err := api.LaunchKernel(k.verify, k.grid(n), block, 0, s, uint64(ptr), n, firstWord, seed, uint64(counter)); err != nil {
		return fmt.Errorf("cuLaunchKernel(%s): %w", kernels.Verify, err)
	}
	return nil
}
