package main

import (
	"fmt"

	"github.com/cuvmm/cuvmm/measure"
)

func init() {
	register(&command{name: "xfer", summary: "move a growable buffer of KV blocks to a second process and GPU through NCCL, beside cuvmm's ipc + peer copies (and PyTorch with --peer torch)",
		run: runXfer, tour: []string{"--size", "16MiB", "--or-skip"}})
}

func runXfer(e *env, args []string) error {
	var c common
	size := sizeFlag{1 << 30}
	block := sizeFlag{2 << 20}
	fs := newFlags(e, "xfer")
	c.register(fs, 2)
	fs.Var(&size, "size", "bytes to move: a whole number of blocks")
	fs.Var(&block, "block", "size of one KV block (the sender grows its buffer block by block)")
	transport := fs.String("transport", "auto", "auto (NCCL picks: NVLink between GPUs of a host) or socket (NCCL's network path over loopback TCP: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)")
	registerBufs := fs.Bool("register", false, "register both buffers with NCCL, every chunk, and move them chunk by chunk")
	byChunks := fs.Bool("by-chunks", false, "move both buffers chunk by chunk without registering them (what --register's chunking costs alone)")
	peer := fs.String("peer", "", "torch: also run PyTorch's torch.distributed send/recv in the same run, timed the same way")
	script := fs.String("peer-script", "", "the PyTorch script (default scripts/peers/torch_sendrecv.py)")
	python := fs.String("python", "python3", "the Python that runs the PyTorch script")
	var devs deviceList
	devs.ordinals = []int{0, 1}
	fs.Var(&devs, "devices", "sender and receiver device ordinals")
	warmup := fs.Int("warmup", 3, "untimed transfers before the timed ones (0: none)")
	iters := fs.Int("iters", 10, "timed transfers (at least 1)")
	orSkip := fs.Bool("or-skip", false, "on a backend with fewer devices than --devices needs, print a notice and succeed (the tour's way)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := checkXferFlags(devs, *warmup); err != nil {
		return err
	}
	if err := zeroFlags(fs, "block", "iters"); err != nil {
		return err
	}
	if *warmup == 0 {
		*warmup = -1 // measure's none (its 0 is the default)
	}
	return measureAndShow(e, &c, func(me measure.Env) (*measure.XferResult, error) {
		if n := me.Backend.Sys.DeviceCount(); *orSkip && max(devs.ordinals[0], devs.ordinals[1]) >= n {
			return nil, xferSkipped(e, &c, fmt.Sprintf("it needs two devices (%s), the %s backend has %d", devs.String(), me.Backend.Name, n))
		}
		return measure.Xfer(measure.XferOptions{Env: me, Devices: [2]int{devs.ordinals[0], devs.ordinals[1]}, Size: size.v,
			Block: block.v, Transport: *transport, Register: *registerBufs, ByChunks: *byChunks, Warmup: *warmup, Iters: *iters,
			Peer: *peer, PeerScript: *script, Python: *python})
	})
}

// checkXferFlags refuses a --devices that is not two ordinals and a negative --warmup (measure's
// negative Warmup means none).
func checkXferFlags(devs deviceList, warmup int) error {
	switch {
	case len(devs.ordinals) != 2:
		return fmt.Errorf("--devices %s: want two ordinals, the sender's and the receiver's: %w", devs.String(), errUsage)
	case warmup < 0:
		return fmt.Errorf("--warmup %d: want 0 or more: %w", warmup, errUsage)
	}
	return nil
}

// xferSkipped tells that xfer was skipped (--or-skip): a line of text, or with --json a JSON object
// {"skipped": true, "reason": ...}, so that stdout holds only JSON.
func xferSkipped(e *env, c *common, reason string) error {
	if c.json {
		return writeJSON(e.stdout, map[string]any{"skipped": true, "reason": reason})
	}
	fmt.Fprintf(e.stdout, "xfer skipped: %s\n", reason)
	return nil
}
