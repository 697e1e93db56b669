package vmm

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/lifetime"
)

// An object's method may hold the object's lock while it hands the System something (keepOrphan
// does), so the System asks an adopted object whether it is closed only without its list's lock:
// Orphans or a retry, waiting for an adoptee's lock, never keeps another hand-over from returning.
func TestHandOverWhileTheSystemWaitsOnAnAdoptee(t *testing.T) {
	still := errors.New("still failing")
	for name, wait := range map[string]func(s *System){
		"Orphans": func(s *System) { s.Orphans() },
		"retryIn": func(s *System) { _ = s.retryIn(0, 1<<40) },
	} {
		t.Run(name, func(t *testing.T) {
			s := &System{}
			var own lifetime.Owner
			_ = s.keepAdoptee(adoptee{what: "first", own: &own, close: func() error { return still },
				lo: 1 << 20, hi: 2 << 20})
			own.Lock()
			waited := make(chan struct{})
			go func() { defer close(waited); wait(s) }()
			time.Sleep(50 * time.Millisecond) // it reaches own's lock
			kept := make(chan error, 1)
			go func() { kept <- s.Keep("second", func() error { return still }) }()
			select {
			case err := <-kept:
				require.ErrorContains(t, err, "second")
			case <-time.After(5 * time.Second):
				t.Error("a hand-over waited for an adoptee's lock")
			}
			own.Unlock()
			<-waited
			require.Equal(t, []string{"first", "second"}, s.Orphans())
		})
	}
}
