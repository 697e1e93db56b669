package nccl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/cuvmm/cuvmm/internal/unixsock"
)

// The unique ID travels in a small frame: a magic, a version byte, the 128 bytes. The receiver
// answers one acknowledgement byte, so the sender knows each rank has it.
var idMagic = [8]byte{'c', 'u', 'v', 'm', 'm', 'I', 'D', 1}

const idAck = 0x06

// ErrRendezvous: the unique ID could not be handed over (a peer that is not a cuvmm rank, a closed
// connection, a deadline).
var ErrRendezvous = errors.New("nccl: rendezvous failed")

// ShareID writes id to rw (a connection to another rank) and waits for its acknowledgement.
func ShareID(rw io.ReadWriter, id UniqueID) error {
	frame := append(idMagic[:], id[:]...)
	if _, err := rw.Write(frame); err != nil {
		return fmt.Errorf("nccl: send the unique ID: %w", errors.Join(ErrRendezvous, err))
	}
	var ack [1]byte
	if _, err := io.ReadFull(rw, ack[:]); err != nil {
		return fmt.Errorf("nccl: wait for the peer's acknowledgement of the unique ID: %w", errors.Join(ErrRendezvous, err))
	}
	if ack[0] != idAck {
		return fmt.Errorf("nccl: the peer answered %#x instead of acknowledging the unique ID: %w", ack[0], ErrRendezvous)
	}
	return nil
}

// ReceiveID reads a unique ID that ShareID wrote on the other end of rw and acknowledges it.
func ReceiveID(rw io.ReadWriter) (UniqueID, error) {
	var id UniqueID
	var frame [len(idMagic) + UniqueIDBytes]byte
	if _, err := io.ReadFull(rw, frame[:]); err != nil {
		return id, fmt.Errorf("nccl: read the unique ID: %w", errors.Join(ErrRendezvous, err))
	}
	if [8]byte(frame[:8]) != idMagic {
		return id, fmt.Errorf("nccl: the peer sent %q, not a cuvmm unique ID frame: %w", frame[:8], ErrRendezvous)
	}
	copy(id[:], frame[8:])
	if _, err := rw.Write([]byte{idAck}); err != nil {
		return id, fmt.Errorf("nccl: acknowledge the unique ID: %w", errors.Join(ErrRendezvous, err))
	}
	return id, nil
}

// ServeID hands id to peers ranks that connect to ln (a TCP listener, how ranks on different hosts
// meet, or a Unix socket listener): it accepts peers connections, shares the ID on each and closes
// them. It fails when ctx ends first, also while a peer that connected has not acknowledged the ID,
// with an error wrapping ErrRendezvous and ctx's error. ln stays open, without a deadline. A listener
// that takes no deadline (a TLS or other wrapping listener) is accepted on in the background: when
// ctx ends first, that Accept goes on until ln is closed, and a peer it still accepts is
// disconnected.
func ServeID(ctx context.Context, ln net.Listener, id UniqueID, peers int) error {
	defer unixsock.DeadlineWhenDone(ctx, func(t time.Time) { setAcceptDeadline(ln, t) })()
	for i := 0; i < peers; i++ {
		conn, err := accept(ctx, ln)
		if err != nil {
			return fmt.Errorf("nccl: serve the unique ID on %s: %d of %d ranks connected: %w", ln.Addr(), i, peers,
				errors.Join(ErrRendezvous, ctxErr(ctx, err)))
		}
		if err := shareOn(ctx, conn, id); err != nil {
			return fmt.Errorf("nccl: serve the unique ID on %s: %w", ln.Addr(), err)
		}
	}
	return nil
}

// accept is ln.Accept, which a past deadline interrupts when ctx ends (DeadlineWhenDone); a listener
// without SetDeadline is accepted on in another goroutine, left behind when ctx ends first.
func accept(ctx context.Context, ln net.Listener) (net.Conn, error) {
	if _, ok := ln.(interface{ SetDeadline(time.Time) error }); ok {
		return ln.Accept()
	}
	type accepted struct {
		conn net.Conn
		err  error
	}
	ch := make(chan accepted, 1)
	go func() {
		conn, err := ln.Accept()
		ch <- accepted{conn, err}
	}()
	select {
	case a := <-ch:
		return a.conn, a.err
	case <-ctx.Done():
		go func() {
			if a := <-ch; a.conn != nil {
				_ = a.conn.Close()
			}
		}()
		return nil, ctx.Err()
	}
}

// shareOn shares id on conn, which a past deadline interrupts when ctx ends, and closes conn.
func shareOn(ctx context.Context, conn net.Conn, id UniqueID) error {
	defer conn.Close()
	defer unixsock.DeadlineWhenDone(ctx, func(t time.Time) { _ = conn.SetDeadline(t) })()
	if err := ShareID(conn, id); err != nil {
		return errors.Join(err, ctx.Err())
	}
	return nil
}

// receiveOn receives an ID on conn, which a past deadline interrupts when ctx ends, and closes conn.
func receiveOn(ctx context.Context, conn net.Conn) (UniqueID, error) {
	defer conn.Close()
	defer unixsock.DeadlineWhenDone(ctx, func(t time.Time) { _ = conn.SetDeadline(t) })()
	id, err := ReceiveID(conn)
	if err != nil {
		return id, errors.Join(err, ctx.Err())
	}
	return id, nil
}

// ctxErr is ctx's error when ctx has ended (the reason err, a deadline's timeout, came), else err.
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// malformed reports a dial error that no server starting later would cure: the address or the
// network itself is wrong.
func malformed(err error) bool {
	var addr *net.AddrError
	var network net.UnknownNetworkError
	var parse *net.ParseError
	return errors.As(err, &addr) || errors.As(err, &network) || errors.As(err, &parse)
}

func setAcceptDeadline(ln net.Listener, t time.Time) {
	if d, ok := ln.(interface{ SetDeadline(time.Time) error }); ok {
		_ = d.SetDeadline(t)
	}
}

// DialID connects to a rank serving the unique ID (ServeID) at address on network ("tcp" or
// "unix"), retrying while the server is not up yet, and returns the ID. It fails when ctx ends first,
// also while the server that accepted has not sent the ID, with an error wrapping ErrRendezvous and
// ctx's error. An address or network that no retry can mend (a missing port, a malformed address,
// an unknown network) fails at once, wrapping ErrRendezvous and the dial's error; a host not
// resolvable yet is retried, as it may be a peer still starting.
func DialID(ctx context.Context, network, address string) (UniqueID, error) {
	var d net.Dialer
	pause := 10 * time.Millisecond
	for {
		conn, err := d.DialContext(ctx, network, address)
		if err == nil {
			id, err := receiveOn(ctx, conn)
			if err != nil {
				return id, fmt.Errorf("nccl: fetch the unique ID from %s %s: %w", network, address, err)
			}
			return id, nil
		}
		if malformed(err) {
			return UniqueID{}, fmt.Errorf("nccl: fetch the unique ID from %s %s: %w", network, address, errors.Join(ErrRendezvous, err))
		}
		select {
		case <-ctx.Done():
			return UniqueID{}, fmt.Errorf("nccl: fetch the unique ID from %s %s: %w", network, address, errors.Join(ErrRendezvous, ctx.Err(), err))
		case <-time.After(pause):
		}
		pause = min(2*pause, 200*time.Millisecond)
	}
}
