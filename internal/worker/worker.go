// Package worker runs a role of this program in a second process: it re-executes the running binary
// with the role named in the environment, hands it one end of a Unix socket pair as its control
// connection, and speaks a small JSON call-and-report protocol over it. The command's multi-process
// measurements and the multi-process tests use it, so that there is one way to start, talk to, kill
// and reap a child.
//
// The child inherits the parent's environment (plus the role's variables), so settings such as
// NCCL_NVLS_ENABLE or CUDA_VISIBLE_DEVICES reach it. A program that serves roles calls Main first
// thing in main (and in TestMain for a test binary): in a child it runs the role and exits.
package worker

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// The environment a child is started with.
const (
	EnvRole = "CUVMM_WORKER_ROLE" // the role the child runs
	EnvFD   = "CUVMM_WORKER_FD"   // the child's end of the control socket
)

// ErrUnknownRole is returned (and reported by a child) for a role nobody registered.
var ErrUnknownRole = errors.New("worker: unknown role")

var (
	rolesMu sync.Mutex
	roles   = map[string]func(*Conn) error{}
)

// Register makes fn the body of role: in a child started for role, Main calls fn with the control
// connection to the parent. A role registered twice panics (a programming error).
func Register(role string, fn func(*Conn) error) {
	rolesMu.Lock()
	defer rolesMu.Unlock()
	if _, dup := roles[role]; dup {
		panic("worker: role " + role + " registered twice")
	}
	roles[role] = fn
}

// Main runs the role named in the environment and exits the process (status 0 when the role
// returned nil, 1 after printing its error on stderr). Outside a child it returns at once.
func Main() {
	role, ok := os.LookupEnv(EnvRole)
	if !ok {
		return
	}
	// Processes this worker starts are not workers of this role.
	os.Unsetenv(EnvRole)
	if err := runRole(role); err != nil {
		fmt.Fprintf(os.Stderr, "worker %s: %v\n", role, err)
		os.Exit(1)
	}
	os.Exit(0)
}

func runRole(role string) error {
	rolesMu.Lock()
	fn := roles[role]
	rolesMu.Unlock()
	conn, err := parentConn()
	if err != nil {
		return err
	}
	defer conn.Close()
	if fn == nil {
		err := fmt.Errorf("%q: %w", role, ErrUnknownRole)
		if conn != nil {
			_ = conn.Report(nil, err)
		}
		return err
	}
	return fn(conn)
}

// parentConn turns the inherited descriptor named in EnvFD into the control connection.
func parentConn() (*Conn, error) {
	s := os.Getenv(EnvFD)
	os.Unsetenv(EnvFD)
	if s == "" {
		return nil, nil // started without a control socket (Options.NoControl)
	}
	fd, err := strconv.Atoi(s)
	if err != nil || fd < 3 {
		return nil, fmt.Errorf("%s=%q: want a descriptor number of 3 or more", EnvFD, s)
	}
	f := os.NewFile(uintptr(fd), "worker-parent")
	fc, err := net.FileConn(f)
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("the socket to the parent (fd %d): %w", fd, err)
	}
	uc, ok := fc.(*net.UnixConn)
	if !ok {
		fc.Close()
		return nil, fmt.Errorf("the socket to the parent (fd %d) is not a Unix socket", fd)
	}
	return newConn(uc), nil
}

// Options say how to start a child.
type Options struct {
	// Args are passed to the binary (a test binary needs "-test.run=^$" so that it runs no tests).
	Args []string
	// Env is added to the parent's environment.
	Env []string
	// Stdin, Stdout and Stderr of the child; nil means /dev/null for Stdin and the parent's Stderr
	// for the other two. A writer that is not an *os.File is written by a goroutine per stream;
	// give several children one SyncWriter to share a writer among them.
	Stdin          io.Reader
	Stdout, Stderr io.Writer
	// Files become the child's descriptors 3, 4, ...; the control socket comes after them.
	Files []*os.File
	// NoControl starts the child without a control socket (Process.Conn is nil); the caller talks
	// to it through Files or its standard streams.
	NoControl bool
}

// Process is a started child.
type Process struct {
	cmd *exec.Cmd
	// Conn is the control connection (nil with Options.NoControl).
	Conn   *Conn
	wait   sync.Once
	werr   error
	reaped atomic.Bool // Wait's cmd.Wait has returned (and set cmd.ProcessState)
}

