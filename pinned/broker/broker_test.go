package broker

import (
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// Copies both ways, synchronous and pipelined, and a worker's CPU-only view of the region.
func TestCopyBothWays(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 16*mib, pinned.Options{})
		srv, path := startServer(t, region, Options{})
		c := dial(t, path)

		info := c.Info()
		require.Equal(t, region.Len(), info.RegionLen)
		require.Equal(t, region.Kind(), info.RegionKind)
		require.Equal(t, Grant{Offset: 0, Length: region.Len(), ShareRegion: true}, info.Grant)
		require.Equal(t, []int{0}, info.Devices)
		require.Equal(t, int32(os.Getpid()), info.Server.Pid)

		buf := newDevBuffer(t, dev, 3, 2*mib)
		rb, err := c.Register(ctx, buf)
		require.NoError(t, err)
		require.Equal(t, uint64(6*mib), rb.Len())
		require.Equal(t, 0, rb.Device())
		require.Equal(t, 1, srv.Stats().Buffers)

		// Host → device, one request.
		fillHost(region.Bytes()[mib:7*mib], 0, 11)
		require.NoError(t, c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToDevice, HostOffset: mib, Length: 6 * mib}))
		requireDevicePattern(t, dev, buf.Ptr(), 6*mib, 0, 11)

		// Device → host, pipelined in pieces.
		require.NoError(t, dev.Fill(buf.Ptr(), 6*mib, 0, 12))
		var comps []*Completion
		for i := uint64(0); i < 6; i++ {
			cp, err := c.CopyAsync(Request{Buffer: rb.ID(), Dir: ToHost, HostOffset: 8*mib + i*mib, BufferOffset: i * mib, Length: mib})
			require.NoError(t, err)
			comps = append(comps, cp)
		}
		for _, cp := range comps {
			require.NoError(t, cp.Wait(ctx))
			<-cp.Done()
			require.GreaterOrEqual(t, cp.BrokerTime(), 0*cp.BrokerTime())
		}
		require.Zero(t, badHost(region.Bytes()[8*mib:14*mib], 0, 12))

		// The worker's own view of the region: CPU only, no GPU cost.
		view, err := c.Region(ctx, dev, pinned.OpenOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, view.Close()) }()
		require.Equal(t, region.Len(), view.Len())
		require.Zero(t, view.TotalPageTableCost())
		require.Zero(t, badHost(view.Bytes()[8*mib:14*mib], 0, 12), "the worker sees the broker's copies")
		fillHost(view.Bytes()[:2*mib], 2*mib, 13)
		require.NoError(t, c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToDevice, HostOffset: 0, BufferOffset: 2 * mib, Length: 2 * mib}))
		requireDevicePattern(t, dev, buf.Ptr()+2*mib, 2*mib, 2*mib, 13)

		// Small, unaligned copies run inline.
		require.NoError(t, c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToHost, HostOffset: 15*mib + 3, BufferOffset: 2*mib + 5, Length: 100}))
		require.Equal(t, view.Bytes()[5:105], region.Bytes()[15*mib+3:15*mib+103])

		require.NoError(t, c.Ping(ctx))
		st := srv.Stats()
		require.Equal(t, 1, st.Workers)
		require.Equal(t, uint64(9), st.Copies)
		require.Equal(t, uint64(6*mib+6*mib+2*mib+100), st.Bytes)
		require.Zero(t, st.InFlight)

		require.NoError(t, rb.Close())
		require.NoError(t, rb.Close())
		require.Zero(t, srv.Stats().Buffers)
		err = c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToDevice, Length: 8})
		require.ErrorIs(t, err, ErrUnknownBuffer)
		var re *RemoteError
		require.ErrorAs(t, err, &re)
		require.Equal(t, OpCopy, re.Op)
	})
}

