package nccl_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/nccl"
	"github.com/cuvmm/cuvmm/nccl/ncclsim"
	"github.com/cuvmm/cuvmm/vmm"
)

// The second process of the multi-process tests is this test binary again, in the role named by
// envRole, joining the communicator as rank 1 on device 1 with the unique ID read from descriptor 3.
const (
	envRole = "CUVMM_NCCL_TEST_ROLE" // "recv" or "send"
	envSize = "CUVMM_NCCL_TEST_SIZE"
	envSeed = "CUVMM_NCCL_TEST_SEED"
)

// TestMain runs the child role of a multi-process test when asked to, and otherwise the tests, with
// the leak report of builds with the cuvmmleak tag.
func TestMain(m *testing.M) {
	if role := os.Getenv(envRole); role != "" {
		if err := child(role); err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	// NCCL's RAS thread keeps reconnecting to a peer process that died (TestPeerDiesMidTransfer) for
	// a minute, a socket at a time, which the per-test descriptor checks would blame on the tests
	// that follow. RAS only reports; the tests do not need it.
	if _, set := os.LookupEnv("NCCL_RAS_ENABLE"); !set {
		_ = os.Setenv("NCCL_RAS_ENABLE", "0")
	}
	warmUp()
	os.Exit(testutil.Main(m))
}

// warmUp runs one transfer between two ranks on the real GPUs, when there are NCCL and two GPUs,
// before the tests: NCCL's first communicator in a process loads its kernels into each device's
// context and keeps them for the process's life, which the per-test leak checks would otherwise
// count against the first test. The system stays open so that the contexts keep what was loaded,
// and reachable from warmSystem so that builds with the cuvmmleak tag do not report it.
func warmUp() {
	api, err := driver.Open()
	if err != nil {
		return
	}
	lib, err := nccl.Open()
	if err != nil {
		return
	}
	sys, err := vmm.Open(api)
	if err != nil {
		return
	}
	if sys.DeviceCount() < 2 {
		_ = sys.Close()
		return
	}
	warmSystem = sys
	if err := warmUpTransfer(sys, lib); err != nil {
		fmt.Fprintln(os.Stderr, "warming NCCL up:", err)
	}
}

// warmSystem is the system warmUp keeps open for the process's life.
var warmSystem *vmm.System

func warmUpTransfer(sys *vmm.System, lib nccl.API) error {
	id, err := lib.GetUniqueID()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	errs := parallel(2, func(r int) error {
		dev, err := sys.Device(r)
		if err != nil {
			return err
		}
		buf, err := growbuf.New(dev, growbuf.Options{MaxSize: 1 << 30})
		if err != nil {
			return err
		}
		defer buf.Close()
		if err := buf.Grow(2 * mib); err != nil {
			return err
		}
		c, err := nccl.NewComm(ctx, lib, id, r, 2, dev)
		if err != nil {
			return err
		}
		defer c.Close()
		g := c.Group().AllReduceBuffer(buf, buf, nccl.Float32, nccl.Sum, nil)
		if r == 0 {
			g.SendBuffer(buf, 1, nil)
		} else {
			g.RecvBuffer(buf, 0, nil)
		}
		if err := g.Run(ctx); err != nil {
			return err
		}
		return c.Wait(ctx, nil)
	})
	return errors.Join(errs...)
}

// childLibrary opens the backend the parent named and its NCCL.
func childLibrary() (*vmm.System, nccl.API, func(), error) {
	var api driver.API
	closeSim := func() {}
	if os.Getenv(testutil.EnvChildBackend) == "sim" {
		n, _ := strconv.Atoi(os.Getenv(testutil.EnvChildSimDevices))
		s := sim.New(sim.Devices(max(n, 2)))
		api, closeSim = s, func() { s.Close() }
	} else {
		var err error
		if api, err = driver.Open(); err != nil {
			return nil, nil, nil, err
		}
	}
	sys, err := vmm.Open(api)
	if err != nil {
		return nil, nil, nil, err
	}
	var lib nccl.API = ncclsim.New(api)
	if os.Getenv(testutil.EnvChildBackend) != "sim" {
		if lib, err = nccl.Open(); err != nil {
			return nil, nil, nil, err
		}
	}
	return sys, lib, func() { sys.Close(); closeSim() }, nil
}

// child is rank 1: it joins, then receives a buffer of envSize bytes from rank 0, verifies the
// pattern, prints "verified N" and closes its communicator, or sends one in two halves
// (sendHalves). It waits for stdin to close before leaving.
func child(role string) error {
	sys, lib, closeAll, err := childLibrary()
	if err != nil {
		return err
	}
	defer closeAll()
	dev, err := sys.Device(1)
	if err != nil {
		return err
	}
	f := os.NewFile(3, "rendezvous")
	conn, err := net.FileConn(f)
	f.Close()
	if err != nil {
		return err
	}
	id, err := nccl.ReceiveID(conn)
	conn.Close()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := nccl.NewComm(ctx, lib, id, 1, 2, dev)
	if err != nil {
		return err
	}
	defer c.Close()
	size, _ := strconv.ParseUint(os.Getenv(envSize), 10, 64)
	seed, _ := strconv.ParseUint(os.Getenv(envSeed), 10, 64)
	buf, err := growbuf.New(dev, growbuf.Options{MaxSize: 1 << 30})
	if err != nil {
		return err
	}
	defer buf.Close()
	if err := buf.Grow(size); err != nil {
		return err
	}
	if role == "send" {
		return sendHalves(ctx, c, dev, buf, size, seed)
	}
	if err := c.Group().RecvBuffer(buf, 0, nil).Run(ctx); err != nil {
		return err
	}
	if err := c.Wait(ctx, nil); err != nil {
		return err
	}
	bad, err := dev.Verify(buf.Ptr(), size, 0, seed)
	if err != nil {
		return err
	}
	fmt.Println("verified", bad)
	// Both ranks close at once: NCCL's destroy waits for the other process's rank to close too.
	if err := c.Close(); err != nil {
		return err
	}
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
	}
	return nil
}

