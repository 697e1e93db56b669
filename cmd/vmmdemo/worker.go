package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/cuvmm/cuvmm/ipc"
)

// readJSONMessage reads one message of kind want from conn into v (JSON), waiting at most 15
// minutes. Descriptors sent along are closed.
func readJSONMessage(conn *net.UnixConn, want uint16, v any) error {
	if err := conn.SetReadDeadline(time.Now().Add(15 * time.Minute)); err != nil {
		return err
	}
	k, payload, files, err := ipc.ReadMessage(conn)
	for _, f := range files {
		f.Close()
	}
	if err != nil {
		return err
	}
	if k != want {
		return fmt.Errorf("message kind %#x, want %#x: %w", k, want, ipc.ErrProtocol)
	}
	return json.Unmarshal(payload, v)
}

// readWorkerReport is readJSONMessage for a worker's report, turning the error the worker reported,
// errText(), into an error.
func readWorkerReport(conn *net.UnixConn, want uint16, v any, errText func() string) error {
	if err := readJSONMessage(conn, want, v); err != nil {
		return err
	}
	if msg := errText(); msg != "" {
		return errors.New(msg)
	}
	return nil
}

// parentConn turns the inherited descriptor fd of a worker process into its Unix socket to the
// parent (the parent passes one end of a socket pair in cmd.ExtraFiles).
func parentConn(fd int) (*net.UnixConn, error) {
	f := os.NewFile(uintptr(fd), "parent")
	fc, err := net.FileConn(f)
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("the socket to the parent (fd %d): %w", fd, err)
	}
	conn, ok := fc.(*net.UnixConn)
	if !ok {
		fc.Close()
		return nil, fmt.Errorf("the socket to the parent (fd %d) is not a Unix socket: %w", fd, ipc.ErrProtocol)
	}
	return conn, nil
}
