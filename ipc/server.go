package ipc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/unixsock"
	"github.com/cuvmm/cuvmm/vmm"
)

// ServerOptions tunes Listen. The zero value serves peers of this process's uid with the default
// limits and timeouts; a negative limit or timeout turns it off.
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
	// MaxConns caps the connections served at once (default 256); one more is refused with
	// CodeConnLimit (ErrConnLimit on the client) and closed.
	MaxConns int
	// MaxConnsPerUID caps the connections of one uid served at once (default 64).
	MaxConnsPerUID int
	// IdleTimeout drops a peer that sends no request for this long (default 5 min).
	IdleTimeout time.Duration
	// ReadTimeout drops a peer that starts a request and does not finish it within this long
	// (default 10 s; negative: the idle timeout bounds it), with CodeTimeout.
	ReadTimeout time.Duration
	// Logf, when set, receives the connections' failures (refused peers, broken requests, dropped
	// peers; refusals and accept failures at most once a second each).
	Logf func(format string, args ...any)
}

// Server serves named buffers on a Unix socket. Make one with Listen, add buffers with Publish, run
// Serve (usually in its own goroutine), and Close it.
type Server struct {
	path string
	ln   *unixsock.Listener
	opts ServerOptions

	// own's lock guards bufs. It is closed as soon as Close begins, so that nothing is published
	// once Close has taken the buffers.
	own  lifetime.Owner
	bufs map[string]*published

	closeMu sync.Mutex // held through Close, so that a second Close waits for the first
}

// published is one buffer's export, shared by the fetches in flight.
type published struct {
	exp     *Exported
	refs    int // sends in progress
	removed bool
}

// Listen creates the socket at path with mode 0600 and returns a server that is not serving yet.
// The directory holding path must be writable by its owner alone and belong to this uid or root
// (else an error wrapping ErrPermission): use a private directory such as one made by os.MkdirTemp
// or $XDG_RUNTIME_DIR. Abstract names ("@name") are refused (ErrPermission): they have no file
// permissions. A stale socket left at path by a dead server of the same uid is replaced; anything
// else at path is an error.
func Listen(path string, opts ServerOptions) (*Server, error) {
	if opts.Timeout == 0 {
		opts.Timeout = unixsock.DefaultWriteTimeout
	}
	s := &Server{path: path, opts: opts, bufs: map[string]*published{}}
	ln, err := unixsock.Listen(path, unixsock.Options{AllowUIDs: opts.AllowUIDs, Authorize: opts.Authorize,
		MaxConns: opts.MaxConns, MaxConnsPerUID: opts.MaxConnsPerUID, IdleTimeout: opts.IdleTimeout,
		ReadTimeout: opts.ReadTimeout, WriteTimeout: opts.Timeout, MaxPayload: MaxNameLen,
		Refuse: s.refuse, Logf: s.prefixedLogf})
	if err != nil {
		return nil, fmt.Errorf("ipc: %w", err)
	}
	s.ln = ln
	s.own.Init(nil, "buffer server")
	lifetime.Track(s, &s.own)
	return s, nil
}

// Path is the socket's path.
func (s *Server) Path() string { return s.path }

