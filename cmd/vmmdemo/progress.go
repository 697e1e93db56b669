package main

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/measure"
)

// progress draws a one-line bar on stderr while long work runs. The command hands it to a
// measurement only when stderr is a terminal and the output is not JSON, so logs and pipes stay
// clean.
type progress struct {
	e     *env
	label string
	total uint64
	steps bool // counts steps, not bytes
	last  time.Time
	drawn bool
}

// Begin starts a bar of bytes (env is the measurements' measure.StepProgress).
func (e *env) Begin(label string, total uint64) measure.Bar {
	return &progress{e: e, label: label, total: total}
}

// BeginSteps starts a bar of steps, shown as counts.
func (e *env) BeginSteps(label string, total uint64) measure.Bar {
	return &progress{e: e, label: label, total: total, steps: true}
}

// amount is how the bar writes n: a count of steps, or a size.
func (p *progress) amount(n uint64) string {
	if p.steps {
		return strconv.FormatUint(n, 10)
	}
	return units.FormatSize(n)
}

// Update redraws the bar for done of total bytes, at most ten times a second.
func (p *progress) Update(done uint64) {
	if p.total == 0 || (time.Since(p.last) < 100*time.Millisecond && done < p.total) {
		return
	}
	p.last = time.Now()
	const width = 30
	frac := float64(done) / float64(p.total)
	frac = min(max(frac, 0), 1)
	n := int(frac * width)
	fmt.Fprintf(p.e.stderr, "\r%s [%s%s] %3.0f%% %s / %s ", p.label, strings.Repeat("#", n), strings.Repeat(".", width-n),
		frac*100, p.amount(done), p.amount(p.total))
	p.drawn = true
}

// Done clears the bar.
func (p *progress) Done() {
	if p.drawn {
		fmt.Fprintf(p.e.stderr, "\r%s\r", strings.Repeat(" ", len(p.label)+80))
		p.drawn = false
	}
}

var _ measure.StepProgress = (*env)(nil)
