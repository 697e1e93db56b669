package metrics

import (
	"maps"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cuvmm/cuvmm/offload"
)

// SetCollector is a prometheus.Collector over an offload set's statistics (offload.Set.Stats): its
// buffers asleep and awake, the pinned memory it holds, and its sleeps and wakes. It is safe for
// concurrent use, and a scrape never waits for a Sleep or Wake in progress.
type SetCollector struct {
	stats                                 func() offload.Stats
	bufBytes, bufAsleep                   *prometheus.Desc
	asleep, backup, pooled                *prometheus.Desc
	calls, failures, bytes, seconds, last *prometheus.Desc
	sleepStep, staged                     *prometheus.Desc
}

// NewSet returns a collector that reports set under the name given (the const label set), so that
// the sets of a process register side by side.
func NewSet(set *offload.Set, name string, opts Options) *SetCollector {
	return NewSetFunc(set.Stats, name, opts)
}

// NewSetFunc is NewSet over any source of set statistics (a fixed snapshot in a test).
func NewSetFunc(stats func() offload.Stats, name string, opts Options) *SetCollector {
	labels := prometheus.Labels{}
	maps.Copy(labels, opts.ConstLabels)
	labels["set"] = labelValue(name)
	desc := func(series, help string, vars ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(namespace(opts), "offload", series), help, vars, labels)
	}
	return &SetCollector{
		stats:     stats,
		bufBytes:  desc("buffer_bytes", "GPU memory of each buffer of the set (its chunks), asleep or awake.", "tag", "policy"),
		bufAsleep: desc("buffer_asleep", "1 while the buffer sleeps (its GPU memory given back), else 0.", "tag", "policy"),
		asleep:    desc("asleep_bytes", "GPU memory of the sleeping buffers, given back to the driver."),
		backup:    desc("backup_bytes", "Pinned host memory the set holds: backups of sleeping Keep buffers and pooled slots."),
		pooled:    desc("pooled_bytes", "Of the backup bytes, slots pooled for the next sleep or wake (TrimPool gives them back)."),
		calls:     desc("calls_total", "Sleeps and wakes that slept or woke at least one buffer.", "op"),
		failures:  desc("failures_total", "Sleeps and wakes that returned an error.", "op"),
		bytes:     desc("bytes_total", "GPU memory the successful sleeps gave back and the wakes got again.", "op"),
		seconds:   desc("seconds_total", "Time spent in sleeps and wakes, failed ones included.", "op"),
		last:      desc("last_seconds", "The last successful sleep's or wake's time.", "op"),
		staged:    desc("last_sleep_staged_bytes", "GPU memory whose backup the last successful sleep staged (offload.FirstSleepStage): registered in the background after it, which the next wake waits for."),
		sleepStep: desc("last_sleep_step_seconds", "The last successful sleep's time by step: wait (waiting for queued work), copy (the content out, each Keep chunk released as its copy ends) and release (the rest of the GPU memory).", "step"),
	}
}

// Describe sends every series' description.
func (c *SetCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.bufBytes, c.bufAsleep, c.asleep, c.backup, c.pooled,
		c.calls, c.failures, c.bytes, c.seconds, c.last, c.sleepStep, c.staged} {
		ch <- d
	}
}

// Collect takes one snapshot and sends its series.
func (c *SetCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.stats()
	taken := map[string]bool{}
	for _, b := range st.Buffers {
		asleep := 0.0
		if b.Asleep {
			asleep = 1
		}
		tag := uniqueLabel(taken, b.Tag)
		gauge(ch, c.bufBytes, num(b.Bytes), tag, b.Policy.String())
		gauge(ch, c.bufAsleep, asleep, tag, b.Policy.String())
	}
	gauge(ch, c.asleep, num(st.AsleepBytes))
	gauge(ch, c.backup, num(st.BackupBytes))
	gauge(ch, c.pooled, num(st.PooledBytes))
	for _, op := range []struct {
		name                   string
		calls, failures, bytes uint64
		total, last            float64
	}{
		{"sleep", st.Sleeps, st.SleepFailures, st.SleptBytes, st.SleepTime.Seconds(), st.LastSleep.Seconds()},
		{"wake", st.Wakes, st.WakeFailures, st.WokenBytes, st.WakeTime.Seconds(), st.LastWake.Seconds()},
	} {
		counter(ch, c.calls, num(op.calls), op.name)
		counter(ch, c.failures, num(op.failures), op.name)
		counter(ch, c.bytes, num(op.bytes), op.name)
		counter(ch, c.seconds, op.total, op.name)
		gauge(ch, c.last, op.last, op.name)
	}
	steps := st.LastSleepSteps
	gauge(ch, c.sleepStep, steps.Wait.Seconds(), "wait")
	gauge(ch, c.sleepStep, steps.Copy.Seconds(), "copy")
	gauge(ch, c.sleepStep, steps.Release.Seconds(), "release")
	gauge(ch, c.staged, num(steps.StagedBytes))
}

// uniqueLabel is tag's label (labelValue), quoted again while another buffer of the snapshot
// already has it: a set's tags are distinct, but an invalid tag's quoted form may be another,
// valid tag, and two series with one label would fail the whole scrape.
func uniqueLabel(taken map[string]bool, tag string) string {
	l := labelValue(tag)
	for taken[l] {
		l = strconv.Quote(l)
	}
	taken[l] = true
	return l
}
