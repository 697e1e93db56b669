package ipc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/vmm"
)

// ServerOptions tunes Listen. The zero value serves peers of this process's uid.
type ServerOptions struct {
	// AllowUIDs are the uids whose processes may fetch buffers (checked with SO_PEERCRED). Empty
	// means this process's uid only; when set, it is the whole list (add os.Getuid() to keep it).
	AllowUIDs []int
	// Authorize, when set, is an extra check run after the uid check with the peer's credentials
	// (pid, uid, gid); an error refuses the peer and is sent back to it.
	Authorize func(peer unix.Ucred) error
	// Timeout bounds writing one reply (default 10 s), so a peer that stops reading cannot hold a
	// buffer's files forever.
	Timeout time.Duration
	// Logf, when set, receives the connections' failures (refused peers, broken requests).
	Logf func(format string, args ...any)
}

// Server serves named buffers on a Unix socket. Make one with Listen, add buffers with Publish, run
// Serve (usually in its own goroutine), and Close it.
type Server struct {
	path string
	ln   *net.UnixListener
	opts ServerOptions
	// peerCred reads a connection's peer credentials (SO_PEERCRED); tests replace it.
	peerCred func(*net.UnixConn) (unix.Ucred, error)

	mu     sync.Mutex
	bufs   map[string]*published
	conns  map[*net.UnixConn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// published is one buffer's export, shared by the fetches in flight.
type published struct {
	exp     *Exported
	refs    int // sends in progress
	removed bool
}

// Listen creates the socket at path with mode 0600 and returns a server that is not serving yet.
// The directory holding path must not be writable by others (mode o+w, sticky or not, is refused
// with an error wrapping ErrPermission): use a private directory such as one made by os.MkdirTemp
// or $XDG_RUNTIME_DIR. A stale socket left at path by a dead server of the same uid is replaced;
// anything else at path is an error.
func Listen(path string, opts ServerOptions) (*Server, error) {
	if opts.Timeout <= 0 {
		opts.Timeout = 10 * time.Second
	}
	ln, err := ListenUnix(path)
	if err != nil {
		return nil, err
	}
	return &Server{path: path, ln: ln, opts: opts, peerCred: peerCredentials,
		bufs: map[string]*published{}, conns: map[*net.UnixConn]struct{}{}}, nil
}

// checkSocketDir refuses a socket directory that other users may write to.
func checkSocketDir(path string) error {
	if len(path) >= len(unix.RawSockaddrUnix{}.Path) {
		return fmt.Errorf("ipc: listen on %s: the path is %d bytes, a Unix socket path must be under %d", path, len(path), len(unix.RawSockaddrUnix{}.Path))
	}
	dir := filepath.Dir(path)
	st, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("ipc: listen on %s: socket directory: %w", path, err)
	}
	if !st.IsDir() {
		return fmt.Errorf("ipc: listen on %s: %s is not a directory", path, dir)
	}
	if st.Mode().Perm()&0o002 != 0 {
		return fmt.Errorf("ipc: listen on %s: the directory %s is world-writable (mode %v): another user could put a socket of theirs there; use a private directory (os.MkdirTemp, $XDG_RUNTIME_DIR): %w", path, dir, st.Mode(), ErrPermission)
	}
	return nil
}

// listen0600 binds a Unix stream socket at path whose file is created with mode 0600: fchmod on the
// socket before bind sets the mode bind gives the file (less the umask), so no other user can
// connect in a window between bind and chmod.
func listen0600(path string) (*net.UnixListener, error) {
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var ferr error
		if err := c.Control(func(fd uintptr) { ferr = unix.Fchmod(int(fd), 0o600) }); err != nil {
			return err
		}
		if ferr != nil {
			return fmt.Errorf("fchmod 0600 on the socket: %w", ferr)
		}
		return nil
	}}
	l, err := lc.Listen(context.Background(), "unix", path)
	if err != nil {
		return nil, err
	}
	return l.(*net.UnixListener), nil
}

// removeStale removes a socket at path that belongs to this uid and that nobody listens on.
func removeStale(path string) bool {
	st, err := os.Lstat(path)
	if err != nil || st.Mode()&os.ModeSocket == 0 {
		return false
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); !ok || int(sys.Uid) != os.Getuid() {
		return false
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return false
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return false
	}
	return os.Remove(path) == nil
}