// Several workers copy concurrently, each both ways over its own part of the region.
func TestManyWorkers(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 16*mib, pinned.Options{})
		srv, path := startServer(t, region, Options{StreamsPerDevice: 2, InlineMax: -1})
		const workers = 4
		const part = 4 * mib
		var wg sync.WaitGroup
		errs := make([]error, workers)
		for i := 0; i < workers; i++ {
			c := dial(t, path)
			buf := newDevBuffer(t, dev, 1, 2*mib)
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = func() error {
					rb, err := c.Register(ctx, buf)
					if err != nil {
						return err
					}
					host := uint64(i) * part
					seed := uint64(100 + i)
					fillHost(region.Bytes()[host:host+2*mib], 0, seed)
					var comps []*Completion
					for off := uint64(0); off < 2*mib; off += 256 << 10 {
						cp, err := c.CopyAsync(Request{Buffer: rb.ID(), Dir: ToDevice, HostOffset: host + off, BufferOffset: off, Length: 256 << 10})
						if err != nil {
							return err
						}
						comps = append(comps, cp)
					}
					for _, cp := range comps {
						if err := cp.Wait(ctx); err != nil {
							return err
						}
					}
					if bad, err := dev.Verify(buf.Ptr(), 2*mib, 0, seed); err != nil || bad != 0 {
						return fmt.Errorf("worker %d: %d words wrong on the device (%v)", i, bad, err)
					}
					if err := c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToHost, HostOffset: host + 2*mib, Length: 2 * mib}); err != nil {
						return err
					}
					if bad := badHost(region.Bytes()[host+2*mib:host+4*mib], 0, seed); bad != 0 {
						return fmt.Errorf("worker %d: %d words wrong on the host", i, bad)
					}
					return rb.Close()
				}()
			}()
		}
		wg.Wait()
		for _, err := range errs {
			require.NoError(t, err)
		}
		require.Equal(t, workers, srv.Stats().Workers)
		require.Equal(t, uint64(workers*9), srv.Stats().Copies)
	})
}

// Out-of-range offsets and lengths, unknown buffer ids, and ids of another worker: each is refused
// with its sentinel and the connection stays usable.
func TestBadRequests(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 8*mib, pinned.Options{})
		srv, path := startServer(t, region, Options{})
		c := dial(t, path)
		// Chunks at [0, 2 MiB) and [4, 6 MiB): a hole between them.
		buf := newDevBuffer(t, dev, 2, 2*mib, 0)
		rb, err := c.Register(ctx, buf)
		require.NoError(t, err)
		require.Equal(t, uint64(6*mib), rb.Len())
		id := rb.ID()
		n := region.Len()
		cases := []struct {
			name string
			req  Request
			want error
		}{
			{"host offset at the end", Request{Buffer: id, Dir: ToDevice, HostOffset: n, Length: 1}, ErrOutOfRange},
			{"host range past the end", Request{Buffer: id, Dir: ToHost, HostOffset: n - 4096, Length: 8192}, ErrOutOfRange},
			{"host offset far out", Request{Buffer: id, Dir: ToDevice, HostOffset: 1 << 62, Length: 4096}, ErrOutOfRange},
			{"host offset overflows", Request{Buffer: id, Dir: ToDevice, HostOffset: ^uint64(0) - 10, Length: 100}, ErrOutOfRange},
			{"buffer range past the end", Request{Buffer: id, Dir: ToDevice, BufferOffset: 5 * mib, Length: 2 * mib}, ErrOutOfRange},
			{"buffer offset past the end", Request{Buffer: id, Dir: ToHost, BufferOffset: 6 * mib, Length: 1}, ErrOutOfRange},
			{"buffer range over the hole", Request{Buffer: id, Dir: ToDevice, BufferOffset: mib, Length: 2 * mib}, ErrOutOfRange},
			{"buffer range in the hole", Request{Buffer: id, Dir: ToHost, BufferOffset: 3 * mib, Length: 4096}, ErrOutOfRange},
			{"buffer offset overflows", Request{Buffer: id, Dir: ToHost, BufferOffset: ^uint64(0), Length: 2}, ErrOutOfRange},
			{"larger than everything", Request{Buffer: id, Dir: ToHost, Length: 1 << 40}, ErrOutOfRange},
			{"unknown buffer", Request{Buffer: id + 100, Dir: ToDevice, Length: 8}, ErrUnknownBuffer},
			{"zero length", Request{Buffer: id, Dir: ToDevice}, ErrInvalidValue},
			{"no direction", Request{Buffer: id, Length: 8}, ErrInvalidValue},
			{"no buffer", Request{Dir: ToDevice, Length: 8}, ErrInvalidValue},
		}
		failedBefore := srv.Stats().Failed
		remote := 0
		for _, tc := range cases {
			err := c.Copy(ctx, tc.req)
			require.ErrorIs(t, err, tc.want, tc.name)
			var re *RemoteError
			if errors.As(err, &re) {
				remote++
			}
		}
		require.Equal(t, failedBefore+uint64(remote), srv.Stats().Failed)
		require.GreaterOrEqual(t, remote, 9, "the broker itself checks the ranges")
		err = c.Unregister(ctx, &Buffer{c: c, id: id + 7})
		require.ErrorIs(t, err, ErrUnknownBuffer)

		// Buffer ids are per worker: another worker cannot name this one's buffer.
		other := dial(t, path)
		require.ErrorIs(t, other.Copy(ctx, Request{Buffer: id, Dir: ToHost, Length: 8}), ErrUnknownBuffer)

		// The connection is still good: both edges of both ranges are allowed.
		fillHost(region.Bytes()[n-2*mib:], 4*mib, 21)
		require.NoError(t, c.Copy(ctx, Request{Buffer: id, Dir: ToDevice, HostOffset: n - 2*mib, BufferOffset: 4 * mib, Length: 2 * mib}))
		requireDevicePattern(t, dev, buf.Ptr()+4*mib, 2*mib, 4*mib, 21)
		require.NoError(t, c.Copy(ctx, Request{Buffer: id, Dir: ToHost, HostOffset: 0, BufferOffset: 0, Length: 2 * mib}))
		require.Equal(t, 1, srv.Stats().Buffers)
	})
}

