package measure

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

// The peers' scripts, relative to the module's root.
const (
	PoolPeerScript = "scripts/peers/torch_pool.py"
	XferPeerScript = "scripts/peers/torch_sendrecv.py"
)

// PeerCommand is the command line of a peer, python and its script, checked before anything is
// measured: an interpreter that cannot be found is refused, naming --python. The script is the one
// given (script, which must exist), else rel under the working directory or under a directory above
// the executable; one that cannot be found is refused, naming --peer-script or the places tried.
// Errors wrap ErrInvalidOption.
func PeerCommand(python, script, rel string) ([]string, error) {
	if _, err := exec.LookPath(python); err != nil {
		return nil, fmt.Errorf("--python %s: %w: %w", python, err, ErrInvalidOption)
	}
	script, err := locatePeerScript(script, rel)
	if err != nil {
		return nil, err
	}
	return []string{python, script}, nil
}

// locatePeerScript finds a peer's script for PeerCommand: the path given, which must exist, else
// rel under the working directory or under a directory above the executable. Its error names
// --peer-script or the places tried, and wraps ErrInvalidOption.
func locatePeerScript(given, rel string) (string, error) {
	if given != "" {
		if _, err := os.Stat(given); err != nil {
			return "", fmt.Errorf("--peer-script %s: %w: %w", given, err, ErrInvalidOption)
		}
		return given, nil
	}
	cands := []string{rel}
	if exe, err := os.Executable(); err == nil {
		for d := filepath.Dir(exe); d != filepath.Dir(d); d = filepath.Dir(d) {
			cands = append(cands, filepath.Join(d, rel))
		}
	}
	for _, c := range cands {
		if _, err := os.Stat(c); err == nil {
			return c, nil
		}
	}
	return "", fmt.Errorf("the PyTorch peer script %s was not found (tried %v): %w", rel, cands, ErrInvalidOption)
}
