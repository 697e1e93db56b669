package plot_test

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/cuvmm/cuvmm/measure/plot"
)

// Draw the figure of a result printed by `vmmdemo grow --json` and write it as SVG; `vmmdemo plot`
// does the same from the command line.
func ExampleDraw() {
	data, err := os.ReadFile(filepath.Join("testdata", "grow.json"))
	if err != nil {
		fmt.Println(err)
		return
	}
	fig, err := plot.Draw(data)
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, p := range fig.Plots {
		fmt.Printf("%s: %q against %q\n", fig.Kind, p.Y.Label.Text, p.X.Label.Text)
	}
	out, _ := os.CreateTemp("", "grow-*.svg")
	defer os.Remove(out.Name())
	fmt.Println(fig.Write(out, "svg"), out.Close())
	// Output:
	// grow: "time (ms)" against "grow to 64 MiB in 8 steps of 8 MiB"
	// grow: "peak (MiB)" against "grow to 64 MiB in 8 steps of 8 MiB"
	// <nil> <nil>
}

// Detect tells a result's kind from its JSON keys.
func ExampleDetect() {
	k, err := plot.Detect([]byte(`{"sleep_gbps": 50.1, "wake_gbps": 51.2}`))
	fmt.Println(k, err)
	_, err = plot.Detect([]byte(`{"driver_version": 13000}`))
	fmt.Println(err != nil)
	// Output:
	// sleep <nil>
	// true
}