// peerCredentials reads the connected peer's pid, uid and gid (SO_PEERCRED: as they were at
// connect time).
func peerCredentials(conn *net.UnixConn) (unix.Ucred, error) {
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

// allowUID checks uid against an allow-list (empty: this process's uid).
func allowUID(allowed []int, uid uint32) bool {
	if len(allowed) == 0 {
		return int(uid) == os.Getuid()
	}
	return slices.Contains(allowed, int(uid))
}

// Path is the socket's path.
func (s *Server) Path() string { return s.path }

// Publish exports every chunk of buf (Export) and serves it under name. The buffer's layout is the
// one at the time of the call: publish again after it grows. The server keeps the exported files
// open until Unpublish or Close, so the memory stays fetchable (and alive) while published even if
// buf is closed.
func (s *Server) Publish(name string, buf vmm.Chunked) error {
	if err := validName(name); err != nil {
		return fmt.Errorf("ipc: publish: %w", err)
	}
	s.mu.Lock()
	closed, exists := s.closed, s.bufs[name] != nil
	s.mu.Unlock()
	if closed {
		return fmt.Errorf("ipc: publish %q: %w", name, ErrClosed)
	}
	if exists {
		return fmt.Errorf("ipc: publish %q: %w", name, ErrExists)
	}
	e, err := Export(buf)
	if err != nil {
		return fmt.Errorf("ipc: publish %q: %w", name, err)
	}
	e.Desc.Name = name
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		err = ErrClosed
	case s.bufs[name] != nil:
		err = ErrExists
	}
	if err != nil {
		_ = e.Close()
		return fmt.Errorf("ipc: publish %q: %w", name, err)
	}
	s.bufs[name] = &published{exp: e}
	return nil
}

// Unpublish stops serving name and closes its exported files once the fetches in flight are done.
// Importers keep their mappings. A name that is not published is an error wrapping ErrNotFound.
func (s *Server) Unpublish(name string) error {
	s.mu.Lock()
	p := s.bufs[name]
	if p == nil {
		s.mu.Unlock()
		return fmt.Errorf("ipc: unpublish %q: %w", name, ErrNotFound)
	}
	delete(s.bufs, name)
	p.removed = true
	done := p.refs == 0
	s.mu.Unlock()
	if done {
		return p.exp.Close()
	}
	return nil
}

// Names are the published names.
func (s *Server) Names() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.bufs))
	for n := range s.bufs {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

func (s *Server) acquire(name string) *published {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.bufs[name]
	if p != nil {
		p.refs++
	}
	return p
}

func (s *Server) release(p *published) {
	s.mu.Lock()
	p.refs--
	last := p.removed && p.refs == 0
	s.mu.Unlock()
	if last {
		_ = p.exp.Close()
	}
}

func (s *Server) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

func (s *Server) logf(format string, args ...any) {
	if s.opts.Logf != nil {
		s.opts.Logf(format, args...)
	}
}

// Serve accepts connections until Close, serving each in its own goroutine. It returns nil after
// Close, or the listener's error.
func (s *Server) Serve() error {
	for {
		conn, err := Accept(s.ln, s.isClosed, s.logf)
		if conn == nil {
			if err != nil {
				err = fmt.Errorf("ipc: %w", err)
			}
			return err
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			conn.Close()
			return nil
		}
		s.conns[conn] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.serveConn(conn)
	}
}

// serveConn checks the peer's credentials and answers its fetches until it hangs up.
func (s *Server) serveConn(conn *net.UnixConn) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.conns, conn)
		s.mu.Unlock()
		conn.Close()
	}()
	cred, err := s.peerCred(conn)
	if err != nil {
		s.logf("ipc: %s: reading the peer's credentials: %v", s.path, err)
		return
	}
	if !allowUID(s.opts.AllowUIDs, cred.Uid) {
		msg := fmt.Sprintf("peer pid %d runs as uid %d, which this server (uid %d) does not allow", cred.Pid, cred.Uid, os.Getuid())
		s.logf("ipc: %s: refused: %s", s.path, msg)
		s.reply(conn, CodePermission, msg)
		return
	}
	if s.opts.Authorize != nil {
		if err := s.opts.Authorize(cred); err != nil {
			msg := fmt.Sprintf("peer pid %d uid %d: %v", cred.Pid, cred.Uid, err)
			s.logf("ipc: %s: refused: %s", s.path, msg)
			s.reply(conn, CodePermission, msg)
			return
		}
	}
	for {
		kind, payload, files, err := ReadMessage(conn)
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				s.logf("ipc: %s: peer pid %d: %v", s.path, cred.Pid, err)
				if errors.Is(err, ErrProtocol) {
					s.reply(conn, CodeProtocol, err.Error())
				}
			}
			return
		}
		if len(files) > 0 {
			n := len(files)
			_ = closeFiles(files)
			s.reply(conn, CodeProtocol, fmt.Sprintf("a kind %d request carried %d descriptors nobody asked for (closed)", kind, n))
			return
		}
		if kind != KindFetch {
			s.reply(conn, CodeProtocol, fmt.Sprintf("unexpected message kind %d (want %d, a fetch)", kind, KindFetch))
			return
		}
		name := string(payload)
		if err := validName(name); err != nil {
			s.reply(conn, CodeProtocol, err.Error())
			return
		}
		p := s.acquire(name)
		if p == nil {
			if !s.reply(conn, CodeNotFound, fmt.Sprintf("no buffer named %q is published on %s", name, s.path)) {
				return
			}
			continue
		}
		_ = conn.SetWriteDeadline(time.Now().Add(s.opts.Timeout))
		err = Send(conn, p.exp)
		_ = conn.SetWriteDeadline(time.Time{})
		s.release(p)
		if err != nil {
			s.logf("ipc: %s: sending %q to pid %d: %v", s.path, name, cred.Pid, err)
			return
		}
	}
}