// A per-worker window: copies outside it are refused, and so is mapping the region.
func TestGrantWindow(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 16*mib, pinned.Options{})
		seen := make(chan unix.Ucred, 1)
		_, path := startServer(t, region, Options{Grant: func(peer unix.Ucred) (Grant, error) {
			seen <- peer
			return Grant{Offset: 4 * mib, Length: 4 * mib}, nil
		}})
		c := dial(t, path)
		require.Equal(t, int32(os.Getpid()), (<-seen).Pid)
		require.Equal(t, Grant{Offset: 4 * mib, Length: 4 * mib}, c.Info().Grant)
		buf := newDevBuffer(t, dev, 1, 2*mib)
		rb, err := c.Register(ctx, buf)
		require.NoError(t, err)
		fillHost(region.Bytes()[6*mib:8*mib], 0, 31)
		require.NoError(t, c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToDevice, HostOffset: 6 * mib, Length: 2 * mib}))
		requireDevicePattern(t, dev, buf.Ptr(), 2*mib, 0, 31)
		for _, host := range []uint64{0, 4*mib - 1, 6*mib + 1, 8 * mib, 12 * mib} {
			err := c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToHost, HostOffset: host, Length: 2 * mib})
			require.ErrorIs(t, err, ErrOutOfRange, "host offset %#x", host)
		}
		_, err = c.Region(ctx, dev, pinned.OpenOptions{})
		require.ErrorIs(t, err, ErrPermission)
		// A grant that does not fit the region refuses the worker.
		_, path2 := startServer(t, region, Options{StreamsPerDevice: 1, Grant: func(unix.Ucred) (Grant, error) {
			return Grant{Offset: 12 * mib, Length: 8 * mib}, nil
		}})
		_, err = DialContext(ctx, path2, DialOptions{})
		require.ErrorIs(t, err, ErrPermission)
	})
}

