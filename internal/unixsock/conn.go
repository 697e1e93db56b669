package unixsock

import (
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Conn is one framed connection: Read and Write move whole frames (a payload and its descriptors)
// through buffers the Conn reuses. Reads run on one goroutine at a time; writes are serialized by
// the Conn. On a server's Conn, Read drops a peer that stays silent for the idle timeout (ErrIdle)
// or starts a frame and does not finish it within the read timeout (ErrTimeout), and each write has
// the write timeout.
type Conn struct {
	uc   *net.UnixConn
	peer unix.Ucred
	lim  readLimits
	wto  time.Duration

	r reader // used by the reading goroutine only

	wmu  sync.Mutex
	wbuf []byte
}

// NewConn wraps a connected Unix stream socket (for example one end of a socketpair) with no
// deadlines. peer is whatever the caller knows of the other side.
func NewConn(uc *net.UnixConn, peer unix.Ucred) *Conn { return &Conn{uc: uc, peer: peer} }

// Unix is the underlying socket, for the protocols that read or write their frames themselves
// (ipc.Send, ipc.Receive): hold Lock while writing on it.
func (c *Conn) Unix() *net.UnixConn { return c.uc }

// Peer is the other side's pid, uid and gid as SO_PEERCRED reported them at connect time.
func (c *Conn) Peer() unix.Ucred { return c.peer }

// Read reads one frame (see Frame for what stays valid). On any error every descriptor that arrived
// is closed; after an error the framing is lost, except after ErrIdle (nothing was read).
func (c *Conn) Read() (Frame, error) { return c.r.read(c.uc, c.lim, 0) }

// ReadAtLeast is Read for a frame whose payload is at least min bytes (shorter ones are refused
// with ErrProtocol): the header and those bytes come in one receive.
func (c *Conn) ReadAtLeast(min int) (Frame, error) { return c.r.read(c.uc, c.lim, min) }

// SetIdleTimeout changes the idle timeout of later Reads (0: none).
func (c *Conn) SetIdleTimeout(d time.Duration) { c.lim.idle = d }

// SetMaxPayload lowers the largest payload later Reads accept (at most MaxPayload; 0: MaxPayload), so
// that a peer cannot make the connection's reusable buffer grow past what its protocol needs.
func (c *Conn) SetMaxPayload(n int) { c.lim.maxPayload = min(max(n, 0), MaxPayload) }

// IdleTimeout is the idle timeout of Reads (0: none).
func (c *Conn) IdleTimeout() time.Duration { return c.lim.idle }

// MessageTimeout is how long a frame, once started, may take to arrive: the listener's ReadTimeout,
// or with none the idle timeout (0: no bound), as Read applies them.
func (c *Conn) MessageTimeout() time.Duration {
	if c.lim.message > 0 {
		return c.lim.message
	}
	return c.lim.idle
}

// Write sends one frame with duplicates of files (the caller keeps its files).
func (c *Conn) Write(kind uint16, payload []byte, files []*os.File) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.writeDeadline()
	var err error
	c.wbuf, err = writeFrame(c.uc, c.wbuf, kind, payload, files)
	return err
}

// Lock takes the write lock (and arms the write timeout) so that several frames, written with
// WriteLocked or through Unix, go out together; Unlock releases it.
func (c *Conn) Lock() {
	c.wmu.Lock()
	c.writeDeadline()
}

// Unlock releases the write lock taken by Lock.
func (c *Conn) Unlock() { c.wmu.Unlock() }

// WriteLocked is Write for a caller that holds Lock.
func (c *Conn) WriteLocked(kind uint16, payload []byte, files []*os.File) error {
	var err error
	c.wbuf, err = writeFrame(c.uc, c.wbuf, kind, payload, files)
	return err
}

func (c *Conn) writeDeadline() {
	if c.wto > 0 {
		_ = c.uc.SetWriteDeadline(time.Now().Add(c.wto))
	}
}

// Close closes the socket; it is safe to call more than once and on nil.
func (c *Conn) Close() error {
	if c == nil {
		return nil
	}
	err := c.uc.Close()
	if err != nil && isClosedErr(err) {
		err = nil
	}
	return err
}

// PeerCred reads a connected socket's peer credentials (SO_PEERCRED: as they were at connect time).
func PeerCred(conn *net.UnixConn) (unix.Ucred, error) {
	rc, err := conn.SyscallConn()
	if err != nil {
		return unix.Ucred{}, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return unix.Ucred{}, err
	}
	if cerr != nil {
		return unix.Ucred{}, fmt.Errorf("getsockopt SO_PEERCRED: %w", cerr)
	}
	return *cred, nil
}

// UIDAllowed reports whether uid is in allowed; an empty list allows this process's uid only.
func UIDAllowed(allowed []int, uid uint32) bool {
	if len(allowed) == 0 {
		return int(uid) == os.Getuid()
	}
	for _, a := range allowed {
		if a >= 0 && uint32(a) == uid {
			return true
		}
	}
	return false
}
