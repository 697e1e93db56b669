//go:build !cgo || !linux

package nccl

import (
	"fmt"
	"runtime"
)

// EnvLibrary names the environment variable with a path to libnccl.so.2.
const EnvLibrary = "CUVMM_NCCL_LIBRARY"

var errNoLoader = fmt.Errorf("nccl: this binary was built without cgo or not for Linux (%s/%s), so libnccl.so.2 cannot be loaded: %w",
	runtime.GOOS, runtime.GOARCH, ErrNoNCCL)

// Open would load libnccl.so.2; in this build it always fails with an error wrapping ErrNoNCCL.
func Open() (API, error) { return nil, errNoLoader }

// OpenLibrary would load the library at path; in this build it always fails with ErrNoNCCL.
func OpenLibrary(path string) (API, error) { return nil, errNoLoader }

func cLayout() map[string]int64 { return nil }

func configSize() int64 { return 0 }
