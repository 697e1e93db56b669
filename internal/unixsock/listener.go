package unixsock

import (
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Defaults of Options.
const (
	DefaultMaxConns       = 256
	DefaultMaxConnsPerUID = 64
	DefaultIdleTimeout    = 5 * time.Minute
	DefaultReadTimeout    = 10 * time.Second
	DefaultWriteTimeout   = 10 * time.Second
)

// Options are a listener's rules. Zero fields take the defaults; a negative limit or timeout turns
// it off.
type Options struct {
	// AllowUIDs are the uids whose processes may connect (SO_PEERCRED). Empty: this process's uid.
	AllowUIDs []int
	// Authorize, when set, runs after the uid check with the peer's credentials; an error refuses
	// the peer.
	Authorize func(peer unix.Ucred) error
	// MaxConns caps the connections held at once (default DefaultMaxConns); one over it is refused
	// with ErrConnLimit and closed at once.
	MaxConns int
	// MaxConnsPerUID caps the connections held at once for one uid (default DefaultMaxConnsPerUID).
	MaxConnsPerUID int
	// IdleTimeout drops a peer that sends nothing for this long (default DefaultIdleTimeout).
	IdleTimeout time.Duration
	// ReadTimeout drops a peer that starts a frame and does not finish it within this long
	// (default DefaultReadTimeout; off: the idle timeout bounds it), with ErrTimeout.
	ReadTimeout time.Duration
	// WriteTimeout bounds each write (default DefaultWriteTimeout), so a peer that stops reading
	// cannot hold the server's goroutine or its files.
	WriteTimeout time.Duration
	// MaxPayload is the largest frame payload read (default and ceiling MaxPayload).
	MaxPayload int
	// Refuse, when set, tells a refused peer why (err wraps ErrPermission or ErrConnLimit) in the
	// protocol's own words before the connection is closed.
	Refuse func(c *Conn, err error)
	// Logf, when set, receives refusals and accept failures, each kind at most once a second (with
	// the number of events the line stands for).
	Logf func(format string, args ...any)
}

func (o *Options) defaults() {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	def(&o.MaxConns, DefaultMaxConns)
	def(&o.MaxConnsPerUID, DefaultMaxConnsPerUID)
	def(&o.MaxPayload, MaxPayload)
	o.MaxPayload = min(o.MaxPayload, MaxPayload)
	defDur(&o.IdleTimeout, DefaultIdleTimeout)
	defDur(&o.ReadTimeout, DefaultReadTimeout)
	defDur(&o.WriteTimeout, DefaultWriteTimeout)
}

// Stats are a listener's counters.
type Stats struct {
	Active   int    // connections held now
	Accepted uint64 // connections accepted since the start
	Refused  uint64 // refused: uid, Authorize, caps
	Backoffs uint64 // accept failures waited out (EMFILE, ENFILE, ...)
}

// Listener is a 0600 Unix socket and its accept loop.
type Listener struct {
	path string
	ln   *net.UnixListener
	opts Options
	// accept and peerCred are the system calls; tests replace them.
	accept   func() (*net.UnixConn, error)
	peerCred func(*net.UnixConn) (unix.Ucred, error)

	mu     sync.Mutex
	conns  map[*Conn]struct{}
	perUID map[uint32]int
	closed bool
	done   chan struct{} // closed when Close begins

	closeMu sync.Mutex // held through Close, so that a second Close waits for the first
	// refusals limits the refusal log lines to one a second (a flood of peers must not flood it).
	refusals rateLog
	wg       sync.WaitGroup

	accepted, refused, backoffs atomic.Uint64
}

// Listen creates the socket at path with mode 0600 in a directory that neither group nor others
// may write to and that belongs to this uid or root (else an error wrapping ErrPermission), replacing
// a stale socket of this uid that nobody listens on. Abstract names ("@x") are refused. Closing the
// listener removes the socket file.
func Listen(path string, opts Options) (*Listener, error) {
	opts.defaults()
	ln, err := listenFile(path)
	if err != nil {
		return nil, err
	}
	l := &Listener{path: path, ln: ln, opts: opts, accept: ln.AcceptUnix, peerCred: PeerCred,
		conns: map[*Conn]struct{}{}, perUID: map[uint32]int{}, done: make(chan struct{})}
	return l, nil
}

// Path is the socket's path.
func (l *Listener) Path() string { return l.path }

// Options are the listener's rules with the defaults filled in.
func (l *Listener) Options() Options { return l.opts }

// Stats reads the counters.
func (l *Listener) Stats() Stats {
	l.mu.Lock()
	n := len(l.conns)
	l.mu.Unlock()
	return Stats{Active: n, Accepted: l.accepted.Load(), Refused: l.refused.Load(), Backoffs: l.backoffs.Load()}
}

func (l *Listener) logf(format string, args ...any) {
	if l.opts.Logf != nil {
		l.opts.Logf(format, args...)
	}
}

// Serve accepts connections until Close and runs handle for each admitted one on its own goroutine;
// the connection is closed when handle returns. A peer refused by uid, Authorize or a cap is told
// (Options.Refuse) and closed without reaching handle. Accept failures from running out of
// descriptors (EMFILE, ENFILE) or memory are waited out with a growing pause (5 ms to 1 s) and logged
// at most once a second. Serve returns nil after Close, or the listener's error.
func (l *Listener) Serve(handle func(*Conn)) error {
	b := backoff{}
	for {
		uc, err := l.accept()
		if err != nil {
			if l.isClosed() {
				return nil
			}
			if !transient(err) {
				return fmt.Errorf("accept on %s: %w", l.path, err)
			}
			l.backoffs.Add(1)
			if line, ok := b.note(err, time.Now()); ok {
				l.logf("accept on %s: %s", l.path, line)
			}
			select {
			case <-l.done:
				return nil
			case <-time.After(b.delay):
			}
			continue
		}
		b.reset()
		l.accepted.Add(1)
		if !l.admit(uc, handle) {
			return nil
		}
	}
}

// admit reads the peer's credentials, applies the caps, and starts the connection's goroutine, which
// checks the uid and Authorize before the handler runs. It reports false once the listener is
// closed.
func (l *Listener) admit(uc *net.UnixConn, handle func(*Conn)) bool {
	c := &Conn{uc: uc, lim: readLimits{idle: pos(l.opts.IdleTimeout), message: pos(l.opts.ReadTimeout), maxPayload: l.opts.MaxPayload},
		wto: pos(l.opts.WriteTimeout)}
	cred, err := l.peerCred(uc)
	if err != nil {
		l.refused.Add(1)
		l.logf("%s: reading the peer's credentials: %v", l.path, err)
		uc.Close()
		return !l.isClosed()
	}
	c.peer = cred
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		uc.Close()
		return false
	}
	err = l.capped(cred.Uid)
	if err == nil {
		l.conns[c] = struct{}{}
		l.perUID[cred.Uid]++
		l.wg.Add(1)
	}
	l.mu.Unlock()
	if err != nil {
		l.refuse(c, err)
		return true
	}
	go func() {
		defer l.wg.Done()
		defer l.forget(c)
		// On the connection's goroutine: Authorize may take its time without holding up accept.
		if err := l.check(cred); err != nil {
			l.refuse(c, err)
			return
		}
		handle(c)
	}()
	return true
}

