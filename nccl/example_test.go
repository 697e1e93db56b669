package nccl_test

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/nccl"
	"github.com/cuvmm/cuvmm/nccl/ncclsim"
	"github.com/cuvmm/cuvmm/vmm"
)

// Two ranks, one per device, move a growable buffer from rank 0 to rank 1. On GPUs, lib is
// nccl.Open() and each rank usually runs in its own process, receiving the unique ID with
// nccl.DialID or nccl.ReceiveID; here the simulated driver and the simulated NCCL stand in.
func Example() {
	drv := sim.New(sim.Devices(2))
	defer drv.Close()
	sys, _ := vmm.Open(drv)
	defer sys.Close()
	lib := ncclsim.New(drv)

	id, _ := lib.GetUniqueID() // made on one rank, handed to the others
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const size = 8 << 20

	rank := func(r int) error {
		dev, err := sys.Device(r)
		if err != nil {
			return err
		}
		comm, err := nccl.NewComm(ctx, lib, id, r, 2, dev)
		if err != nil {
			return err
		}
		defer comm.Close()
		buf, err := growbuf.New(dev, growbuf.Options{MaxSize: 1 << 30})
		if err != nil {
			return err
		}
		defer buf.Close()
		if err := buf.Grow(size); err != nil {
			return err
		}
		g := comm.Group()
		if r == 0 {
			if err := dev.Fill(buf.Ptr(), size, 0, 1); err != nil {
				return err
			}
			g.SendBuffer(buf, 1, nil)
		} else {
			g.RecvBuffer(buf, 0, nil)
		}
		if err := g.Run(ctx); err != nil {
			return err
		}
		if err := comm.Wait(ctx, nil); err != nil {
			return err
		}
		if r == 1 {
			bad, err := dev.Verify(buf.Ptr(), size, 0, 1)
			if err != nil {
				return err
			}
			fmt.Printf("rank 1 received %d MiB in %d chunks, %d words differ\n", buf.Len()>>20, len(buf.Chunks()), bad)
		}
		return nil
	}

	var wg sync.WaitGroup
	for r := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := rank(r); err != nil {
				fmt.Println("rank", r, "failed:", err)
			}
		}()
	}
	wg.Wait()
	// Output:
	// rank 1 received 8 MiB in 3 chunks, 0 words differ
}
