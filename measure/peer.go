package measure

import (
	"cmp"
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

// findPeer checks a measurement's PyTorch peer before anything is measured, and returns the Python
// that runs it (default python3) and its script. Peer "" is none; "torch" needs python to be found,
// naming --python if it is not, and its script located by locatePeerScript (script, else rel); any
// other peer is refused. Errors wrap ErrInvalidOption.
func findPeer(peer, python, script, rel string) (string, string, error) {
	python = cmp.Or(python, "python3")
	switch peer {
	case "":
		return python, script, nil
	case "torch":
	default:
		return "", "", fmt.Errorf("--peer %q: want torch or nothing: %w", peer, ErrInvalidOption)
	}
	if _, err := exec.LookPath(python); err != nil {
		return "", "", fmt.Errorf("--python %s: %w: %w", python, err, ErrInvalidOption)
	}
	script, err := locatePeerScript(script, rel)
	if err != nil {
		return "", "", err
	}
	return python, script, nil
}

// locatePeerScript finds a peer's script for findPeer: the path given, which must exist, else rel
// under the working directory or under a directory above the executable. Its error names
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