// check applies the uid allow-list and Authorize.
func (l *Listener) check(cred unix.Ucred) error {
	if !UIDAllowed(l.opts.AllowUIDs, cred.Uid) {
		return fmt.Errorf("peer pid %d runs as uid %d, which this server (uid %d) does not allow: %w", cred.Pid, cred.Uid, os.Getuid(), ErrPermission)
	}
	if l.opts.Authorize != nil {
		if err := l.opts.Authorize(cred); err != nil {
			return fmt.Errorf("peer pid %d uid %d: %v: %w", cred.Pid, cred.Uid, err, ErrPermission)
		}
	}
	return nil
}

// capped reports whether one more connection of uid would pass a cap; the caller holds mu.
func (l *Listener) capped(uid uint32) error {
	if l.opts.MaxConns > 0 && len(l.conns) >= l.opts.MaxConns {
		return fmt.Errorf("the server holds %d connections, its maximum (MaxConns): %w", len(l.conns), ErrConnLimit)
	}
	if l.opts.MaxConnsPerUID > 0 && l.perUID[uid] >= l.opts.MaxConnsPerUID {
		return fmt.Errorf("the server holds %d connections of uid %d, its maximum per uid (MaxConnsPerUID): %w", l.perUID[uid], uid, ErrConnLimit)
	}
	return nil
}