// Peers of another uid (the allow-list excludes ours), the Authorize hook, and the worker's own
// check of the broker's uid.
func TestPeerRefused(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 4*mib, pinned.Options{})
		other := os.Getuid() + 4242
		// The servers that only refuse need one stream each (the driver keeps memory for many
		// streams alive at once past their destruction, which the leak check would count).
		srv, path := startServer(t, region, Options{AllowUIDs: []int{other}, StreamsPerDevice: 1})
		_, err := DialContext(ctx, path, DialOptions{})
		require.ErrorIs(t, err, ErrPermission)
		require.ErrorContains(t, err, fmt.Sprintf("runs as uid %d", os.Getuid()))
		eventually(t, "the refused connection to end", func() bool { return srv.Stats().Refused == 1 })

		srv2, path2 := startServer(t, region, Options{StreamsPerDevice: 1, Authorize: func(peer unix.Ucred) error {
			return fmt.Errorf("pid %d is not on the list", peer.Pid)
		}})
		_, err = DialContext(ctx, path2, DialOptions{})
		require.ErrorIs(t, err, ErrPermission)
		require.ErrorContains(t, err, "is not on the list")
		eventually(t, "the refused connection to end", func() bool { return srv2.Stats().Refused == 1 })
		require.Zero(t, srv2.Stats().Workers)

		// A peer whose credentials say another uid.
		srv4, path4 := startServerWith(t, region, Options{StreamsPerDevice: 1}, func(s *Server) {
			s.ln.SetPeerCred(func(c *net.UnixConn) (unix.Ucred, error) {
				cred, err := ipc.PeerCredentials(c)
				cred.Uid = uint32(other)
				return cred, err
			})
		})
		_, err = DialContext(ctx, path4, DialOptions{})
		require.ErrorIs(t, err, ErrPermission)
		require.ErrorContains(t, err, fmt.Sprintf("runs as uid %d", other))
		eventually(t, "the refused connection to end", func() bool { return srv4.Stats().Refused == 1 })

		// The worker refuses a broker of another uid.
		_, path3 := startServer(t, region, Options{StreamsPerDevice: 1})
		_, err = DialContext(ctx, path3, DialOptions{AllowUIDs: []int{other}})
		require.ErrorIs(t, err, ErrPermission)

		// The socket is 0600.
		st, err := os.Stat(path3)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	})
}

// A worker that hangs up with buffers registered and copies in flight: the broker drains them and
// releases the buffers (the leak check at the end sees no import left), and serves the others.
func TestDisconnectCleanup(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 8*mib, pinned.Options{})
		srv, path := startServer(t, region, Options{InlineMax: -1})
		stay := dial(t, path)
		stayBuf := newDevBuffer(t, dev, 1, 2*mib)
		srb, err := stay.Register(ctx, stayBuf)
		require.NoError(t, err)

		c, err := DialContext(ctx, path, DialOptions{})
		require.NoError(t, err)
		buf1, buf2 := newDevBuffer(t, dev, 1, 2*mib), newDevBuffer(t, dev, 2, 2*mib)
		rb1, err := c.Register(ctx, buf1)
		require.NoError(t, err)
		rb2, err := c.Register(ctx, buf2)
		require.NoError(t, err)
		require.Equal(t, 3, srv.Stats().Buffers)
		var comps []*Completion
		for i := 0; i < 16; i++ {
			rb := []*Buffer{rb1, rb2}[i%2]
			cp, err := c.CopyAsync(Request{Buffer: rb.ID(), Dir: Direction(1 + i%2), HostOffset: uint64(i%4) * mib, Length: mib})
			require.NoError(t, err)
			comps = append(comps, cp)
		}
		require.NoError(t, c.Close())
		for _, cp := range comps {
			if err := cp.Wait(ctx); err != nil {
				require.ErrorIs(t, err, ErrClosed)
			}
		}
		require.ErrorIs(t, c.Copy(ctx, Request{Buffer: rb1.ID(), Dir: ToDevice, Length: 8}), ErrClosed)
		eventually(t, "the broker to release the closed worker's buffers", func() bool {
			st := srv.Stats()
			return st.Buffers == 1 && st.Workers == 1 && st.InFlight == 0 && st.Drained == 1
		})
		fillHost(region.Bytes()[:2*mib], 0, 41)
		require.NoError(t, stay.Copy(ctx, Request{Buffer: srb.ID(), Dir: ToDevice, Length: 2 * mib}))
		requireDevicePattern(t, dev, stayBuf.Ptr(), 2*mib, 0, 41)
	})
}

