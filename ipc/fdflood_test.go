package ipc_test

import (
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/unixsock"
	"github.com/cuvmm/cuvmm/ipc"
)

// A peer that sends a fetch one byte per sendmsg, each byte carrying MaxFDsPerMessage descriptors,
// and then stalls, must not make the server hold more than one message's descriptors: the server
// refuses the frame at its second piece and closes what came.
func TestServerRefusesDescriptorsInPieces(t *testing.T) {
	s := serve(t, ipc.ServerOptions{ReadTimeout: 10 * time.Second})
	devnull, err := os.Open(os.DevNull)
	require.NoError(t, err)
	defer devnull.Close()
	fds := make([]int, ipc.MaxFDsPerMessage)
	for i := range fds {
		fds[i] = int(devnull.Fd())
	}
	before := countFDs(t)
	c, err := net.Dial("unix", s.Path())
	require.NoError(t, err)
	defer c.Close()
	frame := make([]byte, ipc.HeaderSize+1)
	unixsock.Header{Kind: ipc.KindFetch, Length: 1}.Put(frame)
	for i := 0; i < ipc.HeaderSize; i++ { // the frame's last byte never comes
		_, _, err := c.(*net.UnixConn).WriteMsgUnix(frame[i:i+1], unix.UnixRights(fds...), nil)
		if err != nil {
			break // the server has dropped the connection
		}
	}
	// The server drops the connection (EOF or a reset here) at once, well before its read timeout.
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err = io.ReadAll(c)
	require.NotErrorIs(t, err, os.ErrDeadlineExceeded, "the server drops the connection at the refused frame")
	require.Eventually(t, func() bool { return countFDs(t)-before == 1 }, 5*time.Second, 10*time.Millisecond,
		"the server holds none of the frame's descriptors, only this test's own connection is open")
}

func countFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}
