// Package hostmem faults host memory in before it is pinned.
//
// The kernel zeroes a fresh page in the thread that first touches it, so memory about to be
// registered with the driver is faulted in from several threads first. While registrations run
// beside it, how makes a difference: madvise(MADV_POPULATE_WRITE) works under the process's
// address-space lock (mmap_lock), which every populating thread and every cuMemHostRegister then
// share, while a write fault on the page itself is handled under the lock of its mapping alone
// (per-VMA locks, Linux 6.4+). On the two-GPU H200 host (Linux 6.18, 32 cores), offload's first
// sleep of 16 GiB, which pins while it copies, took 0.55-0.56 s with faults against 0.82-0.91 s with
// MADV_POPULATE_WRITE, alternated in new processes of one machine; its pages were faulted in within
// 0.20-0.25 s instead of 0.40-0.59 s. Populating first and registering after (pinned.Register) gained
// nothing: 0.91-1.09 s for 16 GiB either way.
package hostmem

import (
	"sync/atomic"
	"unsafe"
)

// PageSize is the smallest page the faults step over.
const PageSize = 4096

// FaultIn faults every page of mem in for writing, from the calling goroutine, without changing a
// byte: it adds zero atomically to one aligned 32-bit word of each page, which stays correct while
// other threads write the same memory. A page of mem with no whole aligned word in it (only at
// mem's ends) is read instead. mem must be mapped writable.
func FaultIn(mem []byte) {
	if len(mem) == 0 {
		return
	}
	base := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
	end := base + uintptr(len(mem))
	for page := base &^ (PageSize - 1); page < end; page += PageSize {
		word := (max(page, base) + 3) &^ 3
		if word+4 <= end && word+4 <= page+PageSize {
			atomic.AddUint32((*uint32)(unsafe.Pointer(&mem[word-base])), 0)
			continue
		}
		sink.Add(uint32(mem[max(page, base)-base]))
	}
}

// ReadIn faults every page of mem in for reading, from the calling goroutine, by reading a byte of
// each; it writes nothing, so mem may be mapped read-only. mem starts on a page.
func ReadIn(mem []byte) {
	var sum byte
	for p := 0; p < len(mem); p += PageSize {
		sum += mem[p]
	}
	sink.Add(uint32(sum))
}

// sink keeps the reads of FaultIn and ReadIn from being optimised away.
var sink atomic.Uint32