// Closing the server under connected workers: their requests fail with ErrBrokerGone.
func TestServerClose(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, dev, srv, path := serveDevice0(t, b, Options{})
		c := dial(t, path)
		rb, err := c.Register(ctx, newDevBuffer(t, dev, 1, 2*mib))
		require.NoError(t, err)
		require.NoError(t, srv.Close())
		require.Zero(t, srv.Stats().Buffers)
		err = c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToDevice, Length: 8})
		require.ErrorIs(t, err, ErrBrokerGone)
		require.ErrorIs(t, c.Ping(ctx), ErrBrokerGone)
		require.ErrorIs(t, rb.Close(), ErrBrokerGone)
		_, err = os.Stat(path)
		require.ErrorIs(t, err, os.ErrNotExist, "Close removes the socket")
	})
}

// Limits, devices the broker does not serve, read-only regions and regions that cannot be shared.
func TestRefusals(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev0, dev1 := b.Device(t, 0), b.Device(t, 1)
		region := newRegion(t, dev0, 4*mib, pinned.Options{}) // host-NUMA on the simulator: granted to device 0
		if region.Kind() == pinned.HostNUMA {
			_, err := Listen(region, privateDir(t)+"/x.sock", Options{Devices: []*vmm.Device{dev1}})
			require.ErrorIs(t, err, ErrDeviceNotServed)
			_, err = NewServer(nil, privateDir(t)+"/x.sock", Options{})
			require.ErrorIs(t, err, ErrInvalidValue)
		}
		srv, path := startServer(t, region, Options{MaxBuffers: 1, Devices: nil})
		require.Equal(t, []int{0}, srv.Devices())
		c := dial(t, path)
		_, err := c.Register(ctx, newDevBuffer(t, dev1, 1, 2*mib))
		require.ErrorIs(t, err, ErrDeviceNotServed)
		rb, err := c.Register(ctx, newDevBuffer(t, dev0, 1, 2*mib))
		require.NoError(t, err)
		_, err = c.Register(ctx, newDevBuffer(t, dev0, 1, 2*mib))
		require.ErrorIs(t, err, ErrLimit)
		require.NoError(t, rb.Close())

		// Devices may only read a read-only region: copies to the host are refused.
		ro := newRegion(t, dev0, 4*mib, pinned.Options{ReadOnly: true})
		_, rpath := startServer(t, ro, Options{StreamsPerDevice: 1})
		rc := dial(t, rpath)
		rrb, err := rc.Register(ctx, newDevBuffer(t, dev0, 1, 2*mib))
		require.NoError(t, err)
		require.ErrorIs(t, rc.Copy(ctx, Request{Buffer: rrb.ID(), Dir: ToHost, Length: 4096}), ErrPermission)
		require.NoError(t, rc.Copy(ctx, Request{Buffer: rrb.ID(), Dir: ToDevice, Length: 4096}))

		// Memory the caller registered has no descriptor to share.
		mem, err := pinned.MapAnonymous(4 * mib)
		require.NoError(t, err)
		defer func() { require.NoError(t, pinned.Unmap(mem)) }()
		reg, err := pinned.Register(dev0, mem, pinned.RegisterOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, reg.Close()) }()
		func() {
			gsrv, gpath := startServer(t, reg, Options{StreamsPerDevice: 1})
			defer gsrv.Close()
			gc, err := DialContext(ctx, gpath, DialOptions{})
			require.NoError(t, err)
			defer gc.Close()
			require.Equal(t, pinned.Registered, gc.Info().RegionKind)
			_, err = gc.Region(ctx, nil, pinned.OpenOptions{})
			require.ErrorIs(t, err, ErrNotSupported)
			require.NoError(t, gc.Ping(ctx))
		}()
	}, testutil.Devices(2))
}

