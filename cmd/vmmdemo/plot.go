package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/cuvmm/cuvmm/measure/plot"
)

func init() {
	register(&command{name: "plot", summary: "draw the figure of a --json result (bandwidth, pinned, grow, broker, sleep) as SVG, PNG, PDF or EPS",
		run: runPlot})
}

func runPlot(e *env, args []string) error {
	fs := newFlags(e, "plot")
	in := fs.String("in", "", "the `file` holding a result printed by vmmdemo SUB --json (its kind is told by its keys)")
	out := fs.String("out", "", "the figure to write; its extension chooses the format: .svg, .png, .pdf or .eps")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *in == "" || *out == "" {
		return fmt.Errorf("both --in and --out are needed: %w", errUsage)
	}
	format := strings.TrimPrefix(strings.ToLower(filepath.Ext(*out)), ".")
	switch format {
	case "svg", "png", "pdf", "eps":
	default:
		return fmt.Errorf("--out %s: the extension must be .svg, .png, .pdf or .eps: %w", *out, errUsage)
	}
	data, err := os.ReadFile(*in)
	if err != nil {
		return fmt.Errorf("--in: %w", err)
	}
	fig, err := plot.Draw(data)
	if err != nil {
		return fmt.Errorf("%s: %w", *in, err)
	}
	if err := writeFigure(e, fig, *out, format); err != nil {
		return fmt.Errorf("--out %s: %w", *out, err)
	}
	return nil
}

// writeFigure writes the figure to a temporary file beside path and renames it, so that a failure
// leaves no half-written figure.
func writeFigure(e *env, fig *plot.Figure, path, format string) error {
	f, err := os.CreateTemp(filepath.Dir(path), ".vmmdemo-plot-*")
	if err != nil {
		return err
	}
	err = fig.Write(f, format)
	err = errors.Join(err, f.Close())
	if err == nil {
		err = os.Chmod(f.Name(), 0o644)
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		_ = os.Remove(f.Name())
		return err
	}
	fmt.Fprintf(e.stdout, "%s: %s figure, %d panel(s)\n", path, fig.Kind, len(fig.Plots))
	return nil
}
