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
	peer := fs.String("peer", "", "torch: also run PyTorch's torch.distributed send/recv in the same run, timed the same way")
	script := fs.String("peer-script", "", "the PyTorch script (default scripts/peers/torch_sendrecv.py)")
	python := fs.String("python", "python3", "the Python that runs the PyTorch script")
	var devs deviceList
	devs.ordinals = []int{0, 1}
	fs.Var(&devs, "devices", "sender and receiver device ordinals")
	warmup := fs.Int("warmup", 3, "untimed transfers before the timed ones")
	iters := fs.Int("iters", 10, "timed transfers")
	orSkip := fs.Bool("or-skip", false, "on a backend with fewer devices than --devices needs, print a notice and succeed (the tour's way)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if len(devs.ordinals) != 2 {
		return fmt.Errorf("--devices %s: want two ordinals, the sender's and the receiver's: %w", devs.String(), errUsage)
	}
	return measureAndShow(e, &c, func(me measure.Env) (*measure.XferResult, error) {
		if n := me.Backend.Sys.DeviceCount(); *orSkip && max(devs.ordinals[0], devs.ordinals[1]) >= n {
			fmt.Fprintf(e.stdout, "xfer skipped: it needs two devices (%s), the %s backend has %d\n", devs.String(), me.Backend.Name, n)
			return nil, nil
		}
		return measure.Xfer(measure.XferOptions{Env: me, Devices: [2]int{devs.ordinals[0], devs.ordinals[1]}, Size: size.v,
			Block: block.v, Transport: *transport, Register: *registerBufs, Warmup: *warmup, Iters: *iters,
			Peer: *peer, PeerScript: *script, Python: *python})
	})
}
