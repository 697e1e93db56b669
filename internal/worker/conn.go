package worker

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/cuvmm/cuvmm/ipc"
)

// The control connection's message kinds, private to this package. They sit at the top of the
// kinds free for other packages, far from those that other packages send over the same connection
// (a pinned region, an ipc buffer).
const (
	kindCall   = ipc.KindUser + 0xef00 // parent → child: a call (JSON)
	kindReport = ipc.KindUser + 0xef01 // child → parent: a report (JSON envelope)
)

// DefaultTimeout is how long Receive and Next wait for a message unless the Conn says otherwise.
const DefaultTimeout = 15 * time.Minute

// ErrRemote wraps an error that the other side reported.
var ErrRemote = errors.New("worker reported")

// envelope is a report: the body, or the error the child met.
type envelope struct {
	Error string          `json:"error,omitempty"`
	Body  json.RawMessage `json:"body,omitempty"`
}

// Conn is one end of a control connection. Calls and reports travel as JSON; the underlying
// socket (Unix) may carry other packages' messages and descriptors between them.
type Conn struct {
	c *net.UnixConn
	// Timeout bounds each Receive and Next, and each write of Send and Report (DefaultTimeout
	// when 0).
	Timeout time.Duration
}

func newConn(c *net.UnixConn) *Conn { return &Conn{c: c} }

// Unix is the socket itself, for messages of other packages (ipc.Send, pinned.Region.Share).
func (c *Conn) Unix() *net.UnixConn { return c.c }

// Close closes the connection.
func (c *Conn) Close() error {
	if c == nil {
		return nil
	}
	return c.c.Close()
}

// Send sends a call: v as JSON.
func (c *Conn) Send(v any) error {
	payload, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("worker: encoding a call: %w", err)
	}
	return c.write(kindCall, payload)
}

// write sends one message within the Conn's timeout, so that a peer that stops reading (once the
// socket's buffer is full) cannot block this side for ever.
func (c *Conn) write(kind uint16, payload []byte) error {
	if err := c.c.SetWriteDeadline(time.Now().Add(c.timeout())); err != nil {
		return err
	}
	defer c.c.SetWriteDeadline(time.Time{})
	return ipc.WriteMessage(c.c, kind, payload, nil)
}

// timeout is Timeout, or DefaultTimeout when it is 0.
func (c *Conn) timeout() time.Duration {
	if c.Timeout == 0 {
		return DefaultTimeout
	}
	return c.Timeout
}

// Receive reads the child's next report into v (which may be nil). A report of an error comes back
// as an error wrapping ErrRemote with the child's text.
func (c *Conn) Receive(v any) error {
	var env envelope
	if err := c.read(kindReport, &env); err != nil {
		return err
	}
	if env.Error != "" {
		return fmt.Errorf("%w: %s", ErrRemote, env.Error)
	}
	if v == nil || len(env.Body) == 0 {
		return nil
	}
	return json.Unmarshal(env.Body, v)
}

// Call sends a call and reads its report.
func (c *Conn) Call(call, report any) error {
	if err := c.Send(call); err != nil {
		return err
	}
	return c.Receive(report)
}

// Next reads the parent's next call into v (in the child).
func (c *Conn) Next(v any) error {
	var raw json.RawMessage
	if err := c.read(kindCall, &raw); err != nil {
		return err
	}
	return json.Unmarshal(raw, v)
}

// Report sends a report (in the child): v, or err's text when err is not nil. It returns err (or
// the error of encoding v, which the parent gets as the report's error), else the error of sending.
func (c *Conn) Report(v any, err error) error {
	var env envelope
	if err != nil {
		env.Error = err.Error()
	} else if v != nil {
		body, merr := json.Marshal(v)
		if merr != nil {
			err = fmt.Errorf("worker: report: %w", merr) // the parent gets it, and so does the caller
			env.Error = err.Error()
		}
		env.Body = body
	}
	payload, _ := json.Marshal(env)
	if werr := c.write(kindReport, payload); err == nil {
		return werr
	}
	return err
}

// read reads one message of kind want (descriptors sent along are closed) into v.
func (c *Conn) read(want uint16, v any) error {
	if err := c.c.SetReadDeadline(time.Now().Add(c.timeout())); err != nil {
		return err
	}
	defer c.c.SetReadDeadline(time.Time{})
	k, payload, files, err := ipc.ReadMessage(c.c)
	for _, f := range files {
		f.Close()
	}
	if err != nil {
		return fmt.Errorf("worker: waiting for a message: %w", err)
	}
	if k != want {
		return fmt.Errorf("worker: message kind %#x, want %#x: %w", k, want, ipc.ErrProtocol)
	}
	if err := json.Unmarshal(payload, v); err != nil {
		return fmt.Errorf("worker: message kind %#x: %w", k, err)
	}
	return nil
}
