package vmm

import "unsafe"

// ptrOf is the address of b's first byte (b non-empty), for synchronous copies into Go memory.
func ptrOf(b []byte) unsafe.Pointer { return unsafe.Pointer(&b[0]) }
