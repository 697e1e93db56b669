package nccl_test

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/nccl"
	"github.com/cuvmm/cuvmm/nccl/ncclsim"
	"github.com/cuvmm/cuvmm/vmm"
)

// requireNCCL reports whether CUVMM_REQUIRE_NCCL=1: a missing NCCL fails the real-driver tests.
func requireNCCL() bool { return os.Getenv("CUVMM_REQUIRE_NCCL") == "1" }

// library is the NCCL of backend b: the stand-in over the simulator, or the real library (the test
// skips without one, or fails under CUVMM_REQUIRE_NCCL=1). The stand-in's leak check, and its check
// that every call had the communicator's device bound, run at the end of the test.
func library(t *testing.T, b *testutil.Backend) nccl.API {
	t.Helper()
	if b.IsSim() {
		lib := ncclsim.New(b.Sim)
		t.Cleanup(func() {
			require.True(t, lib.Live().Zero(), "the simulated NCCL still holds: %s", lib.Live())
			require.Empty(t, lib.Unbound(), "NCCL calls made without the communicator's device current")
		})
		return lib
	}
	lib, err := nccl.Open()
	if err != nil {
		if requireNCCL() {
			t.Fatalf("CUVMM_REQUIRE_NCCL=1 but NCCL does not load: %v", err)
		}
		t.Skipf("NCCL not usable here (set %s to libnccl.so.2, CUVMM_REQUIRE_NCCL=1 to fail instead): %v", nccl.EnvLibrary, err)
	}
	t.Logf("NCCL %s", nccl.FormatVersion(lib.Version()))
	return lib
}

// ranks makes an n-rank communicator inside this process, rank i on device i, joined from one
// goroutine per rank as separate processes would. The communicators close at the end of the test.
func ranks(t *testing.T, b *testutil.Backend, lib nccl.API, n int) []*nccl.Comm {
	t.Helper()
	id, err := lib.GetUniqueID()
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	comms := make([]*nccl.Comm, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		dev := b.Device(t, i)
		wg.Add(1)
		go func() {
			defer wg.Done()
			comms[i], errs[i] = nccl.NewComm(ctx, lib, id, i, n, dev)
		}()
	}
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i], "rank %d", i)
	}
	t.Cleanup(func() {
		var wg sync.WaitGroup
		for _, c := range comms {
			wg.Add(1)
			go func() { defer wg.Done(); require.NoError(t, c.Close()) }()
		}
		wg.Wait()
	})
	return comms
}

// parallel runs fn for every rank at once, as ranks in separate processes would, and returns their
// errors by rank.
func parallel(n int, fn func(rank int) error) []error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = fn(i) }()
	}
	wg.Wait()
	return errs
}

func noErrors(t *testing.T, errs []error) {
	t.Helper()
	for i, err := range errs {
		require.NoError(t, err, "rank %d", i)
	}
}

// buffer makes a growable buffer of n bytes on dev with fixed chunks of chunk bytes. The chunks can
// be exported as file descriptors, which NCCL needs to register them for other processes.
func buffer(t *testing.T, dev *vmm.Device, n, chunk uint64) *growbuf.Buffer {
	t.Helper()
	buf, err := growbuf.New(dev, growbuf.Options{Chunk: growbuf.FixedChunks(chunk), MaxSize: 1 << 30,
		HandleTypes: driver.HandleTypePosixFD})
	require.NoError(t, err)
	require.NoError(t, buf.Grow(n))
	t.Cleanup(func() { require.NoError(t, buf.Close()) })
	return buf
}

func stream(t *testing.T, dev *vmm.Device) *vmm.Stream {
	t.Helper()
	s, err := dev.NewStream(true)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

func deadline(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
