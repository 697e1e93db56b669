package measure

import (
	"fmt"
	"io"
	"strings"

	"github.com/cuvmm/cuvmm/internal/units"
)

// coldSleeps prints the first sleep and the cold sleep after TrimPool. The host's pinning rates
// bound only a Keep set's (a File sleep writes a file, a Discard sleep copies nothing).
func (r *SleepResult) coldSleeps(w io.Writer) {
	how, floor, refloor := "pinning on the way", "", ""
	switch {
	case r.Mode == "file":
		how = "writing the file"
	case r.Mode == "discard":
		how = "dropping the content"
	case r.PrepareSeconds > 0:
		how = fmt.Sprintf("after Set.Prepare pinned the backup in %.3f s", r.PrepareSeconds)
	case r.FirstSleepStagedBytes > 0:
		how = "staged through a pinned ring, the backup registered after it; the first wake waited for that"
	}
	if r.Mode == "keep" {
		floor = fmt.Sprintf("; pinned.Register runs at %.1f GB/s here: %.3f s to pin while copying", r.RawPinGBps, r.FirstSleepLimitSeconds)
		refloor = fmt.Sprintf(" (re-pinning runs at %.1f GB/s here: %.3f s to pin while copying)", r.RawRepinGBps, r.RepinSleepLimitSeconds)
	}
	fmt.Fprintf(w, "  first sleep %.3f s (%.1f GB/s, %s%s); first wake %.3f s\n",
		r.FirstSleepSeconds, r.FirstSleepGBps, how, floor, r.FirstWakeSeconds)
	fmt.Fprintf(w, "  cold sleep after the pool was trimmed %.3f s%s\n", r.RepinSleepSeconds, refloor)
}

// Text prints the result for people.
func (r *SleepResult) Text(w io.Writer) {
	fmt.Fprintf(w, "sleep and wake, %s mode, %s on each of devices %v (%s backend, chunks of %s)\n",
		r.Mode, units.FormatSize(r.SizeBytes), r.Devices, r.Backend, units.FormatSize(r.ChunkBytes))
	if r.Note != "" {
		fmt.Fprintf(w, "  note: %s\n", r.Note)
	}
	fmt.Fprintf(w, "  verified %s, address unchanged %s, freed %s (%.3f of the bytes slept)\n",
		yesNo(r.Verified), yesNo(r.PtrUnchanged), units.FormatSize(r.FreedBytes), r.FreedRatio)
	r.coldSleeps(w)
	fmt.Fprintf(w, "  warm sleep  %.3f s (%.1f GB/s, %.2fx raw D2H %.1f GB/s)\n", r.SleepSeconds, r.SleepGBps, r.SleepVsRaw, r.RawD2HGBps)
	fmt.Fprintf(w, "  warm wake   %.3f s (%.1f GB/s, %.2fx raw H2D %.1f GB/s)", r.WakeSeconds, r.WakeGBps, r.WakeVsRaw, r.RawH2DGBps)
	if r.WakeAtOnceSeconds > 0 {
		fmt.Fprintf(w, " after %.0f ms asleep; right after the sleep %.3f s (%.2fx)", r.AsleepPauseSeconds*1000, r.WakeAtOnceSeconds, r.WakeAtOnceVsRaw)
	}
	fmt.Fprintln(w)
	if len(r.SleepVsRawRounds) > 0 {
		fmt.Fprintf(w, "  each of %d rounds (medians above), sleep and wake against its raw copies out and in: %s (median %.2fx) and %s (median %.2fx)\n",
			r.Rounds, roundList(r.SleepVsRawRounds), r.SleepVsRawRoundsMedian, roundList(r.WakeVsRawRounds), r.WakeVsRawRoundsMedian)
	}
	if r.SleepCopySeconds > 0 {
		fmt.Fprintf(w, "  a sleep's steps (medians of the rounds): waiting for queued work %.1f ms, copying out (kept chunks released as their copies end; file mode: writing the file) %.1f ms, releasing the rest %.1f ms\n",
			r.SleepWaitSeconds*1e3, r.SleepCopySeconds*1e3, r.SleepReleaseSeconds*1e3)
	}
	first := "first sleep of one device"
	if r.PrepareSeconds > 0 && len(r.Devices) <= 1 {
		first = "Set.Prepare and the first sleep"
	}
	fmt.Fprintf(w, "  usual backup (cuMemHostAlloc, then copy), one device: %.3f s (alloc %.3f s); %s %.3f s: %s\n",
		r.BaselineSleepSeconds, r.BaselineAllocSeconds, first, r.FirstSleepOneSeconds, speedup(r.FirstSleepSpeedup))
	if len(r.Devices) > 1 {
		fmt.Fprintf(w, "  one device alone: sleep %.1f GB/s, wake %.1f GB/s; all %d at once: %.2fx and %.2fx\n",
			r.OneDeviceSleepGBps, r.OneDeviceWakeGBps, len(r.Devices), r.AggregateSleepX, r.AggregateWakeX)
	}
	if r.File != "" {
		fmt.Fprintf(w, "  file %s, %d I/O goroutines per device (of %d asked), each through up to %d buffers of %s: raw write %.2f GB/s, read %.2f GB/s; sleep %.2fx, wake %.2fx of raw (medians of %d rounds)\n",
			r.File, r.IOWorkersUsed, r.IOWorkers, r.FileBuffersUsed, units.FormatSize(r.FilePart), r.RawFileWriteGBps, r.RawFileReadGBps, r.SleepVsRawFile, r.WakeVsRawFile, r.Rounds)
		fmt.Fprintf(w, "  each round, sleep and wake against its raw write and reads: %s (median %.2fx) and %s (median %.2fx); a wake's first copy queued after %.1f ms\n",
			roundList(r.SleepVsRawFileRounds), r.SleepVsRawFileRoundsMedian, roundList(r.WakeVsRawFileRounds), r.WakeVsRawFileRoundsMedian, r.WakeFirstCopySeconds*1e3)
		fmt.Fprintf(w, "  limits (the slower of the file and the copy engine): sleep %.2f GB/s (%.2fx), wake %.2f GB/s (%.2fx)\n",
			r.FileSleepLimitGBps, r.SleepVsFileLimit, r.FileWakeLimitGBps, r.WakeVsFileLimit)
	}
	for _, d := range r.PerDevice {
		fmt.Fprintf(w, "  device %d: freed %s, raw D2H %.1f GB/s, raw H2D %.1f GB/s, verified %s, graph %s\n",
			d.Device, units.FormatSize(d.FreedBytes), d.RawD2HGBps, d.RawH2DGBps, yesNo(d.Verified), yesNo(d.GraphOK))
	}
	if r.Failure != "" {
		fmt.Fprintf(w, "  FAILED: %s\n", r.Failure)
	}
}

// speedup says how many times faster a ratio of times is ("6.2x faster"), or slower when it is
// below 1 ("2.0x slower" for 0.5), as the simulator's timings can be.
func speedup(x float64) string {
	if x >= 1 || x <= 0 {
		return fmt.Sprintf("%.1fx faster", x)
	}
	return fmt.Sprintf("%.1fx slower", 1/x)
}

// roundList formats ratios as "0.93, 0.97, 0.88x".
func roundList(xs []float64) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprintf("%.2f", x)
	}
	return strings.Join(parts, ", ") + "x"
}