// reply sends a KindError message; it reports whether the write succeeded.
func (s *Server) reply(conn *net.UnixConn, code uint16, msg string) bool {
	_ = conn.SetWriteDeadline(time.Now().Add(s.opts.Timeout))
	defer conn.SetWriteDeadline(time.Time{})
	return WriteMessage(conn, KindError, encodeRemoteError(code, msg), nil) == nil
}

// Close stops serving: it closes the listener (removing the socket file) and the open connections,
// waits for their goroutines, and closes every published buffer's files. Importers keep their
// mappings. Close is idempotent and safe on nil.
func (s *Server) Close() error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	err := s.ln.Close()
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	s.mu.Lock()
	bufs := s.bufs
	s.bufs = map[string]*published{}
	s.mu.Unlock()
	var errs []error
	if err != nil {
		errs = append(errs, fmt.Errorf("ipc: close listener %s: %w", s.path, err))
	}
	for _, p := range bufs {
		if err := p.exp.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// DialOptions tunes DialWithOptions.
type DialOptions struct {
	// AllowUIDs are the uids the server may run as (checked with SO_PEERCRED). Empty means this
	// process's uid or root.
	AllowUIDs []int
	// Timeout bounds one Fetch (default 30 s).
	Timeout time.Duration
}

// Client fetches buffers from a Server. Its methods are safe for concurrent use (fetches are
// serialized on the one connection).
type Client struct {
	conn   *net.UnixConn
	opts   DialOptions
	server unix.Ucred

	closed atomic.Bool
	mu     sync.Mutex // serializes fetches
	broken error      // the error that left the connection unusable
}

// Dial connects to the server at path and checks that it runs as this process's uid or root.
func Dial(path string) (*Client, error) { return DialWithOptions(path, DialOptions{}) }

// DialWithOptions is Dial with options.
func DialWithOptions(path string, opts DialOptions) (*Client, error) {
	if opts.Timeout <= 0 {
		opts.Timeout = 30 * time.Second
	}
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("ipc: dial %s: %w", path, err)
	}
	cred, err := peerCredentials(conn)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("ipc: dial %s: %w", path, err)
	}
	ok := allowUID(opts.AllowUIDs, cred.Uid)
	if len(opts.AllowUIDs) == 0 && cred.Uid == 0 {
		ok = true
	}
	if !ok {
		conn.Close()
		return nil, fmt.Errorf("ipc: dial %s: the server (pid %d) runs as uid %d, which this client (uid %d) does not allow: %w", path, cred.Pid, cred.Uid, os.Getuid(), ErrPermission)
	}
	return &Client{conn: conn, opts: opts, server: cred}, nil
}

// Server is the server's pid, uid and gid as the kernel reported them at connect time.
func (c *Client) Server() unix.Ucred { return c.server }

// Fetch asks the server for the buffer published as name and receives it (see Receive). A name that
// is not published gives an error wrapping ErrNotFound; the connection stays usable after that. Close
// the Received after opening it.
func (c *Client) Fetch(name string) (*Received, error) {
	if err := validName(name); err != nil {
		return nil, fmt.Errorf("ipc: fetch: %w", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed.Load() {
		return nil, fmt.Errorf("ipc: fetch %q: %w", name, ErrClosed)
	}
	if c.broken != nil {
		return nil, fmt.Errorf("ipc: fetch %q: the connection failed earlier: %w", name, c.broken)
	}
	_ = c.conn.SetDeadline(time.Now().Add(c.opts.Timeout))
	defer c.conn.SetDeadline(time.Time{})
	werr := WriteMessage(c.conn, KindFetch, []byte(name), nil)
	// Read even when the write failed: a server that refused this peer has sent why and hung up.
	r, err := Receive(c.conn)
	if err == nil && werr != nil {
		// Cannot happen with a well-behaved server; do not trust the reply.
		_ = r.Close()
		err = werr
	}
	if err != nil {
		var re *RemoteError
		if !errors.As(err, &re) || re.Code != CodeNotFound {
			c.broken = err
		}
		if werr != nil && re == nil {
			err = werr
		}
		return nil, fmt.Errorf("ipc: fetch %q: %w", name, err)
	}
	return r, nil
}

// Open fetches name and opens it through dev with access (see Open); the received files are closed
// before it returns.
func (c *Client) Open(dev *vmm.Device, name string, access ...vmm.Access) (*Buffer, error) {
	r, err := c.Fetch(name)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	return Open(dev, r, access...)
}

// Close closes the connection (a Fetch in progress fails). It is idempotent and safe on nil.
func (c *Client) Close() error {
	if c == nil || c.closed.Swap(true) {
		return nil
	}
	return c.conn.Close()
}