// refuse tells the peer why (with a short write deadline: the socket is fresh, its buffer empty)
// and closes the connection.
func (l *Listener) refuse(c *Conn, err error) {
	l.refused.Add(1)
	l.mu.Lock()
	line, due := l.refusals.note(fmt.Sprintf("refused pid %d: %v", c.peer.Pid, err), time.Now())
	l.mu.Unlock()
	if due {
		l.logf("%s: %s", l.path, line)
	}
	if l.opts.Refuse != nil {
		c.wto = 100 * time.Millisecond
		l.opts.Refuse(c, err)
	}
	c.uc.Close()
}

func (l *Listener) forget(c *Conn) {
	c.uc.Close()
	l.mu.Lock()
	delete(l.conns, c)
	if l.perUID[c.peer.Uid]--; l.perUID[c.peer.Uid] <= 0 {
		delete(l.perUID, c.peer.Uid)
	}
	l.mu.Unlock()
}

func (l *Listener) isClosed() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closed
}

// Close closes the listener (removing the socket file) and every connection, and waits for the
// handlers to return. It is idempotent and safe on nil; a Close made while another runs waits for
// it (a handler must not call Close).
func (l *Listener) Close() error {
	if l == nil {
		return nil
	}
	l.closeMu.Lock()
	defer l.closeMu.Unlock()
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	close(l.done)
	err := l.ln.Close()
	for c := range l.conns {
		c.uc.Close()
	}
	l.mu.Unlock()
	l.wg.Wait()
	if err != nil {
		return fmt.Errorf("close listener %s: %w", l.path, err)
	}
	return nil
}

func pos(d time.Duration) time.Duration { return max(d, 0) }

// transient reports the accept errors that pass: out of descriptors or memory, or a connection
// aborted before it was accepted.
func transient(err error) bool {
	for _, e := range []error{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM, syscall.ECONNABORTED} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// backoff is the accept loop's pause after transient failures, doubling from 5 ms to 1 s, with its
// log limiter.
type backoff struct {
	delay time.Duration
	log   rateLog
}

const (
	backoffMin = 5 * time.Millisecond
	backoffMax = time.Second
	logEvery   = time.Second
)

func (b *backoff) reset() { b.delay = 0 }

// note records one failure at now, grows the delay, and returns a log line when one is due.
func (b *backoff) note(err error, now time.Time) (string, bool) {
	b.delay = min(max(2*b.delay, backoffMin), backoffMax)
	return b.log.note(fmt.Sprintf("%v (pausing %v before accepting again)", err, b.delay), now)
}

// rateLog lets one line a second through and counts the others into the next.
type rateLog struct {
	last       time.Time
	suppressed int
}

func (r *rateLog) note(line string, now time.Time) (string, bool) {
	if !r.last.IsZero() && now.Sub(r.last) < logEvery {
		r.suppressed++
		return "", false
	}
	if r.suppressed > 0 {
		line += fmt.Sprintf(" [and %d more such events since the last report]", r.suppressed)
	}
	r.last, r.suppressed = now, 0
	return line, true
}

// SetPeerCred replaces how the listener reads a connection's credentials (SO_PEERCRED), so that
// tests can play a peer of another uid. Call it before Serve.
func (l *Listener) SetPeerCred(f func(*net.UnixConn) (unix.Ucred, error)) { l.peerCred = f }

// ListenUnix is the checked, 0600 socket of Listen without the accept loop, for callers that run
// their own.
func ListenUnix(path string) (*net.UnixListener, error) { return listenFile(path) }
