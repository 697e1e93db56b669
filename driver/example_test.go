package driver_test

import (
	"errors"
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
)

// A driver error is a Result; errors.Is matches it against the sentinel of its family, so callers
// need not know the code. Higher layers wrap it with what they were doing.
func ExampleResult() {
	err := fmt.Errorf("vmm: create 2 MiB: %w", driver.ErrorOutOfMemory)
	fmt.Println(errors.Is(err, driver.ErrOutOfMemory), errors.Is(err, driver.ErrInvalidValue))
	var r driver.Result
	if errors.As(err, &r) {
		fmt.Println(r.Name(), int(r))
	}
	fmt.Println(driver.Check(0) == nil, errors.Is(driver.Check(801), driver.ErrNotSupported))
	// Output:
	// true false
	// CUDA_ERROR_OUT_OF_MEMORY 2
	// true true
}

// Locations name where memory lives and who gets access.
func ExampleLocation() {
	fmt.Println(driver.DeviceLocation(1))
	fmt.Println(driver.HostNUMALocation(0))
	fmt.Println(driver.HostLocation())
	// Output:
	// device 1
	// host NUMA node 0
	// host
}