// Publish exports every chunk of buf (Export) and serves it under name. The buffer's layout is the
// one at the time of the call: Republish it after it grows. The server keeps the exported files
// open until Unpublish or Close, so the memory stays fetchable (and alive) while published even if
// buf is closed.
func (s *Server) Publish(name string, buf vmm.Chunked) error {
	if err := validName(name); err != nil {
		return fmt.Errorf("ipc: publish: %w", err)
	}
	s.own.Lock()
	closed, exists := s.own.Closed(), s.bufs[name] != nil
	s.own.Unlock()
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
	s.own.Lock()
	defer s.own.Unlock()
	switch {
	case s.own.Closed():
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

// Republish serves buf's layout now under name in place of what was published there (or publishes
// it), for a buffer that grew: a fetch gets the old layout or the new one, never an error in
// between. The old exported files close once the fetches in flight that send them are done;
// importers of the old layout keep their mappings.
func (s *Server) Republish(name string, buf vmm.Chunked) error {
	if err := validName(name); err != nil {
		return fmt.Errorf("ipc: republish: %w", err)
	}
	e, err := Export(buf)
	if err != nil {
		return fmt.Errorf("ipc: republish %q: %w", name, err)
	}
	e.Desc.Name = name
	s.own.Lock()
	if s.own.Closed() {
		s.own.Unlock()
		return errors.Join(fmt.Errorf("ipc: republish %q: %w", name, ErrClosed), e.Close())
	}
	old := s.bufs[name]
	s.bufs[name] = &published{exp: e}
	done := old != nil && old.refs == 0
	if old != nil {
		old.removed = true
	}
	s.own.Unlock()
	if done {
		return old.exp.Close()
	}
	return nil
}

// Unpublish stops serving name and closes its exported files once the fetches in flight are done.
// Importers keep their mappings. A name that is not published is an error wrapping ErrNotFound,
// and Unpublish on a closed server one wrapping ErrClosed.
func (s *Server) Unpublish(name string) error {
	s.own.Lock()
	if s.own.Closed() {
		s.own.Unlock()
		return fmt.Errorf("ipc: unpublish %q: %w", name, ErrClosed)
	}
	p := s.bufs[name]
	if p == nil {
		s.own.Unlock()
		return fmt.Errorf("ipc: unpublish %q: %w", name, ErrNotFound)
	}
	delete(s.bufs, name)
	p.removed = true
	done := p.refs == 0
	s.own.Unlock()
	if done {
		return p.exp.Close()
	}
	return nil
}

// Names are the published names.
func (s *Server) Names() []string {
	s.own.Lock()
	defer s.own.Unlock()
	out := make([]string, 0, len(s.bufs))
	for n := range s.bufs {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

func (s *Server) acquire(name string) *published {
	s.own.Lock()
	defer s.own.Unlock()
	p := s.bufs[name]
	if p != nil {
		p.refs++
	}
	return p
}

func (s *Server) release(p *published) {
	s.own.Lock()
	p.refs--
	last := p.removed && p.refs == 0
	s.own.Unlock()
	if last {
		_ = p.exp.Close()
	}
}

func (s *Server) logf(format string, args ...any) {
	if s.opts.Logf != nil {
		s.opts.Logf(format, args...)
	}
}

func (s *Server) prefixedLogf(format string, args ...any) { s.logf("ipc: "+format, args...) }

// refuse tells a peer the transport refused why.
func (s *Server) refuse(c *unixsock.Conn, err error) {
	_ = c.Write(KindError, encodeRemoteError(codeOf(err), err.Error()), nil)
}

// Serve accepts connections until Close, serving each in its own goroutine. It returns nil after
// Close, or the listener's error.
func (s *Server) Serve() error {
	if err := s.ln.Serve(s.serveConn); err != nil {
		return fmt.Errorf("ipc: %w", err)
	}
	return nil
}

// serveConn answers one admitted peer's fetches until it hangs up, breaks the protocol or goes
// silent.
func (s *Server) serveConn(c *unixsock.Conn) {
	pid := c.Peer().Pid
	for {
		f, err := c.Read()
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				s.logf("ipc: %s: peer pid %d: %v (closing the connection)", s.path, pid, err)
				if code := codeOf(err); code != CodeInternal {
					s.reply(c, code, err.Error())
				}
			}
			return
		}
		if len(f.Files) > 0 {
			n := len(f.Files)
			_ = closeFiles(f.Files)
			s.reply(c, CodeProtocol, fmt.Sprintf("a kind %d request carried %d descriptors nobody asked for (closed)", f.Kind, n))
			return
		}
		if f.Kind != KindFetch {
			s.reply(c, CodeProtocol, fmt.Sprintf("unexpected message kind %d (want %d, a fetch)", f.Kind, KindFetch))
			return
		}
		if !s.fetch(c, string(f.Payload)) {
			return
		}
	}
}

// fetch answers one fetch; it reports whether the connection stays usable.
func (s *Server) fetch(c *unixsock.Conn, name string) bool {
	if err := validName(name); err != nil {
		s.reply(c, CodeProtocol, err.Error())
		return false
	}
	p := s.acquire(name)
	if p == nil {
		return s.reply(c, CodeNotFound, fmt.Sprintf("no buffer named %q is published on %s", name, s.path))
	}
	c.Lock()
	err := Send(c.Unix(), p.exp)
	c.Unlock()
	s.release(p)
	if err != nil {
		s.logf("ipc: %s: sending %q to pid %d: %v", s.path, name, c.Peer().Pid, err)
		return false
	}
	return true
}

// reply sends a KindError message; it reports whether the write succeeded.
func (s *Server) reply(c *unixsock.Conn, code uint16, msg string) bool {
	return c.Write(KindError, encodeRemoteError(code, msg), nil) == nil
}

// Close stops serving: it closes the listener (removing the socket file) and the open connections,
// waits for their goroutines, and closes every published buffer's files. Importers keep their
// mappings. Close is idempotent and safe on nil; a Close made while another runs waits for it.
func (s *Server) Close() error {
	if s == nil {
		return nil
	}
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	// Closed from here on: Publish refuses, and a second Close only waits for this one, even when
	// this one fails to close something.
	if !s.own.Shut() {
		return nil
	}
	var errs []error
	if err := s.ln.Close(); err != nil {
		errs = append(errs, fmt.Errorf("ipc: %w", err))
	}
	s.own.Lock()
	bufs := s.bufs
	s.bufs = map[string]*published{}
	s.own.Unlock()
	for _, p := range bufs {
		if err := p.exp.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// DialOptions tunes DialContext.
type DialOptions struct {
	// AllowUIDs are the uids the server may run as (checked with SO_PEERCRED). Empty means this
	// process's uid or root.
	AllowUIDs []int
	// Timeout bounds one Fetch (default 30 s).
	Timeout time.Duration
	// Retry keeps dialing while the socket does not exist or nobody listens on it (a server that is
	// starting or restarting), until the context ends.
	Retry bool
}

// Client fetches buffers from a Server. Its methods are safe for concurrent use (fetches are
// serialized on the one connection).
type Client struct {
	path   string
	conn   *unixsock.Conn
	opts   DialOptions
	server unix.Ucred

	own    lifetime.Owner // its lock guards conn's replacement against Close
	mu     sync.Mutex     // serializes fetches; taken before own's lock
	broken error          // the error that left the connection unusable
}

// Dial connects to the server at path and checks that it runs as this process's uid or root.
func Dial(path string) (*Client, error) {
	return DialContext(context.Background(), path, DialOptions{})
}

// Deprecated: DialWithOptions is DialContext with context.Background().
func DialWithOptions(path string, opts DialOptions) (*Client, error) {
	return DialContext(context.Background(), path, opts)
}

// DialContext is Dial with a context (bounding the connect, and the retries with opts.Retry) and
// options. A server of a uid not allowed, a socket the filesystem does not let this process reach
// (EACCES) and an abstract name ("@name") give errors wrapping ErrPermission.
func DialContext(ctx context.Context, path string, opts DialOptions) (*Client, error) {
	if opts.Timeout <= 0 {
		opts.Timeout = 30 * time.Second
	}
	c, err := unixsock.Dial(ctx, path, unixsock.DialOptions{AllowUIDs: opts.AllowUIDs, Retry: opts.Retry})
	if err != nil {
		return nil, fmt.Errorf("ipc: %w", err)
	}
	cl := &Client{path: path, conn: c, opts: opts, server: c.Peer()}
	cl.own.Init(nil, "buffer client")
	lifetime.Track(cl, &cl.own)
	return cl, nil
}

// Server is the server's pid, uid and gid as the kernel reported them at connect time.
func (c *Client) Server() unix.Ucred {
	c.own.Lock()
	defer c.own.Unlock()
	return c.server
}

// Fetch asks the server for the buffer published as name and receives it (see Receive). A name that
// is not published gives an error wrapping ErrNotFound; the connection stays usable after that. A
// connection the server dropped for being idle (ServerOptions.IdleTimeout) is dialed again, once,
// transparently. Close the Received after opening it.
func (c *Client) Fetch(name string) (*Received, error) {
	if err := validName(name); err != nil {
		return nil, fmt.Errorf("ipc: fetch: %w", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.own.IsClosed() {
		return nil, fmt.Errorf("ipc: fetch %q: %w", name, ErrClosed)
	}
	if c.broken != nil {
		return nil, fmt.Errorf("ipc: fetch %q: the connection failed earlier: %w", name, c.broken)
	}
	r, err := c.fetch(name)
	if err != nil && errors.Is(err, ErrIdle) && c.redial() == nil {
		r, err = c.fetch(name)
	}
	if err != nil {
		var re *ServerError
		if !errors.As(err, &re) || re.Code != CodeNotFound {
			c.broken = err
		}
		return nil, fmt.Errorf("ipc: fetch %q: %w", name, err)
	}
	return r, nil
}

// fetch sends one fetch and reads the answer; the caller holds mu.
func (c *Client) fetch(name string) (*Received, error) {
	uc := c.conn.Unix()
	_ = uc.SetDeadline(time.Now().Add(c.opts.Timeout))
	defer uc.SetDeadline(time.Time{})
	werr := c.conn.Write(KindFetch, []byte(name), nil)
	// Read even when the write failed: a server that refused or dropped this peer has sent why and
	// hung up.
	r, err := Receive(uc)
	if err == nil && werr != nil {
		// Cannot happen with a well-behaved server; do not trust the reply.
		_ = r.Close()
		err = werr
	}
	var re *ServerError
	if err != nil && werr != nil && !errors.As(err, &re) {
		err = werr
	}
	return r, err
}

// redial replaces a connection the server dropped; the caller holds mu.
func (c *Client) redial() error {
	ctx, cancel := context.WithTimeout(context.Background(), c.opts.Timeout)
	defer cancel()
	conn, err := unixsock.Dial(ctx, c.path, unixsock.DialOptions{AllowUIDs: c.opts.AllowUIDs})
	if err != nil {
		return err
	}
	c.own.Lock()
	defer c.own.Unlock()
	if c.own.Closed() {
		_ = conn.Close()
		return ErrClosed
	}
	_ = c.conn.Close()
	c.conn, c.server = conn, conn.Peer()
	return nil
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
	if c == nil {
		return nil
	}
	c.own.Lock()
	defer c.own.Unlock()
	if c.own.Closed() {
		return nil
	}
	c.own.MarkClosed()
	return c.conn.Close()
}