// sendHalves sends the first half of buf to rank 0, prints "half", and sends the second half after
// a line on stdin (the test kills the process before).
func sendHalves(ctx context.Context, c *nccl.Comm, dev *vmm.Device, buf *growbuf.Buffer, size, seed uint64) error {
	if err := dev.Fill(buf.Ptr(), size, 0, seed); err != nil {
		return err
	}
	half := size / 2
	for i := range uint64(2) {
		if err := c.Send(ctx, buf.Ptr()+driver.DevicePtr(i*half), half, nccl.Uint8, 0, nil); err != nil {
			return err
		}
		if err := c.Wait(ctx, nil); err != nil {
			return err
		}
		if i == 0 {
			fmt.Println("half")
			if !bufio.NewScanner(os.Stdin).Scan() {
				return nil
			}
		}
	}
	fmt.Println("sent")
	return nil
}

// startRank1 starts the second process in role and hands it the unique ID over a Unix socket pair.
func startRank1(t *testing.T, b *testutil.Backend, lib nccl.API, role string, size, seed uint64) (*testutil.Child, nccl.UniqueID) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	mine, theirs := os.NewFile(uintptr(fds[0]), "rank0"), os.NewFile(uintptr(fds[1]), "rank1")
	defer mine.Close()
	ch := testutil.StartChild(t, b, []string{envRole + "=" + role, envSize + "=" + strconv.FormatUint(size, 10),
		envSeed + "=" + strconv.FormatUint(seed, 10)}, theirs)
	theirs.Close()
	conn, err := net.FileConn(mine)
	require.NoError(t, err)
	defer conn.Close()
	id, err := lib.GetUniqueID()
	require.NoError(t, err)
	require.NoError(t, nccl.ShareID(conn, id))
	return ch, id
}

// TestTwoProcesses sends a buffer to a rank in another process, which verifies it.
func TestTwoProcesses(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		const size = 6 * mib
		dev := b.Device(t, 0)
		buf := buffer(t, dev, size, 2*mib)
		require.NoError(t, dev.Fill(buf.Ptr(), size, 0, 42))
		ch, id := startRank1(t, b, lib, "recv", size, 42)
		ctx := deadline(t, time.Minute)
		c, err := nccl.NewComm(ctx, lib, id, 0, 2, dev)
		require.NoError(t, err)
		require.NoError(t, c.Group().SendBuffer(buf, 1, nil).Run(ctx))
		require.NoError(t, c.Wait(ctx, nil))
		require.Equal(t, "verified 0", ch.Line())
		require.NoError(t, c.Close(), "closed together with the child's rank; child stderr:\n%s", ch.Stderr())
		ch.Wait()
	}, testutil.Devices(2))
}

// TestPeerDiesMidTransfer kills the sending process while rank 0 receives: rank 0 gets an error
// within its deadline, never a hang, and nothing is left behind (the leak checks of the test).
func TestPeerDiesMidTransfer(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		const size = 256 * mib
		dev := b.Device(t, 0)
		buf := buffer(t, dev, size, 64*mib)
		ch, id := startRank1(t, b, lib, "send", size, 5)
		ctx := deadline(t, time.Minute)
		c, err := nccl.NewComm(ctx, lib, id, 0, 2, dev)
		require.NoError(t, err)
		defer c.Close()
		const limit = 5 * time.Second
		wctx := deadline(t, limit+5*time.Second)
		errc := make(chan error, 1)
		half := uint64(size / 2)
		go func() {
			err := c.Group().Recv(buf.Ptr(), half, nccl.Uint8, 1, nil).Recv(buf.Ptr()+driver.DevicePtr(half), half, nccl.Uint8, 1, nil).Run(wctx)
			if err == nil {
				err = c.Wait(wctx, nil)
			}
			errc <- err
		}()
		require.Equal(t, "half", ch.Line())
		ch.Kill()
		start := time.Now()
		err = <-errc
		took := time.Since(start)
		t.Logf("the survivor's error after %v: %v", took, err)
		require.Error(t, err)
		require.True(t, errors.Is(err, nccl.ErrRemote) || errors.Is(err, nccl.ErrAborted), "%v", err)
		require.Less(t, took, limit+abortSlack)
		require.ErrorIs(t, c.Group().RecvBuffer(buf, 1, nil).Run(ctx), nccl.ErrAborted, "an aborted communicator stays unusable")
	}, testutil.Devices(2))
}

// abortSlack is what an abort may add to a deadline.
const abortSlack = 10 * time.Second
