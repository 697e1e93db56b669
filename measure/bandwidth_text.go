package measure

import (
	"fmt"
	"io"

	"github.com/cuvmm/cuvmm/internal/units"
)

// Text writes the result for people.
func (r *BandwidthResult) Text(w io.Writer) {
	sizes := r.sizes
	fmt.Fprintf(w, "bandwidth on device %d (%s), %s backend\n", r.Device, r.Name, r.Backend)
	fmt.Fprintf(w, "timing: %s\n", r.Timing)
	fmt.Fprintln(w, "ready (time to make the largest size usable):")
	for _, s := range r.Setup {
		fmt.Fprintf(w, "  %-14s %8.1f ms  %s\n", s.Kind, s.Seconds*1e3, s.Note)
	}
	var kinds []string
	seen := map[string]bool{}
	for _, row := range r.Rows {
		if !seen[row.Kind] {
			seen[row.Kind] = true
			kinds = append(kinds, row.Kind)
		}
	}
	for _, dir := range []string{"h2d", "d2h"} {
		fmt.Fprintf(w, "\n%s median GB/s (× host-alloc)\n", map[string]string{"h2d": "host → device", "d2h": "device → host"}[dir])
		fmt.Fprintf(w, "  %-8s", "size")
		for _, k := range kinds {
			fmt.Fprintf(w, " %20s", k)
		}
		fmt.Fprintln(w)
		for _, size := range sizes {
			fmt.Fprintf(w, "  %-8s", units.FormatSize(size))
			for _, k := range kinds {
				for _, row := range r.Rows {
					if row.Kind == k && row.Direction == dir && row.SizeBytes == size {
						fmt.Fprintf(w, " %12.1f (%5.2f)", row.MedianGBs, row.VsHostAlloc)
					}
				}
			}
			fmt.Fprintln(w)
		}
	}
	if r.MinPinnedVsHostAlloc < 0 {
		fmt.Fprintf(w, "\npinned regions vs raw cuMemcpy on cuMemHostAlloc memory, sizes ≥ 16 MiB: not measured (no size ≥ 16 MiB)\n")
	} else {
		fmt.Fprintf(w, "\npinned regions vs raw cuMemcpy on cuMemHostAlloc memory, sizes ≥ 16 MiB: lowest ratio %.3f (target ≥ 0.97)\n", r.MinPinnedVsHostAlloc)
	}
	if s := r.Staging; s != nil {
		wait := "sleeping"
		if s.SpinWait {
			wait = "spinning"
		}
		fmt.Fprintf(w, "async staging of %s in %d × %s buffers, %s waits:\n", units.FormatSize(s.SizeBytes), s.Buffers, units.FormatSize(s.ChunkBytes), wait)
		fmt.Fprintf(w, "  device → discarding writer %6.1f GB/s = %.3f × raw D2H %.1f GB/s (target ≥ 0.9)\n", s.D2HGBs, s.D2HVsRaw, s.RawD2HGBs)
		fmt.Fprintf(w, "  reader → device            %6.1f GB/s = %.3f × raw H2D %.1f GB/s\n", s.H2DGBs, s.H2DVsRaw, s.RawH2DGBs)
	}
	fmt.Fprintf(w, "patterns verified: %s\n", yesNo(r.Verified))
}
