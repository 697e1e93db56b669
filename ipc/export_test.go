package ipc

import (
	"net"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/unixsock"
)

// Test hooks, visible to package ipc_test in the test binary only.

// SetPeerCredentials replaces how s reads a connection's peer credentials (SO_PEERCRED), so tests
// can play a peer of another uid. Call it before Serve.
func SetPeerCredentials(s *Server, f func(*net.UnixConn) (unix.Ucred, error)) { s.ln.SetPeerCred(f) }

// PidfdError is pidfdError.
var PidfdError = pidfdError

// EncodeHeader builds a raw message header, valid or not, for tests.
func EncodeHeader(kind uint16, length uint32, nfds uint16) []byte {
	b := make([]byte, HeaderSize)
	unixsock.Header{Kind: kind, Length: length, NFDs: nfds}.Put(b)
	return b
}
