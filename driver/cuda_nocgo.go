//go:build !cgo || !linux

package driver

import (
	"fmt"
	"runtime"
)

// errNoLoader explains why no library can be loaded in this build: the loader is written with cgo
// for Linux. The simulator (package sim) still works.
var errNoLoader = fmt.Errorf("driver: this binary was built without cgo or not for Linux (%s/%s), so libcuda.so.1 cannot be loaded: %w",
	runtime.GOOS, runtime.GOARCH, ErrNoDriver)

// Open would load libcuda.so.1; in this build it always fails with an error wrapping ErrNoDriver.
func Open() (API, error) { return nil, errNoLoader }

// OpenLibrary would load the driver library at path; in this build it always fails with an error
// wrapping ErrNoDriver.
func OpenLibrary(path string) (API, error) { return nil, errNoLoader }

// cLayout has no C declarations to report in this build.
func cLayout() map[string]int64 { return nil }
