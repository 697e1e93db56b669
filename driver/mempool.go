package driver

// MemPool is a CUmemoryPool: the driver's stream-ordered allocator behind cuMemAllocAsync.
type MemPool uintptr

// MemPoolAttribute is a CUmemPool_attribute.
type MemPoolAttribute int32

// Memory pool attributes (CUmemPool_attribute). The first three are C ints (0 or 1); the others are
// cuuint64_t.
const (
	// MemPoolReuseFollowEventDependencies lets the pool reuse memory freed on another stream when
	// the allocating stream already waits on the freeing stream's work.
	MemPoolReuseFollowEventDependencies MemPoolAttribute = 1
	// MemPoolReuseAllowOpportunistic lets the pool reuse memory whose free has already completed.
	MemPoolReuseAllowOpportunistic MemPoolAttribute = 2
	// MemPoolReuseAllowInternalDependencies lets the pool insert dependencies to reuse memory.
	MemPoolReuseAllowInternalDependencies MemPoolAttribute = 3
	// MemPoolReleaseThreshold is how much reserved memory the pool keeps cached at a
	// synchronization point before it releases the rest to the system (default 0).
	MemPoolReleaseThreshold MemPoolAttribute = 4
	// MemPoolReservedMemCurrent is the memory the pool holds from the system now.
	MemPoolReservedMemCurrent MemPoolAttribute = 5
	// MemPoolReservedMemHigh is the high-water mark of ReservedMemCurrent; setting it to 0 resets it.
	MemPoolReservedMemHigh MemPoolAttribute = 6
	// MemPoolUsedMemCurrent is the memory handed out to callers now.
	MemPoolUsedMemCurrent MemPoolAttribute = 7
	// MemPoolUsedMemHigh is the high-water mark of UsedMemCurrent; setting it to 0 resets it.
	MemPoolUsedMemHigh MemPoolAttribute = 8
)
