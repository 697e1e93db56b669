// Package pattern is the project's data pattern in one place: the GPU kernels that write and check it
// (loaded from internal/kernels' PTX into a context, launched on a stream) and the CPU reference that
// writes and checks the same words in host memory. Package vmm's Device.Fill and Device.Verify use
// the kernels; tests and commands use the CPU reference.
package pattern

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/kernels"
)

// WordSize is the size of one pattern word in bytes.
const WordSize = kernels.WordSize

// Word is the value of the 64-bit word with global index w under seed.
func Word(w, seed uint64) uint64 { return kernels.Pattern(w, seed) }

// FillHost writes the pattern into b (a whole number of words), which starts off bytes into the
// pattern (off a multiple of WordSize).
func FillHost(b []byte, off, seed uint64) {
	first := off / WordSize
	for i := 0; i+WordSize <= len(b); i += WordSize {
		binary.LittleEndian.PutUint64(b[i:], Word(first+uint64(i/WordSize), seed))
	}
}

// CountHost counts the words of b that differ from the pattern FillHost writes with the same off and
// seed: the CPU reference of the Verify kernel.
func CountHost(b []byte, off, seed uint64) uint64 {
	first := off / WordSize
	var bad uint64
	for i := 0; i+WordSize <= len(b); i += WordSize {
		if binary.LittleEndian.Uint64(b[i:]) != Word(first+uint64(i/WordSize), seed) {
			bad++
		}
	}
	return bad
}

// Check validates a kernel range: address, size and pattern offset non-zero multiples of WordSize
// (the offset may be 0). It returns a description of the problem, or "" when the range is good.
func Check(ptr driver.DevicePtr, size, off uint64) string {
	if size == 0 || size%WordSize != 0 || uint64(ptr)%WordSize != 0 || off%WordSize != 0 {
		return "address, size and offset must be non-zero multiples of 8"
	}
	return ""
}

// Threads is the block size of every launch.
const Threads = 256

// Kernels is the kernel module loaded into one context. Its methods take the driver API with that
// context current; they are safe for concurrent use with distinct Lanes.
type Kernels struct {
	module             driver.Module
	fill, verify, read driver.Function
	blocks             uint32 // grid size cap for grid-stride kernels
}

// Load loads the module into the current context. multiprocessors sizes the grids (8 blocks each).
func Load(api driver.API, multiprocessors int) (*Kernels, error) {
	k := &Kernels{blocks: uint32(max(multiprocessors, 1)) * 8}
	var err error
	if k.module, err = api.ModuleLoadData(kernels.PTX); err != nil {
		return nil, fmt.Errorf("cuModuleLoadData: %w", err)
	}
	for name, f := range map[string]*driver.Function{kernels.Fill: &k.fill, kernels.Verify: &k.verify, kernels.Read: &k.read} {
		if *f, err = api.ModuleGetFunction(k.module, name); err != nil {
			err = fmt.Errorf("cuModuleGetFunction(%s): %w", name, err)
			if uerr := api.ModuleUnload(k.module); uerr != nil {
				err = errors.Join(err, fmt.Errorf("undo cuModuleLoadData: %w", uerr))
			}
			return nil, err
		}
	}
	return k, nil
}

// Unload unloads the module (cuModuleUnload).
func (k *Kernels) Unload(api driver.API) error {
	if err := api.ModuleUnload(k.module); err != nil {
		return fmt.Errorf("cuModuleUnload: %w", err)
	}
	return nil
}

func (k *Kernels) grid(n uint64) driver.Dim3 {
	b := (n + Threads - 1) / Threads
	b = min(max(b, 1), uint64(k.blocks))
	return driver.Dim3{X: uint32(b), Y: 1, Z: 1}
}

var block = driver.Dim3{X: Threads, Y: 1, Z: 1}

// Lane is what one pattern check needs for itself: a stream and an 8-byte device counter. Checks on
// distinct lanes run concurrently.
type Lane struct {
	Stream     driver.Stream
	Counter    driver.DevicePtr
	ownCounter bool // Counter came from cuMemAlloc for this lane
}

