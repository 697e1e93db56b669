//go:build cgo && linux

package nccl

/*
#cgo LDFLAGS: -ldl
#include "nccl_calls.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/cuvmm/cuvmm/driver"
)

// symbol is one entry point and the first NCCL version that has it.
type symbol struct {
	name  string
	since int
}

const (
	symGetVersion = iota
	symGetErrorString
	symGetLastError
	symGetUniqueID
	symCommInitRankConfig
	symCommGetAsyncError
	symCommFinalize
	symCommDestroy
	symCommAbort
	symCommCount
	symCommCuDevice
	symCommUserRank
	symCommRegister
	symCommDeregister
	symCommWindowRegister
	symCommWindowDeregister
	symGroupStart
	symGroupEnd
	symSend
	symRecv
	symAllReduce
	symAllGather
	symReduceScatter
	symBroadcast
	numSymbols
)

var symbols = [numSymbols]symbol{
	symGetVersion:           {"ncclGetVersion", 0},
	symGetErrorString:       {"ncclGetErrorString", 0},
	symGetLastError:         {"ncclGetLastError", 21300},
	symGetUniqueID:          {"ncclGetUniqueId", 0},
	symCommInitRankConfig:   {"ncclCommInitRankConfig", 21400},
	symCommGetAsyncError:    {"ncclCommGetAsyncError", 20400},
	symCommFinalize:         {"ncclCommFinalize", 21400},
	symCommDestroy:          {"ncclCommDestroy", 0},
	symCommAbort:            {"ncclCommAbort", 20400},
	symCommCount:            {"ncclCommCount", 0},
	symCommCuDevice:         {"ncclCommCuDevice", 0},
	symCommUserRank:         {"ncclCommUserRank", 0},
	symCommRegister:         {"ncclCommRegister", VersionRegister},
	symCommDeregister:       {"ncclCommDeregister", VersionRegister},
	symCommWindowRegister:   {"ncclCommWindowRegister", VersionWindow},
	symCommWindowDeregister: {"ncclCommWindowDeregister", VersionWindow},
	symGroupStart:           {"ncclGroupStart", 0},
	symGroupEnd:             {"ncclGroupEnd", 0},
	symSend:                 {"ncclSend", 20700},
	symRecv:                 {"ncclRecv", 20700},
	symAllReduce:            {"ncclAllReduce", 0},
	symAllGather:            {"ncclAllGather", 0},
	symReduceScatter:        {"ncclReduceScatter", 0},
	symBroadcast:            {"ncclBroadcast", 0},
}

// EnvLibrary names the environment variable with a path to libnccl.so.2, tried after the loader's
// own search (for example the copy inside a Python environment, which is not on the loader's path).
const EnvLibrary = "CUVMM_NCCL_LIBRARY"

var (
	openOnce sync.Once
	openLib  *ncclLib
	openErr  error
)

// Open loads NCCL the first time it is called and returns it; later calls return the same value. It
// tries libnccl.so.2 through the loader's search (LD_LIBRARY_PATH, the cache, the system
// directories), then the file $CUVMM_NCCL_LIBRARY names, and takes the first that loads and whose
// ncclGetVersion is at least MinVersion. Nothing loadable gives an error wrapping ErrNoNCCL that
// names every place tried and why it failed; only libraries too old give a *VersionError (wrapping
// ErrNotSupported). An entry point missing from the library fails only the calls that need it.
func Open() (API, error) {
	openOnce.Do(func() {
		names := []string{"libnccl.so.2"}
		if p := os.Getenv(EnvLibrary); p != "" {
			names = append(names, p)
		} else {
			names = append(names, "$"+EnvLibrary+" (not set)")
		}
		openLib, openErr = openFirst(names)
		if openLib != nil {
			errorStringLib.Store(openLib)
		}
	})
	if openErr != nil {
		return nil, openErr
	}
	return openLib, nil
}

// OpenLibrary loads the library at path (a file name for the loader's search, or a path) and checks
// its version like Open. It is meant for tests and tools; libraries are never unloaded.
func OpenLibrary(path string) (API, error) {
	l, err := openFirst([]string{path})
	if err != nil {
		return nil, err
	}
	return l, nil
}

func openFirst(names []string) (*ncclLib, error) {
	var tried []string
	var tooOld error
	for _, name := range names {
		if strings.HasPrefix(name, "$") {
			tried = append(tried, name)
			continue
		}
		l, msg := load(name)
		if l == nil {
			tried = append(tried, msg)
			continue
		}
		if l.version < MinVersion {
			tooOld = &VersionError{Feature: "cuvmm's nccl package (non-blocking communicators) at " + l.path, Need: MinVersion, Have: l.version}
			tried = append(tried, fmt.Sprintf("%s: NCCL %s is too old", l.path, FormatVersion(l.version)))
			continue
		}
		return l, nil
	}
	if tooOld != nil {
		return nil, tooOld
	}
	return nil, fmt.Errorf("nccl: cannot load NCCL (tried %s): %w", strings.Join(tried, "; "), ErrNoNCCL)
}

// ncclLib is a loaded NCCL: its entry points (nil where missing) and version. Immutable after load.
type ncclLib struct {
	path    string
	version int
	fn      [numSymbols]unsafe.Pointer
}

// load dlopens name, resolves every symbol and reads the version; on failure nil and a message.
func load(name string) (*ncclLib, string) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var errbuf [512]C.char
	h := C.cuvmm_nccl_dlopen(cname, &errbuf[0], C.size_t(len(errbuf)))
	if h == nil {
		return nil, C.GoString(&errbuf[0])
	}
	l := &ncclLib{path: name}
	for i, s := range symbols {
		cs := C.CString(s.name)
		l.fn[i] = C.cuvmm_nccl_dlsym(h, cs)
		C.free(unsafe.Pointer(cs))
	}
	if l.fn[symGetVersion] == nil {
		return nil, name + ": no ncclGetVersion: not an NCCL library"
	}
	var where [4096]C.char
	C.cuvmm_nccl_dlpath(l.fn[symGetVersion], &where[0], C.size_t(len(where)))
	if p := C.GoString(&where[0]); p != "" {
		l.path = p
	}
	var v C.int
	if rc := C.cuvmm_ncclGetVersion(l.fn[symGetVersion], &v); rc != 0 {
		return nil, fmt.Sprintf("%s: ncclGetVersion: %v", l.path, Result(rc))
	}
	l.version = int(v)
	return l, ""
}

// Path is the file the library was loaded from.
func (l *ncclLib) Path() string { return l.path }

func (l *ncclLib) Version() int { return l.version }

// sym returns the entry point i, or the error its absence means.
func (l *ncclLib) sym(i int) (unsafe.Pointer, error) {
	if p := l.fn[i]; p != nil {
		return p, nil
	}
	s := symbols[i]
	need := s.since
	if need == 0 {
		need = MinVersion
	}
	have := l.version
	if have >= need {
		have = 0 // new enough, yet the symbol is missing: say so rather than blame the version
	}
	return nil, &VersionError{Feature: s.name, Need: need, Have: have}
}

// call converts a return code into an error naming the call, with ncclGetLastError's text.
func (l *ncclLib) call(i int, c CommHandle, rc C.int) error {
	if rc == 0 {
		return nil
	}
	r := Result(rc)
	if r == InProgress {
		return r
	}
	return &CallError{Call: symbols[i].name, Result: r, Last: l.GetLastError(c)}
}

var errorStringLib atomic.Pointer[ncclLib]

func init() {
	loadedErrorString = func(r Result) string {
		if l := errorStringLib.Load(); l != nil {
			return l.GetErrorString(r)
		}
		return ""
	}
}

func (l *ncclLib) GetErrorString(r Result) string {
	fn := l.fn[symGetErrorString]
	if fn == nil {
		return ""
	}
	return C.GoString(C.cuvmm_ncclGetErrorString(fn, C.int(r)))
}

func (l *ncclLib) GetLastError(c CommHandle) string {
	fn := l.fn[symGetLastError]
	if fn == nil {
		return ""
	}
	return C.GoString(C.cuvmm_ncclGetLastError(fn, C.uintptr_t(c)))
}

func (l *ncclLib) GetUniqueID() (UniqueID, error) {
	var id UniqueID
	fn, err := l.sym(symGetUniqueID)
	if err != nil {
		return id, err
	}
	var cid C.ncclUniqueId_
	if err := l.call(symGetUniqueID, 0, C.cuvmm_ncclGetUniqueId(fn, &cid)); err != nil {
		return id, err
	}
	copy(id[:], C.GoBytes(unsafe.Pointer(&cid.internal[0]), UniqueIDBytes))
	return id, nil
}

// configToC fills c from cfg. The strings become C memory that is never freed: NCCL keeps the
// pointers (comm->config.commName) and reads netName from its initialization thread.
func configToC(cfg *Config, c *C.ncclConfig_) {
	c.blocking = C.int(cfg.Blocking)
	c.cgaClusterSize = C.int(cfg.CGAClusterSize)
	c.minCTAs = C.int(cfg.MinCTAs)
	c.maxCTAs = C.int(cfg.MaxCTAs)
	if cfg.NetName != "" {
		c.netName = C.CString(cfg.NetName)
	}
	c.splitShare = C.int(cfg.SplitShare)
	c.trafficClass = C.int(cfg.TrafficClass)
	if cfg.CommName != "" {
		c.commName = C.CString(cfg.CommName)
	}
	c.collnetEnable = C.int(cfg.CollnetEnable)
	c.CTAPolicy = C.int(cfg.CTAPolicy)
	c.shrinkShare = C.int(cfg.ShrinkShare)
	c.nvlsCTAs = C.int(cfg.NvlsCTAs)
	c.nChannelsPerNetPeer = C.int(cfg.NChannelsPerNetPeer)
	c.nvlinkCentricSched = C.int(cfg.NvlinkCentricSched)
}

func (l *ncclLib) CommInitRankConfig(nranks int, id UniqueID, rank int, dev driver.Device, cfg *Config) (CommHandle, error) {
	fn, err := l.sym(symCommInitRankConfig)
	if err != nil {
		return 0, err
	}
	c := (*C.ncclConfig_)(C.calloc(1, C.sizeof_ncclConfig_))
	defer C.free(unsafe.Pointer(c))
	configToC(cfg, c)
	cid := (*C.ncclUniqueId_)(C.calloc(1, C.sizeof_ncclUniqueId_))
	defer C.free(unsafe.Pointer(cid))
	C.memcpy(unsafe.Pointer(&cid.internal[0]), unsafe.Pointer(&id[0]), UniqueIDBytes)
	var comm C.uintptr_t
	rc := C.cuvmm_ncclCommInitRankConfig(fn, &comm, C.int(nranks), cid, C.int(rank), c)
	return CommHandle(comm), l.call(symCommInitRankConfig, CommHandle(comm), rc)
}

func (l *ncclLib) CommGetAsyncError(c CommHandle) error {
	fn, err := l.sym(symCommGetAsyncError)
	if err != nil {
		return err
	}
	var state C.int
	if err := l.call(symCommGetAsyncError, c, C.cuvmm_ncclCommGetAsyncError(fn, C.uintptr_t(c), &state)); err != nil {
		return err
	}
	if state == 0 || Result(state) == InProgress {
		return Check(int32(state))
	}
	return &CallError{Call: "ncclCommGetAsyncError", Result: Result(state), Last: l.GetLastError(c)}
}

func (l *ncclLib) commCall(i int, c CommHandle) error {
	fn, err := l.sym(i)
	if err != nil {
		return err
	}
	return l.call(i, c, C.cuvmm_nccl_comm(fn, C.uintptr_t(c)))
}

func (l *ncclLib) CommFinalize(c CommHandle) error { return l.commCall(symCommFinalize, c) }
func (l *ncclLib) CommDestroy(c CommHandle) error  { return l.commCall(symCommDestroy, c) }
func (l *ncclLib) CommAbort(c CommHandle) error    { return l.commCall(symCommAbort, c) }

func (l *ncclLib) commInt(i int, c CommHandle) (int, error) {
	fn, err := l.sym(i)
	if err != nil {
		return 0, err
	}
	var v C.int
	if err := l.call(i, c, C.cuvmm_nccl_comm_int(fn, C.uintptr_t(c), &v)); err != nil {
		return 0, err
	}
	return int(v), nil
}

func (l *ncclLib) CommCount(c CommHandle) (int, error)    { return l.commInt(symCommCount, c) }
func (l *ncclLib) CommCuDevice(c CommHandle) (int, error) { return l.commInt(symCommCuDevice, c) }
func (l *ncclLib) CommUserRank(c CommHandle) (int, error) { return l.commInt(symCommUserRank, c) }

func (l *ncclLib) CommRegister(c CommHandle, ptr driver.DevicePtr, size uint64) (RegHandle, error) {
	fn, err := l.sym(symCommRegister)
	if err != nil {
		return 0, err
	}
	var h C.uintptr_t
	rc := C.cuvmm_ncclCommRegister(fn, C.uintptr_t(c), C.uint64_t(ptr), C.size_t(size), &h)
	return RegHandle(h), l.call(symCommRegister, c, rc)
}

func (l *ncclLib) CommDeregister(c CommHandle, h RegHandle) error {
	fn, err := l.sym(symCommDeregister)
	if err != nil {
		return err
	}
	return l.call(symCommDeregister, c, C.cuvmm_ncclCommDeregister(fn, C.uintptr_t(c), C.uintptr_t(h)))
}

func (l *ncclLib) CommWindowRegister(c CommHandle, ptr driver.DevicePtr, size uint64, flags int) (func() Window, error) {
	fn, err := l.sym(symCommWindowRegister)
	if err != nil {
		return nil, err
	}
	// NCCL writes the window from its own thread when a non-blocking registration completes, so the
	// slot must be C memory that outlives this call. It is freed when the window is read; a
	// registration that never completes (an abort) leaves its 8 bytes behind, since NCCL might
	// still write them.
	slot := (*C.uintptr_t)(C.calloc(1, C.size_t(unsafe.Sizeof(C.uintptr_t(0)))))
	rc := C.cuvmm_ncclCommWindowRegister(fn, C.uintptr_t(c), C.uint64_t(ptr), C.size_t(size), slot, C.int(flags))
	err = l.call(symCommWindowRegister, c, rc)
	if err != nil && !errors.Is(err, ErrInProgress) {
		C.free(unsafe.Pointer(slot))
		return nil, err
	}
	var once sync.Once
	var w Window
	return func() Window {
		once.Do(func() {
			w = Window(*slot)
			C.free(unsafe.Pointer(slot))
		})
		return w
	}, err
}

func (l *ncclLib) CommWindowDeregister(c CommHandle, w Window) error {
	fn, err := l.sym(symCommWindowDeregister)
	if err != nil {
		return err
	}
	return l.call(symCommWindowDeregister, c, C.cuvmm_ncclCommWindowDeregister(fn, C.uintptr_t(c), C.uintptr_t(w)))
}

func (l *ncclLib) voidCall(i int) error {
	fn, err := l.sym(i)
	if err != nil {
		return err
	}
	return l.call(i, 0, C.cuvmm_nccl_void(fn))
}

func (l *ncclLib) GroupStart() error { return l.voidCall(symGroupStart) }
func (l *ncclLib) GroupEnd() error   { return l.voidCall(symGroupEnd) }

func (l *ncclLib) p2p(i int, buf driver.DevicePtr, count uint64, t DataType, peer int, c CommHandle, s driver.Stream) error {
	fn, err := l.sym(i)
	if err != nil {
		return err
	}
	rc := C.cuvmm_nccl_p2p(fn, C.uint64_t(buf), C.size_t(count), C.int(t), C.int(peer), C.uintptr_t(c), C.uintptr_t(s))
	return l.call(i, c, rc)
}

func (l *ncclLib) Send(buf driver.DevicePtr, count uint64, t DataType, peer int, c CommHandle, s driver.Stream) error {
	return l.p2p(symSend, buf, count, t, peer, c, s)
}

func (l *ncclLib) Recv(buf driver.DevicePtr, count uint64, t DataType, peer int, c CommHandle, s driver.Stream) error {
	return l.p2p(symRecv, buf, count, t, peer, c, s)
}

func (l *ncclLib) reduce(i int, send, recv driver.DevicePtr, count uint64, t DataType, op RedOp, c CommHandle, s driver.Stream) error {
	fn, err := l.sym(i)
	if err != nil {
		return err
	}
	rc := C.cuvmm_ncclAllReduce(fn, C.uint64_t(send), C.uint64_t(recv), C.size_t(count), C.int(t), C.int(op), C.uintptr_t(c), C.uintptr_t(s))
	return l.call(i, c, rc)
}

func (l *ncclLib) AllReduce(send, recv driver.DevicePtr, count uint64, t DataType, op RedOp, c CommHandle, s driver.Stream) error {
	return l.reduce(symAllReduce, send, recv, count, t, op, c, s)
}

// ReduceScatter has AllReduce's prototype, with the count per rank.
func (l *ncclLib) ReduceScatter(send, recv driver.DevicePtr, recvCount uint64, t DataType, op RedOp, c CommHandle, s driver.Stream) error {
	return l.reduce(symReduceScatter, send, recv, recvCount, t, op, c, s)
}

func (l *ncclLib) AllGather(send, recv driver.DevicePtr, sendCount uint64, t DataType, c CommHandle, s driver.Stream) error {
	fn, err := l.sym(symAllGather)
	if err != nil {
		return err
	}
	rc := C.cuvmm_ncclAllGather(fn, C.uint64_t(send), C.uint64_t(recv), C.size_t(sendCount), C.int(t), C.uintptr_t(c), C.uintptr_t(s))
	return l.call(symAllGather, c, rc)
}

func (l *ncclLib) Broadcast(send, recv driver.DevicePtr, count uint64, t DataType, root int, c CommHandle, s driver.Stream) error {
	fn, err := l.sym(symBroadcast)
	if err != nil {
		return err
	}
	rc := C.cuvmm_ncclBroadcast(fn, C.uint64_t(send), C.uint64_t(recv), C.size_t(count), C.int(t), C.int(root), C.uintptr_t(c), C.uintptr_t(s))
	return l.call(symBroadcast, c, rc)
}

// configSize is sizeof(ncclConfig_) as cgo compiled it.
func configSize() int64 { return int64(C.sizeof_ncclConfig_) }

// cLayout reports the sizes and offsets of the C declarations, as cgo compiled them, keyed by the
// expression abi_test.go evaluates against <nccl.h>.
func cLayout() map[string]int64 {
	var c C.ncclConfig_
	var id C.ncclUniqueId_
	return map[string]int64{
		"sizeof(ncclUniqueId)":                          int64(unsafe.Sizeof(id)),
		"_Alignof(ncclConfig_t)":                        int64(unsafe.Alignof(c)),
		"offsetof(ncclConfig_t, size)":                  int64(unsafe.Offsetof(c.size)),
		"offsetof(ncclConfig_t, magic)":                 int64(unsafe.Offsetof(c.magic)),
		"offsetof(ncclConfig_t, version)":               int64(unsafe.Offsetof(c.version)),
		"offsetof(ncclConfig_t, blocking)":              int64(unsafe.Offsetof(c.blocking)),
		"offsetof(ncclConfig_t, cgaClusterSize)":        int64(unsafe.Offsetof(c.cgaClusterSize)),
		"offsetof(ncclConfig_t, minCTAs)":               int64(unsafe.Offsetof(c.minCTAs)),
		"offsetof(ncclConfig_t, maxCTAs)":               int64(unsafe.Offsetof(c.maxCTAs)),
		"offsetof(ncclConfig_t, netName)":               int64(unsafe.Offsetof(c.netName)),
		"offsetof(ncclConfig_t, splitShare)":            int64(unsafe.Offsetof(c.splitShare)),
		"offsetof(ncclConfig_t, trafficClass)":          int64(unsafe.Offsetof(c.trafficClass)),
		"offsetof(ncclConfig_t, commName)":              int64(unsafe.Offsetof(c.commName)),
		"offsetof(ncclConfig_t, collnetEnable)":         int64(unsafe.Offsetof(c.collnetEnable)),
		"offsetof(ncclConfig_t, CTAPolicy)":             int64(unsafe.Offsetof(c.CTAPolicy)),
		"offsetof(ncclConfig_t, shrinkShare)":           int64(unsafe.Offsetof(c.shrinkShare)),
		"offsetof(ncclConfig_t, nvlsCTAs)":              int64(unsafe.Offsetof(c.nvlsCTAs)),
		"offsetof(ncclConfig_t, nChannelsPerNetPeer)":   int64(unsafe.Offsetof(c.nChannelsPerNetPeer)),
		"offsetof(ncclConfig_t, nvlinkCentricSched)":    int64(unsafe.Offsetof(c.nvlinkCentricSched)),
		"sizeof(ncclResult_t)":                          int64(unsafe.Sizeof(C.ncclResult_(0))),
		"sizeof(ncclDataType_t)":                        int64(unsafe.Sizeof(C.ncclDataType_(0))),
		"sizeof(ncclRedOp_t)":                           int64(unsafe.Sizeof(C.ncclRedOp_(0))),
		"NCCL_CONFIG_UNDEF_INT":                         int64(C.INT_MIN),
		"((ncclConfig_t)NCCL_CONFIG_INITIALIZER).magic": int64(C.CUVMM_NCCL_MAGIC),
	}
}
