package sim

import (
	"sort"
	"sync"

	"golang.org/x/sys/unix"
)

// The simulated virtual address space.
//
// The driver hands out device addresses from a large range of the process's address space it keeps
// for itself, with room between reservations: that is why a reservation with hint = end of an existing
// one of 64 MiB or more is granted in place (measured). Reservations under 32 MiB are another matter:
// the driver packs them into 32 MiB blocks of its heap and refuses an extension at their end (measured:
// never granted after a 2 MiB reservation), so the simulator does not take a hint at the end of a
// reservation under smallBlock and places the range elsewhere, as the driver does. A plain mmap cannot reproduce that, because the kernel places
// mappings top-down, right against the previous ones. So the simulator keeps an arena: one PROT_NONE,
// MAP_NORESERVE mapping (address space only, no memory) shared by every simulator of the process, as
// the driver's range is shared by its contexts. Reservations up to a quarter of the arena are placed in
// it in the middle of its largest free gap, which leaves every reservation room to grow. Larger ones,
// and any that do not fit, are mmapped directly; a hint outside the arena is honored with
// MAP_FIXED_NOREPLACE when that range is free.

// arenaSize is the address space of the arena: large enough that growth room is never the limit, small
// enough that a 64 TiB reservation still fits beside it (the address space is 128 TiB).
const arenaSize = uint64(4) << 40

// smallBlock is the size of the blocks of the driver's address heap that hold reservations smaller
// than it: a hint at the end of such a reservation is not taken (docs/driver-facts.md, section 5).
// Between 32 and 64 MiB nothing was measured; the simulator extends those as it does larger ones.
const smallBlock = uint64(32) << 20

type vrange struct{ base, size uint64 }

func (r vrange) end() uint64 { return r.base + r.size }

var arena struct {
	sync.Mutex
	tried      bool
	base, size uint64   // 0 when the arena could not be mapped
	used       []vrange // reservations in the arena, of all simulators, sorted
}

// setupArena maps the arena once.
func setupArena() {
	if arena.tried {
		return
	}
	arena.tried = true
	p, err := mmap(0, uintptr(arenaSize), unix.PROT_NONE, reserveFlags, -1, 0)
	if err != nil {
		return
	}
	// Keep the arena aligned to 1 GiB so that large alignments are cheap.
	const g = 1 << 30
	base := roundUp(uint64(p), g)
	_ = munmap(p, base-uint64(p))
	arena.base, arena.size = base, arenaSize-(base-uint64(p))
}

func inArena(base, size uint64) bool {
	return arena.size != 0 && base >= arena.base && base+size <= arena.base+arena.size && base+size > base
}

// arenaFree reports whether [base, base+size) overlaps no reservation of the arena.
func arenaFree(base, size uint64) bool {
	i := sort.Search(len(arena.used), func(i int) bool { return arena.used[i].end() > base })
	return i == len(arena.used) || arena.used[i].base >= base+size
}

// endsSmall reports whether addr is the end of a reservation of the arena smaller than smallBlock.
func endsSmall(addr uint64) bool {
	i := sort.Search(len(arena.used), func(i int) bool { return arena.used[i].end() >= addr })
	return i < len(arena.used) && arena.used[i].end() == addr && arena.used[i].size < smallBlock
}

func arenaTake(base, size uint64) {
	arena.used = insertSorted(arena.used, vrange{base, size}, func(r vrange) uint64 { return r.base })
}

// arenaPlace finds room for size bytes aligned to align: in the middle of the largest gap that can
// hold it (at the start of the arena when it is empty), else 0.
func arenaPlace(size, align uint64) uint64 {
	best, bestGap := uint64(0), uint64(0)
	prev := arena.base
	consider := func(g0, g1 uint64, first bool) {
		if g1 <= g0 || g1-g0 < size {
			return
		}
		at := roundUp(g0, align)
		if !first {
			at = roundUp(g0+(g1-g0-size)/2, align)
		}
		if at+size > g1 {
			at = roundUp(g0, align)
			if at+size > g1 {
				return
			}
		}
		if g1-g0 > bestGap {
			best, bestGap = at, g1-g0
		}
	}
	for i, r := range arena.used {
		consider(prev, r.base, i == 0)
		prev = r.end()
	}
	consider(prev, arena.base+arena.size, len(arena.used) == 0)
	return best
}

// reserveVA finds size bytes of address space aligned to align, at hint when that range is free
// (a hint that is taken is only a hint, unless exact), and makes it inaccessible. A hint at the end
// of a reservation under smallBlock is not taken either. ok=false means no address space, or with
// exact, none at the hint.
func reserveVA(size, align, hint uint64, exact bool) (uint64, bool) {
	arena.Lock()
	defer arena.Unlock()
	setupArena()
	asked := hint
	if endsSmall(hint) {
		hint = 0
	}
	if hint != 0 && hint%align == 0 && hint+size > hint {
		if inArena(hint, size) {
			if arenaFree(hint, size) {
				arenaTake(hint, size)
				return hint, true
			}
		} else if !overlapsArena(hint, size) {
			p, err := mmap(uintptr(hint), uintptr(size), unix.PROT_NONE, reserveFlags|unix.MAP_FIXED_NOREPLACE, -1, 0)
			if err == nil {
				if uint64(p) == hint {
					return hint, true
				}
				_ = munmap(p, size) // a kernel without MAP_FIXED_NOREPLACE took it as a plain hint
			}
		}
	}
	if exact && asked != 0 {
		return 0, false
	}
	if arena.size != 0 && size <= arena.size/4 {
		if at := arenaPlace(size, align); at != 0 {
			arenaTake(at, size)
			return at, true
		}
	}
	total := size + align
	if total < size {
		return 0, false
	}
	p, err := mmap(0, uintptr(total), unix.PROT_NONE, reserveFlags, -1, 0)
	if err != nil {
		return 0, false
	}
	base := roundUp(uint64(p), align)
	_ = munmap(p, base-uint64(p))
	_ = munmap(uintptr(base+size), uint64(p)+total-(base+size))
	return base, true
}

func overlapsArena(base, size uint64) bool {
	return arena.size != 0 && base < arena.base+arena.size && base+size > arena.base
}

// releaseVA gives a range from reserveVA back: inaccessible arena space again, or unmapped.
func releaseVA(base, size uint64) error {
	arena.Lock()
	defer arena.Unlock()
	if inArena(base, size) {
		for i, r := range arena.used {
			if r.base == base {
				arena.used = append(arena.used[:i], arena.used[i+1:]...)
				break
			}
		}
		return protectNone(uintptr(base), size)
	}
	return munmap(uintptr(base), size)
}