// NewLane creates a lane in the current context (cuStreamCreate) whose counter is the 8 bytes at
// counter, or, when counter is 0, a cuMemAlloc of its own.
func NewLane(api driver.API, counter driver.DevicePtr) (*Lane, error) {
	s, err := api.StreamCreate(driver.StreamDefault)
	if err != nil {
		return nil, fmt.Errorf("cuStreamCreate: %w", err)
	}
	if counter != 0 {
		return &Lane{Stream: s, Counter: counter}, nil
	}
	c, err := api.MemAlloc(WordSize)
	if err != nil {
		err = fmt.Errorf("cuMemAlloc for the mismatch counter: %w", err)
		if derr := api.StreamDestroy(s); derr != nil {
			err = errors.Join(err, fmt.Errorf("undo cuStreamCreate: %w", derr))
		}
		return nil, err
	}
	return &Lane{Stream: s, Counter: c, ownCounter: true}, nil
}

// OwnsCounter reports whether the lane's counter is an allocation of its own (freed with the lane)
// rather than a word of a buffer its caller keeps.
func (l *Lane) OwnsCounter() bool { return l.ownCounter }

// Free frees the lane's stream and its own counter.
func (l *Lane) Free(api driver.API) error {
	err := api.StreamDestroy(l.Stream)
	if l.ownCounter {
		err = errors.Join(err, api.MemFree(l.Counter))
	}
	return err
}

// Fill writes the pattern over n words at ptr (first word firstWord) on the lane's stream and waits
// for it.
func (k *Kernels) Fill(api driver.API, l *Lane, ptr driver.DevicePtr, n, firstWord, seed uint64) error {
	if err := api.LaunchKernel(k.fill, k.grid(n), block, 0, l.Stream, uint64(ptr), n, firstWord, seed); err != nil {
		return fmt.Errorf("cuLaunchKernel(%s): %w", kernels.Fill, err)
	}
	if err := api.StreamSynchronize(l.Stream); err != nil {
		return fmt.Errorf("cuStreamSynchronize: %w", err)
	}
	return nil
}

// Verify counts the words of n at ptr that differ from the pattern, on the lane's stream.
func (k *Kernels) Verify(api driver.API, l *Lane, ptr driver.DevicePtr, n, firstWord, seed uint64) (uint64, error) {
	if err := api.MemsetD8Async(l.Counter, 0, WordSize, l.Stream); err != nil {
		return 0, fmt.Errorf("cuMemsetD8Async: %w", err)
	}
	if err := api.LaunchKernel(k.verify, k.grid(n), block, 0, l.Stream, uint64(ptr), n, firstWord, seed, uint64(l.Counter)); err != nil {
		return 0, fmt.Errorf("cuLaunchKernel(%s): %w", kernels.Verify, err)
	}
	if err := api.StreamSynchronize(l.Stream); err != nil {
		return 0, fmt.Errorf("cuStreamSynchronize: %w", err)
	}
	var out [WordSize]byte
	if err := api.MemcpyDtoH(unsafe.Pointer(&out[0]), l.Counter, WordSize); err != nil {
		return 0, fmt.Errorf("cuMemcpyDtoH of the counter: %w", err)
	}
	return binary.LittleEndian.Uint64(out[:]), nil
}

// Read queues the read kernel over n words at ptr on stream s, its sink at sink.
func (k *Kernels) Read(api driver.API, s driver.Stream, ptr driver.DevicePtr, n uint64, sink driver.DevicePtr) error {
	// One vector of 16 bytes per thread per iteration, four iterations unrolled.
	if err := api.LaunchKernel(k.read, k.grid(n/8), block, 0, s, uint64(ptr), n, uint64(sink)); err != nil {
		return fmt.Errorf("cuLaunchKernel(%s): %w", kernels.Read, err)
	}
	return nil
}
