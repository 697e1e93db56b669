package unixsock

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"time"
)

// DialOptions are a client's rules.
type DialOptions struct {
	// AllowUIDs are the uids the server may run as (SO_PEERCRED). Empty: this process's uid or root.
	AllowUIDs []int
	// Retry keeps dialing while the socket does not exist or nobody listens on it (a server that is
	// starting or restarting), until the context ends.
	Retry bool
}

// Dial connects to the server at path and checks its credentials. A socket the filesystem does not
// let this process reach (EACCES, EPERM) and a server of a uid not allowed give errors wrapping
// ErrPermission; abstract names ("@x") are refused.
func Dial(ctx context.Context, path string, opts DialOptions) (*Conn, error) {
	if err := checkPath(path); err != nil {
		return nil, fmt.Errorf("dial %s: %w", path, err)
	}
	var d net.Dialer
	for {
		c, err := d.DialContext(ctx, "unix", path)
		if err == nil {
			return checkServer(c.(*net.UnixConn), path, opts)
		}
		retry := opts.Retry && (errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED))
		if !retry || ctx.Err() != nil {
			return nil, fmt.Errorf("dial %s: %w", path, permission(err))
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("dial %s: %w (last: %v)", path, ctx.Err(), err)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func checkServer(uc *net.UnixConn, path string, opts DialOptions) (*Conn, error) {
	cred, err := PeerCred(uc)
	if err != nil {
		uc.Close()
		return nil, fmt.Errorf("dial %s: %w", path, err)
	}
	ok := UIDAllowed(opts.AllowUIDs, cred.Uid) || (len(opts.AllowUIDs) == 0 && cred.Uid == 0)
	if !ok {
		uc.Close()
		return nil, fmt.Errorf("dial %s: the server (pid %d) runs as uid %d, which this client (uid %d) does not allow: %w", path, cred.Pid, cred.Uid, os.Getuid(), ErrPermission)
	}
	return &Conn{uc: uc, peer: cred}, nil
}
