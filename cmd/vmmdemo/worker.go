package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/cuvmm/cuvmm/ipc"
)

// readWorkerReport reads one message of kind want from a worker process into v (JSON) and turns the
// error the worker reported, errText(), into an error. Descriptors sent along are closed.
func readWorkerReport(conn *net.UnixConn, want uint16, v any, errText func() string) error {
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
	if err := json.Unmarshal(payload, v); err != nil {
		return err
	}
	if msg := errText(); msg != "" {
		return errors.New(msg)
	}
	return nil
}