// Driver failures on the broker's side are reported as ErrInternal and leave the connection usable.
func TestDriverFailures(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, dev, _, path := serveDevice0(t, b, Options{SpinMax: mib})
		c := dial(t, path)
		buf := newDevBuffer(t, dev, 1, 2*mib)

		b.Sim.FailNth("cuMemImportFromShareableHandle", 1, driver.ErrorOutOfMemory)
		_, err := c.Register(ctx, buf)
		require.ErrorIs(t, err, ErrInternal)
		require.ErrorContains(t, err, "CUDA_ERROR_OUT_OF_MEMORY")
		rb, err := c.Register(ctx, buf)
		require.NoError(t, err)

		b.Sim.FailNth("cuMemcpyHtoDAsync", 1, driver.ErrorIllegalAddress)
		err = c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToDevice, Length: 4096})
		require.ErrorIs(t, err, ErrInternal)
		b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorIllegalAddress)
		err = c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToHost, Length: mib})
		require.ErrorIs(t, err, ErrInternal)
		require.NoError(t, c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToDevice, Length: 4096}))
		// A copy above SpinMax whose event fails: the error is answered, and the broker waited for
		// the stream instead.
		for _, fn := range []string{"cuEventRecord", "cuEventSynchronize"} {
			syncs := b.Sim.Calls("cuStreamSynchronize")
			b.Sim.FailNth(fn, 1, driver.ErrorIllegalAddress)
			err = c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToHost, Length: 2 * mib})
			require.ErrorIs(t, err, ErrInternal, fn)
			require.ErrorContains(t, err, "CUDA_ERROR_ILLEGAL_ADDRESS", fn)
			require.Equal(t, syncs+1, b.Sim.Calls("cuStreamSynchronize"), fn)
		}
		require.NoError(t, c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToHost, Length: 2 * mib}))
	}, testutil.SimOnly())
}

// Server.SpinMax reports the option with its default filled in, and -1 for any negative one.
func TestServerSpinMax(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		region := newRegion(t, b.Device(t, 0), 2*mib, pinned.Options{})
		for _, c := range []struct{ opt, want int64 }{{0, DefaultSpinMax}, {-5, -1}, {mib, mib}, {math.MaxInt64, math.MaxInt64}} {
			srv, _ := startServer(t, region, Options{SpinMax: c.opt})
			require.Equal(t, c.want, srv.SpinMax(), "Options.SpinMax %d", c.opt)
			require.NoError(t, srv.Close())
		}
	})
}

// A copy of at most SpinMax bytes is waited for by spinning on its stream, a larger one on the
// stream's blocking event; a negative SpinMax makes every copy sleep. The simulator counts the waits.
func TestCopyWaitKinds(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 8*mib, pinned.Options{})
		buf := newDevBuffer(t, dev, 2, 2*mib)
		// waits counts the stream and event synchronizations so far (the simulator only).
		waits := func() [2]int {
			if b.Sim == nil {
				return [2]int{}
			}
			return [2]int{b.Sim.Calls("cuStreamSynchronize"), b.Sim.Calls("cuEventSynchronize")}
		}
		for _, spinMax := range []int64{mib, -1} {
			blocking := 0
			if b.Sim != nil {
				blocking = b.Sim.EventsCreated(driver.EventBlockingSync | driver.EventDisableTiming)
			}
			srv, path := startServer(t, region, Options{SpinMax: spinMax, StreamsPerDevice: 2})
			if b.Sim != nil {
				require.Equal(t, blocking+2, b.Sim.EventsCreated(driver.EventBlockingSync|driver.EventDisableTiming),
					"a blocking event per copy stream")
			}
			c := dial(t, path)
			rb, err := c.Register(ctx, buf)
			require.NoError(t, err)
			for _, n := range []uint64{mib / 2, 3 * mib} {
				fillHost(region.Bytes()[:n], 0, 21)
				before := waits()
				require.NoError(t, c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToDevice, Length: n}))
				after := waits()
				requireDevicePattern(t, dev, buf.Ptr(), n, 0, 21)
				want := before
				if spinMax >= 0 && int64(n) <= spinMax {
					want[0]++
				} else {
					want[1]++
				}
				if b.Sim != nil {
					require.Equal(t, want, after, "SpinMax %d, %d bytes: (stream, event) waits", spinMax, n)
				}
			}
			require.NoError(t, rb.Close())
			require.NoError(t, c.Close())
			require.NoError(t, srv.Close())
		}
	})
}