// Start re-executes this binary as a child running role. An empty role starts the binary as it
// is (a test binary's TestMain, for one, may pick its part from opts.Env).
func Start(role string, opts Options) (*Process, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("worker %s: finding this executable: %w", role, err)
	}
	cmd := exec.Command(exe, opts.Args...)
	cmd.Env = append(parentEnv(), opts.Env...)
	if role != "" {
		cmd.Env = append(cmd.Env, EnvRole+"="+role)
	}
	if os.Getenv("GORACE") == "" {
		// Under -race a child would otherwise sleep a second at exit (TSan's atexit_sleep_ms).
		cmd.Env = append(cmd.Env, "GORACE=atexit_sleep_ms=0")
	}
	cmd.Stdin = opts.Stdin
	cmd.Stdout, cmd.Stderr = output(opts.Stdout), output(opts.Stderr)
	cmd.ExtraFiles = append([]*os.File(nil), opts.Files...)
	// Output copied through a pipe (a writer that is not a file) ends only when every process
	// holding the pipe has exited: without a bound, a grandchild the child started would keep Wait,
	// and so Kill, waiting for as long as it lives.
	cmd.WaitDelay = waitDelay
	p := &Process{cmd: cmd}
	var theirs *os.File
	if !opts.NoControl {
		var mine *Conn
		if mine, theirs, err = socketPair(); err != nil {
			return nil, fmt.Errorf("worker %s: %w", role, err)
		}
		p.Conn = mine
		cmd.ExtraFiles = append(cmd.ExtraFiles, theirs)
		cmd.Env = append(cmd.Env, EnvFD+"="+strconv.Itoa(2+len(cmd.ExtraFiles)))
	}
	err = cmd.Start()
	if theirs != nil {
		theirs.Close()
	}
	if err != nil {
		if p.Conn != nil {
			p.Conn.Close()
		}
		return nil, fmt.Errorf("worker %s: starting %s: %w", role, exe, err)
	}
	return p, nil
}

// parentEnv is this process's environment less this package's variables (a child started by a
// worker is not that worker again).
func parentEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, EnvRole+"=") && !strings.HasPrefix(kv, EnvFD+"=") {
			env = append(env, kv)
		}
	}
	return env
}

// output is w, serialised unless it is a file, already serialised, or nil (the parent's stderr).
func output(w io.Writer) io.Writer {
	switch w.(type) {
	case nil:
		return os.Stderr
	case *os.File, *syncWriter:
		return w
	}
	return SyncWriter(w)
}

// SyncWriter wraps w so that several goroutines may write to it at once. Children given the same
// wrapped writer as their output share its lock.
func SyncWriter(w io.Writer) io.Writer {
	if sw, ok := w.(*syncWriter); ok {
		return sw
	}
	return &syncWriter{w: w}
}

type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *syncWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// socketPair makes a connected pair: the parent's end as a Conn, the child's as a file.
func socketPair() (*Conn, *os.File, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("socketpair: %w", err)
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "worker-parent"), os.NewFile(uintptr(fds[1]), "worker-child")
	fc, err := net.FileConn(mine)
	mine.Close()
	if err != nil {
		theirs.Close()
		return nil, nil, err
	}
	return newConn(fc.(*net.UnixConn)), theirs, nil
}

// Pid is the child's process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Wait closes the control connection, waits for the child to exit and returns its status as an
// error (nil for a clean exit). It may be called more than once.
func (p *Process) Wait() error {
	p.wait.Do(func() {
		if p.Conn != nil {
			p.Conn.Close()
		}
		if err := p.cmd.Wait(); err != nil {
			p.werr = fmt.Errorf("worker (pid %d): %w", p.Pid(), err)
		}
		p.reaped.Store(true)
	})
	return p.werr
}

// waitDelay bounds how long Wait waits, once the child has exited, for its output pipes to close.
const waitDelay = 2 * time.Second

// Kill ends the child with SIGKILL and reaps it; a child that already exited is only reaped. The
// error is Wait's.
func (p *Process) Kill() error {
	_ = p.cmd.Process.Kill() // after a reap it does nothing (os.ErrProcessDone)
	return p.Wait()
}

// ExitState is the child's state after Wait (nil before).
func (p *Process) ExitState() *os.ProcessState {
	if !p.reaped.Load() {
		return nil
	}
	return p.cmd.ProcessState
}
