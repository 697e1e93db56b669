package offload

import (
	"errors"

	"github.com/cuvmm/cuvmm/vmm"
)

// Sentinel errors. ErrInvalidValue and ErrClosed are vmm's, so one errors.Is covers every layer.
var (
	// ErrInvalidValue: a bad argument (nil buffer, empty or duplicate tag, unknown tag, a buffer of
	// another System, a File policy without a file).
	ErrInvalidValue = vmm.ErrInvalidValue
	// ErrClosed: use of a closed Set, or of a buffer closed while asleep.
	ErrClosed = vmm.ErrClosed
	// ErrExported: Sleep of a buffer exported to other processes without EntryOptions.Force.
	ErrExported = vmm.ErrExported
	// ErrBadCheckpoint: a checkpoint that is truncated, corrupted (a checksum mismatch), foreign (not
	// a cuvmm offload checkpoint) or of a different layout than the set it is restored into.
	ErrBadCheckpoint = errors.New("offload: bad checkpoint")
	// ErrAsleep: an operation that needs a buffer awake on a sleeping entry: Remove and Restore, and
	// Save of a sleeping Discard or File buffer (a sleeping Keep buffer saves from its backup).
	ErrAsleep = vmm.ErrAsleep
)
