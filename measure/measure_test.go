package measure_test

import (
	"bytes"
	"encoding/json"
	"os"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/measure"
)

func TestMain(m *testing.M) {
	measure.RunWorker() // Share, Pinned and Broker start this test binary as their workers
	os.Exit(m.Run())
}

// simBackend opens a simulator whose Close, at the end of the test, must find nothing left open.
func simBackend(t *testing.T, devices int) *measure.Backend {
	t.Helper()
	b, err := measure.OpenSim(devices)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close(), "everything the measurement made is freed") })
	return b
}

// recorder is a measure.Progress that records the bars.
type recorder struct {
	mu     sync.Mutex
	labels []string
	done   int
	last   map[string]uint64
}

type recBar struct {
	r     *recorder
	label string
}

func (r *recorder) Begin(label string, total uint64) measure.Bar {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.labels = append(r.labels, label)
	return &recBar{r, label}
}

func (b *recBar) Update(done uint64) {
	b.r.mu.Lock()
	defer b.r.mu.Unlock()
	if b.r.last == nil {
		b.r.last = map[string]uint64{}
	}
	b.r.last[b.label] = done
}

func (b *recBar) Done() {
	b.r.mu.Lock()
	defer b.r.mu.Unlock()
	b.r.done++
}

func TestGrowReportsProgress(t *testing.T) {
	var rec recorder
	res, err := measure.Grow(measure.GrowOptions{Env: measure.Env{Backend: simBackend(t, 1), Progress: &rec},
		To: 16 << 20, Step: 4 << 20})
	require.NoError(t, err)
	require.NoError(t, res.Check())
	require.Equal(t, 4, res.Steps)
	require.Equal(t, []string{"growbuf", "realloc"}, rec.labels)
	require.Equal(t, 2, rec.done)
	require.Equal(t, map[string]uint64{"growbuf": 16 << 20, "realloc": 16 << 20}, rec.last)
	var text bytes.Buffer
	res.Text(&text)
	require.Contains(t, text.String(), "grow to 16 MiB in 4 steps of 4 MiB")
}

// TestOptionsChecked: bad options are refused with ErrInvalidOption before anything is allocated
// (the backend's Close finds nothing open).
func TestOptionsChecked(t *testing.T) {
	env := measure.Env{Backend: simBackend(t, 2)}
	calls := map[string]func() error{
		"no backend": func() error { _, err := measure.Info(measure.InfoOptions{}); return err },
		"grow step":  func() error { _, err := measure.Grow(measure.GrowOptions{Env: env, To: 8 << 20}); return err },
		"grow device": func() error {
			_, err := measure.Grow(measure.GrowOptions{Env: env, Device: 9, To: 8 << 20, Step: 8 << 20})
			return err
		},
		"stripe layout": func() error {
			_, err := measure.Stripe(measure.StripeOptions{Env: env, Size: 8 << 20, Layout: "diagonal", Builds: 1, Reads: 1})
			return err
		},
		"stripe duplicate": func() error {
			_, err := measure.Stripe(measure.StripeOptions{Env: env, Devices: []int{0, 0}, Size: 8 << 20, Layout: "blocked", Builds: 1, Reads: 1})
			return err
		},
		"bandwidth max size": func() error {
			_, err := measure.Bandwidth(measure.BandwidthOptions{Env: env, MaxSize: 4 << 10, StagingBuffers: 2})
			return err
		},
		"bandwidth no staging with spin": func() error {
			_, err := measure.Bandwidth(measure.BandwidthOptions{Env: env, StagingBuffers: 2, NoStaging: true, StagingSpin: true})
			return err
		},
		"share size": func() error {
			_, err := measure.Share(measure.ShareOptions{Env: env, Size: 1 << 10, Chunks: 1, Location: "device", Rounds: 1, ChildAccess: "device"})
			return err
		},
		"pinned mode": func() error {
			_, err := measure.Pinned(measure.PinnedOptions{Env: env, Size: 4 << 20, Procs: 1, Modes: []string{"bogus"}, WorkerContexts: "all"})
			return err
		},
		"broker max request": func() error {
			_, err := measure.Broker(measure.BrokerOptions{Env: env, Size: 8 << 20, Workers: 1, MaxRequest: 3 << 20, Depth: 1, Streams: 1, RTTSamples: 1})
			return err
		},
		"pinned no devices": func() error {
			_, err := measure.Pinned(measure.PinnedOptions{Env: env, Size: 4 << 20, Procs: 2, Devices: []int{}, WorkerContexts: "all"})
			return err
		},
		"pinned too many procs": func() error {
			_, err := measure.Pinned(measure.PinnedOptions{Env: env, Size: 4 << 20, Procs: measure.MaxWorkers + 1, WorkerContexts: "all"})
			return err
		},
		"broker no devices": func() error {
			_, err := measure.Broker(measure.BrokerOptions{Env: env, Size: 8 << 20, Workers: 2, Devices: []int{}, MaxRequest: 1 << 20, Depth: 1, Streams: 1, RTTSamples: 1})
			return err
		},
		"broker too many workers": func() error {
			_, err := measure.Broker(measure.BrokerOptions{Env: env, Size: 8 << 20, Workers: measure.MaxWorkers + 1, MaxRequest: 1 << 20, Depth: 1, Streams: 1, RTTSamples: 1})
			return err
		},
		"bandwidth max size too large": func() error {
			_, err := measure.Bandwidth(measure.BandwidthOptions{Env: env, MaxSize: 2 << 30, StagingBuffers: 2})
			return err
		},
		"xfer size beyond memory": func() error {
			_, err := measure.Xfer(measure.XferOptions{Env: env, Size: 1 << 50})
			return err
		},
		"xfer negative iters": func() error {
			_, err := measure.Xfer(measure.XferOptions{Env: env, Size: 8 << 20, Iters: -5})
			return err
		},
	}
	for name, call := range calls {
		require.ErrorIs(t, call(), measure.ErrInvalidOption, name)
	}
}

// TestShareFromAPI runs Share as a program would: its worker is this test binary, its notes and
// the worker's output go to Log.
func TestShareFromAPI(t *testing.T) {
	t.Setenv("GORACE", "atexit_sleep_ms=0")
	var log bytes.Buffer
	res, err := measure.Share(measure.ShareOptions{Env: measure.Env{Backend: simBackend(t, 1), Log: &log},
		Size: 4 << 20, Chunks: 2, Location: "host", Rounds: 2, ChildAccess: "cpu"})
	require.NoError(t, err, log.String())
	require.NoError(t, res.Check())
	require.Equal(t, uint64(4<<20), res.SizeBytes)
	require.NotZero(t, res.ChildPID)
	require.NotEqual(t, os.Getpid(), res.ChildPID)
	out, err := json.Marshal(res)
	require.NoError(t, err)
	require.Contains(t, string(out), `"round_trip_us"`)
}
