package main

// What the broker subcommand still shares with the former pinned subcommand.

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"github.com/cuvmm/cuvmm/internal/kernels"
	"github.com/cuvmm/cuvmm/vmm"
)

// pinList is a flag.Value: a comma-separated list of ordinals, or "all".
type pinList struct {
	all bool
	ids []int
}

func (l *pinList) String() string {
	if l.all || l.ids == nil {
		return "all"
	}
	s := make([]string, len(l.ids))
	for i, v := range l.ids {
		s[i] = strconv.Itoa(v)
	}
	return strings.Join(s, ",")
}

func (l *pinList) Set(v string) error {
	l.all, l.ids = false, nil
	if strings.TrimSpace(v) == "all" {
		l.all = true
		return nil
	}
	for _, f := range strings.Split(v, ",") {
		o, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || o < 0 {
			return fmt.Errorf("device %q: want a non-negative ordinal", f)
		}
		l.ids = append(l.ids, o)
	}
	return nil
}

// pinLockedWriter serialises the writes of several workers' output copiers.
type pinLockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *pinLockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func pinFree(devs []*vmm.Device) ([]uint64, error) {
	out := make([]uint64, len(devs))
	for i, d := range devs {
		if err := d.Synchronize(); err != nil {
			return nil, err
		}
		var err error
		if out[i], _, err = d.MemInfo(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// pinFreeHeld is pinFree for the devices held, by ordinal; devices not held read 0 (a process
// without a context on a device adds nothing to it).
func pinFreeHeld(count int, held []*vmm.Device) ([]uint64, error) {
	free, err := pinFree(held)
	if err != nil {
		return nil, err
	}
	out := make([]uint64, count)
	for i, d := range held {
		out[d.Ordinal()] = free[i]
	}
	return out, nil
}

func pinWords(b []byte) []uint64 {
	if len(b) < 8 {
		return nil
	}
	return unsafeWords(b)
}

func pinFillCPU(b []byte, off, seed uint64) {
	for i := range pinWords(b) {
		pinWords(b)[i] = kernels.Pattern(off/8+uint64(i), seed)
	}
}

func pinMiB(n int64) string { return fmt.Sprintf("%.2f MiB", float64(n)/float64(1<<20)) }

// unsafeWords views b (8-byte aligned, length at least 8) as 64-bit words.
func unsafeWords(b []byte) []uint64 { return unsafe.Slice((*uint64)(unsafe.Pointer(&b[0])), len(b)/8) }
