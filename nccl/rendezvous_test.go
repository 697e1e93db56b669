package nccl_test

import (
	"context"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/nccl"
)

func TestShareIDOverAConnection(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	id := nccl.UniqueID{1, 2, 3, 127: 9}
	done := make(chan error, 1)
	go func() { done <- nccl.ShareID(a, id) }()
	got, err := nccl.ReceiveID(b)
	require.NoError(t, err)
	require.Equal(t, id, got)
	require.NoError(t, <-done)
}

func TestReceiveIDRefusesOtherTraffic(t *testing.T) {
	a, b := net.Pipe()
	defer b.Close()
	go func() {
		a.Write(make([]byte, 8+nccl.UniqueIDBytes)) // zeros: not a cuvmm frame
		a.Close()
	}()
	_, err := nccl.ReceiveID(b)
	require.ErrorIs(t, err, nccl.ErrRendezvous)
}

// TestServeAndDialID hands the ID to two ranks over TCP (how hosts meet) and over a Unix socket.
func TestServeAndDialID(t *testing.T) {
	for _, network := range []string{"tcp", "unix"} {
		t.Run(network, func(t *testing.T) {
			addr := "127.0.0.1:0"
			if network == "unix" {
				addr = filepath.Join(t.TempDir(), "rendezvous.sock")
			}
			ln, err := net.Listen(network, addr)
			require.NoError(t, err)
			defer ln.Close()
			id := nccl.UniqueID{42, 127: 7}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			served := make(chan error, 1)
			go func() { served <- nccl.ServeID(ctx, ln, id, 2) }()
			for range 2 {
				got, err := nccl.DialID(ctx, network, ln.Addr().String())
				require.NoError(t, err)
				require.Equal(t, id, got)
			}
			require.NoError(t, <-served)
		})
	}
}

func TestRendezvousDeadlines(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	err = nccl.ServeID(ctx, ln, nccl.UniqueID{}, 1)
	require.ErrorIs(t, err, nccl.ErrRendezvous)
	require.ErrorIs(t, err, context.DeadlineExceeded)

	dead := filepath.Join(t.TempDir(), "nobody.sock")
	ctx2, cancel2 := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel2()
	_, err = nccl.DialID(ctx2, "unix", dead)
	require.ErrorIs(t, err, nccl.ErrRendezvous)
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

// TestServeIDEndsOnCancelWhileAPeerIsSilent: a peer that connects and never acknowledges the ID
// does not keep ServeID past the cancellation of a context without a deadline, and the listener is
// left without a deadline (it accepts again).
func TestServeIDEndsOnCancelWhileAPeerIsSilent(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- nccl.ServeID(ctx, ln, nccl.UniqueID{}, 1) }()
	conn, err := net.Dial("tcp", ln.Addr().String()) // never reads, never acknowledges
	require.NoError(t, err)
	defer conn.Close()
	requireEndsOnCancel(t, cancel, done, "ServeID")
	requireAccepts(t, ln)
}

// TestServeIDLeavesNoDeadlineOnTheListener: a context that ends just as ServeID returns must not
// leave the listener with a past deadline.
func TestServeIDLeavesNoDeadlineOnTheListener(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	for range 200 {
		ctx, cancel := context.WithCancel(context.Background())
		go cancel()
		_ = nccl.ServeID(ctx, ln, nccl.UniqueID{}, 0)
		cancel()
	}
	requireAccepts(t, ln)
}

// requireAccepts checks that ln accepts a connection (it has no past deadline).
func requireAccepts(t *testing.T, ln net.Listener) {
	t.Helper()
	accepted := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			c.Close()
		}
		accepted <- err
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	select {
	case err := <-accepted:
		require.NoError(t, err, "the listener was left with a deadline")
	case <-time.After(5 * time.Second):
		t.Fatal("the listener did not accept")
	}
}

// TestDialIDEndsOnCancelWhileTheServerIsSilent: a server that accepts and never sends the ID does
// not keep DialID past the cancellation of a context without a deadline.
func TestDialIDEndsOnCancelWhileTheServerIsSilent(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	silent := make(chan net.Conn, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			silent <- c
		}
	}()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { _, err := nccl.DialID(ctx, "tcp", ln.Addr().String()); done <- err }()
	c := <-silent
	defer c.Close()
	requireEndsOnCancel(t, cancel, done, "DialID")
}

// requireEndsOnCancel cancels a rendezvous call that is blocked on a silent peer and requires it to
// end soon with an error wrapping ErrRendezvous and the cancellation.
func requireEndsOnCancel(t *testing.T, cancel context.CancelFunc, done <-chan error, what string) {
	t.Helper()
	time.Sleep(50 * time.Millisecond)
	cancel()
	select {
	case err := <-done:
		require.ErrorIs(t, err, nccl.ErrRendezvous)
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(5 * time.Second):
		t.Fatalf("%s still blocked 5s after its context was cancelled", what)
	}
}
