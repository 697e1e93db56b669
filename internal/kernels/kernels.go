// Package kernels holds the project's GPU kernels as PTX text (compiled from kernels.cu beside it with
// `make ptx` where nvcc exists) and the Go definition of the data pattern they write and check.
package kernels

import _ "embed"

// PTX is kernels.cu compiled for compute_75 (the driver JIT-compiles it for the device at load).
//
//go:embed kernels.ptx
var PTX []byte

// Entry points in PTX. Every parameter is a 64-bit value.
const (
	// Fill(ptr, nwords, firstWord, seed) writes Pattern(firstWord+i, seed) to word i.
	Fill = "cuvmm_fill"
	// Verify(ptr, nwords, firstWord, seed, counterPtr) adds the number of mismatching words to the
	// uint64 at counterPtr.
	Verify = "cuvmm_verify"
	// Read(ptr, nwords, sinkPtr) reads every word with 16-byte loads (nwords even, ptr 16-byte
	// aligned); used for bandwidth.
	Read = "cuvmm_read"
)

// WordSize is the size of one pattern word in bytes.
const WordSize = 8

// Pattern is the value of the 64-bit word with global index w under seed.
func Pattern(w, seed uint64) uint64 { return ((w + 1) * 0x9E3779B97F4A7C15) ^ seed }
