package pool

import "math/rand/v2"

// SyntheticServing makes the allocation trace of an inference server, at a nominal scale of about
// 65 GiB at its peak (Scale sizes it to a device): long-lived weights (large tensors and small biases),
// fixed-size KV blocks of 32 MiB that requests take as they are admitted and as their context grows and
// give back when they finish, activations of varying size for every batch step, small scratch buffers,
// and an occasional large workspace of 1 to 3 GiB. Requests and steps use four streams. The same seed
// gives the same trace.
func SyntheticServing(seed uint64) *Trace {
	const (
		mib      = 1 << 20
		gib      = 1 << 30
		kvBlock  = 32 * mib
		kvCap    = 28 * gib / kvBlock
		steps    = 800
		nStreams = 4
	)
	r := rand.New(rand.NewPCG(seed, 0x5e7))
	var tl timeline
	for i := 0; i < 48; i++ {
		tl.alloc(uint64(200*mib+r.IntN(1000*mib)), 0, "weights")
		tl.alloc(uint64(64<<10+r.IntN(448<<10)), 0, "weights")
	}
	type request struct {
		blocks []int
		left   int
	}
	var reqs []*request
	kvUsed, nextReq := 0, 0
	var scratch []int
	for step := 0; step < steps; step++ {
		st := step % nStreams
		// Admit requests while their prompt fits in the KV budget.
		for len(reqs) < 64 {
			prompt := 1 + r.IntN(16)
			if kvUsed+prompt > kvCap {
				break
			}
			q := &request{left: 20 + r.IntN(180)}
			for b := 0; b < prompt; b++ {
				q.blocks = append(q.blocks, tl.alloc(kvBlock, nextReq%nStreams, "kv"))
			}
			kvUsed += prompt
			nextReq++
			reqs = append(reqs, q)
		}
		// Activations and small buffers of this step.
		var stepBlocks []int
		for a := 0; a < 3+r.IntN(4); a++ {
			stepBlocks = append(stepBlocks, tl.alloc(uint64(4*mib+r.IntN(252*mib)), st, "act"))
		}
		for a := 0; a < 5; a++ {
			stepBlocks = append(stepBlocks, tl.alloc(uint64(1<<10+r.IntN(511<<10)), st, "small"))
		}
		if step%40 == 39 {
			scratch = append(scratch, tl.alloc(uint64(gib+r.IntN(2*gib)), st, "scratch"))
		} else if step%40 == 1 && len(scratch) > 0 {
			for _, id := range scratch {
				tl.free(id)
			}
			scratch = scratch[:0]
		}
		// Requests grow by a block now and then, or finish and give their blocks back.
		kept := reqs[:0]
		for _, q := range reqs {
			q.left--
			if q.left <= 0 {
				for _, id := range q.blocks {
					tl.free(id)
				}
				kvUsed -= len(q.blocks)
				continue
			}
			if r.IntN(8) == 0 && kvUsed < kvCap {
				q.blocks = append(q.blocks, tl.alloc(kvBlock, st, "kv"))
				kvUsed++
			}
			kept = append(kept, q)
		}
		reqs = kept
		for _, id := range stepBlocks {
			tl.free(id)
		}
	}
	return &Trace{Events: tl.events}
}

// timeline builds a trace from allocations and frees in the order they happen.
type timeline struct{ events []TraceEvent }

func (t *timeline) alloc(size uint64, stream int, tag string) int {
	t.events = append(t.events, TraceEvent{Size: size, Stream: stream, Lifetime: -1, Tag: tag})
	return len(t.events) - 1
}

// free frees block id before the next allocation.
func (t *timeline) free(id int) { t.events[id].Lifetime = len(t.events) - id - 1 }
