package measure

import (
	"cmp"

	"github.com/cuvmm/cuvmm/offload"
)

// setOptions are the offload options of the run's set (without its progress callback).
func (o *SleepOptions) setOptions() offload.Options {
	first, _ := offload.ParseFirstSleep(cmp.Or(o.FirstSleep, "auto")) // check refused others
	return offload.Options{SlotSize: o.SlotSize, IOWorkers: o.IOWorkers, FilePart: o.FilePart, FileBuffers: o.FileBuffers, FirstSleep: first}
}

// fileStaging is the set's staging on each device in file mode (offload.PlanFileStaging): the
// goroutines, and how many buffers each has. The raw file figures move bytes the same way.
func (o *SleepOptions) fileStaging() (goroutines int, perGoroutine []int) {
	p := offload.PlanFileStaging(o.setOptions(), o.Size, o.Chunk)
	return p.Goroutines, p.Buffers
}
