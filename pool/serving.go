package pool

import "math/rand/v2"

// The shape of SyntheticServing's server, at nominal scale.
const (
	servMiB      = 1 << 20
	servGiB      = 1 << 30
	servKVBlock  = 32 * servMiB
	servKVCap    = 28 * servGiB / servKVBlock // KV blocks the server may hold
	servSteps    = 800
	servStreams  = 4
	servMaxBatch = 64 // requests in flight
)

// SyntheticServing makes the allocation trace of an inference server, at a nominal scale of about
// 65 GiB at its peak (Scale sizes it to a device): long-lived weights (large tensors and small biases),
// fixed-size KV blocks of 32 MiB that requests take as they are admitted and as their context grows and
// give back when they finish, activations of varying size for every batch step, small scratch buffers,
// and an occasional large workspace of 1 to 3 GiB. Requests and steps use four streams. The same seed
// gives the same trace.
func SyntheticServing(seed uint64) *Trace {
	g := &server{r: rand.New(rand.NewPCG(seed, 0x5e7))}
	for i := 0; i < 48; i++ {
		g.alloc(uint64(200*servMiB+g.r.IntN(1000*servMiB)), 0, "weights")
		g.alloc(uint64(64<<10+g.r.IntN(448<<10)), 0, "weights")
	}
	for step := 0; step < servSteps; step++ {
		g.step(step)
	}
	return &Trace{Events: g.events}
}

// server generates SyntheticServing's trace.
type server struct {
	timeline
	r       *rand.Rand
	reqs    []*servRequest
	kvUsed  int
	nextReq int
	scratch []int
}

type servRequest struct {
	blocks []int // the KV blocks held
	left   int   // steps until the request finishes
}

// step is one batch step: admit requests, allocate the step's buffers, grow or finish requests, free
// the step's buffers.
func (g *server) step(step int) {
	st := step % servStreams
	g.admit()
	var bufs []int
	for a := 0; a < 3+g.r.IntN(4); a++ {
		bufs = append(bufs, g.alloc(uint64(4*servMiB+g.r.IntN(252*servMiB)), st, "act"))
	}
	for a := 0; a < 5; a++ {
		bufs = append(bufs, g.alloc(uint64(1<<10+g.r.IntN(511<<10)), st, "small"))
	}
	if step%40 == 39 {
		g.scratch = append(g.scratch, g.alloc(uint64(servGiB+g.r.IntN(2*servGiB)), st, "scratch"))
	} else if step%40 == 1 && len(g.scratch) > 0 {
		for _, id := range g.scratch {
			g.free(id)
		}
		g.scratch = g.scratch[:0]
	}
	g.advance(st)
	for _, id := range bufs {
		g.free(id)
	}
}

// admit takes new requests while their prompt's KV blocks fit in the budget.
func (g *server) admit() {
	for len(g.reqs) < servMaxBatch {
		prompt := 1 + g.r.IntN(16)
		if g.kvUsed+prompt > servKVCap {
			return
		}
		q := &servRequest{left: 20 + g.r.IntN(180)}
		for b := 0; b < prompt; b++ {
			q.blocks = append(q.blocks, g.alloc(servKVBlock, g.nextReq%servStreams, "kv"))
		}
		g.kvUsed += prompt
		g.nextReq++
		g.reqs = append(g.reqs, q)
	}
}

// advance grows requests by a KV block now and then, and finishes those whose time is up.
func (g *server) advance(st int) {
	kept := g.reqs[:0]
	for _, q := range g.reqs {
		q.left--
		if q.left <= 0 {
			for _, id := range q.blocks {
				g.free(id)
			}
			g.kvUsed -= len(q.blocks)
			continue
		}
		if g.r.IntN(8) == 0 && g.kvUsed < servKVCap {
			q.blocks = append(q.blocks, g.alloc(servKVBlock, st, "kv"))
			g.kvUsed++
		}
		kept = append(kept, q)
	}
	g.reqs = kept
}

// timeline builds a trace from allocations and frees in the order they happen.
type timeline struct{ events []TraceEvent }

func (t *timeline) alloc(size uint64, stream int, tag string) int {
	t.events = append(t.events, TraceEvent{Size: size, Stream: stream, Lifetime: -1, Tag: tag})
	return len(t.events) - 1
}

// free frees block id before the next allocation.
func (t *timeline) free(id int) { t.events[id].Lifetime = len(t.events) - id - 1 }
