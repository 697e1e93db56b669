package nccl

import (
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
)

// UniqueIDBytes is NCCL_UNIQUE_ID_BYTES.
const UniqueIDBytes = 128

// UniqueID is an ncclUniqueId: made by one rank (API.GetUniqueID), handed to every other rank of the
// communicator (ShareID, ReceiveID), and passed to NewComm by all of them.
type UniqueID [UniqueIDBytes]byte

// CommHandle is an ncclComm_t, an opaque pointer of the library.
type CommHandle uintptr

// RegHandle is the handle ncclCommRegister returns.
type RegHandle uintptr

// Window is an ncclWindow_t (ncclCommWindowRegister, NCCL 2.27+).
type Window uintptr

// DataType is ncclDataType_t.
type DataType int32

// ncclDataType_t values: every type of nccl.h 2.28 (ncclNumTypes is 12).
const (
	Int8     DataType = 0
	Uint8    DataType = 1
	Int32    DataType = 2
	Uint32   DataType = 3
	Int64    DataType = 4
	Uint64   DataType = 5
	Float16  DataType = 6
	Float32  DataType = 7
	Float64  DataType = 8
	Bfloat16 DataType = 9
	// Float8e4m3 is ncclFloat8e4m3 (NCCL 2.24+): 4 exponent bits, 3 mantissa bits, no infinity.
	// NCCL reduces float8 only on devices of compute capability 9.0 and newer; it moves it on all.
	Float8e4m3 DataType = 10
	// Float8e5m2 is ncclFloat8e5m2 (NCCL 2.24+): 5 exponent bits, 2 mantissa bits.
	Float8e5m2 DataType = 11
)

var dataTypeSizes = map[DataType]uint64{
	Int8: 1, Uint8: 1, Int32: 4, Uint32: 4, Int64: 8, Uint64: 8, Float16: 2, Float32: 4, Float64: 8, Bfloat16: 2,
	Float8e4m3: 1, Float8e5m2: 1,
}

var dataTypeNames = map[DataType]string{
	Int8: "int8", Uint8: "uint8", Int32: "int32", Uint32: "uint32", Int64: "int64", Uint64: "uint64",
	Float16: "float16", Float32: "float32", Float64: "float64", Bfloat16: "bfloat16",
	Float8e4m3: "float8e4m3", Float8e5m2: "float8e5m2",
}

// Size is the element size in bytes, 0 for an unknown type.
func (t DataType) Size() uint64 { return dataTypeSizes[t] }

// Since is the first NCCL version (NCCL_VERSION_CODE) that has the type.
func (t DataType) Since() int {
	if t == Float8e4m3 || t == Float8e5m2 {
		return VersionFloat8
	}
	return 0
}

func (t DataType) String() string {
	if n, ok := dataTypeNames[t]; ok {
		return n
	}
	return fmt.Sprintf("DataType(%d)", int32(t))
}

// RedOp is ncclRedOp_t (the built-in operations).
type RedOp int32

// ncclRedOp_t values.
const (
	Sum  RedOp = 0
	Prod RedOp = 1
	Max  RedOp = 2
	Min  RedOp = 3
	Avg  RedOp = 4
)

func (o RedOp) String() string {
	switch o {
	case Sum:
		return "sum"
	case Prod:
		return "prod"
	case Max:
		return "max"
	case Min:
		return "min"
	case Avg:
		return "avg"
	}
	return fmt.Sprintf("RedOp(%d)", int32(o))
}

// ConfigUndef is NCCL_CONFIG_UNDEF_INT: the library picks the value.
const ConfigUndef = -2147483648

// Config is the part of ncclConfig_t (nccl.h 2.28, struct ncclConfig_v22800) that callers set; the
// loader fills size, magic and version as NCCL_CONFIG_INITIALIZER does. ConfigUndef (the zero value
// of DefaultConfig's fields) leaves a field to the library. NVLink SHARP (NVLS) is never requested
// here: its use is left to NCCL_NVLS_ENABLE in the environment.
type Config struct {
	Blocking            int32 // 0: non-blocking (what NewComm uses), 1: blocking
	CGAClusterSize      int32
	MinCTAs             int32
	MaxCTAs             int32
	NetName             string // "" leaves it undefined
	SplitShare          int32
	TrafficClass        int32
	CommName            string // "" leaves it undefined
	CollnetEnable       int32
	CTAPolicy           int32
	ShrinkShare         int32
	NvlsCTAs            int32
	NChannelsPerNetPeer int32
	NvlinkCentricSched  int32
}

// DefaultConfig is NCCL_CONFIG_INITIALIZER: every field undefined.
func DefaultConfig() Config {
	u := int32(ConfigUndef)
	return Config{Blocking: u, CGAClusterSize: u, MinCTAs: u, MaxCTAs: u, SplitShare: u, TrafficClass: u,
		CollnetEnable: u, CTAPolicy: u, ShrinkShare: u, NvlsCTAs: u, NChannelsPerNetPeer: u, NvlinkCentricSched: u}
}

// Minimum NCCL versions (NCCL_VERSION_CODE) of the features this package uses.
const (
	// MinVersion: ncclCommInitRankConfig with non-blocking communicators, ncclCommFinalize.
	MinVersion = 21400
	// VersionRegister: ncclCommRegister / ncclCommDeregister.
	VersionRegister = 21900
	// VersionWindow: ncclCommWindowRegister / ncclCommWindowDeregister.
	VersionWindow = 22700
	// VersionFloat8: the data types Float8e4m3 and Float8e5m2.
	VersionFloat8 = 22400
	// VersionConfigHeader is the version of the ncclConfig_t this package declares.
	VersionConfigHeader = 22800
)

// API is every NCCL call this package makes. Open returns the real library; ncclsim.New returns the
// simulated stand-in. Methods are named after the C function without the "nccl" prefix. A call whose
// entry point the library lacks returns a *VersionError.
//
// Thread rule: like NCCL, the calls that take a device or a stream act in the calling OS thread's
// current CUDA context, and ncclGroupStart/ncclGroupEnd nest per OS thread. Comm makes these calls
// on a locked OS thread with the communicator's device bound.
type API interface {
	// Version is ncclGetVersion's answer, read once when the library was opened.
	Version() int
	// GetErrorString calls ncclGetErrorString.
	GetErrorString(r Result) string
	// GetLastError calls ncclGetLastError(comm) ("" when none).
	GetLastError(c CommHandle) string

	// GetUniqueID calls ncclGetUniqueId.
	GetUniqueID() (UniqueID, error)
	// CommInitRankConfig calls ncclCommInitRankConfig. dev is the device whose primary context is
	// current on the calling thread (NCCL takes the current device). With cfg.Blocking 0 it may
	// return a handle together with InProgress: poll CommGetAsyncError.
	CommInitRankConfig(nranks int, id UniqueID, rank int, dev driver.Device, cfg *Config) (CommHandle, error)
	// CommGetAsyncError calls ncclCommGetAsyncError and returns the state as an error: nil, a
	// Result of InProgress, or the communicator's error.
	CommGetAsyncError(c CommHandle) error
	// CommFinalize calls ncclCommFinalize.
	CommFinalize(c CommHandle) error
	// CommDestroy calls ncclCommDestroy.
	CommDestroy(c CommHandle) error
	// CommAbort calls ncclCommAbort.
	CommAbort(c CommHandle) error
	// CommCount calls ncclCommCount.
	CommCount(c CommHandle) (int, error)
	// CommCuDevice calls ncclCommCuDevice.
	CommCuDevice(c CommHandle) (int, error)
	// CommUserRank calls ncclCommUserRank.
	CommUserRank(c CommHandle) (int, error)

	// CommRegister calls ncclCommRegister (2.19+).
	CommRegister(c CommHandle, ptr driver.DevicePtr, size uint64) (RegHandle, error)
	// CommDeregister calls ncclCommDeregister (2.19+).
	CommDeregister(c CommHandle, h RegHandle) error
	// CommWindowRegister calls ncclCommWindowRegister (2.27+; collective: every rank calls it). On a
	// non-blocking communicator NCCL writes the window when the registration completes, after the
	// call returns InProgress: call window, once, after CommGetAsyncError reports success.
	CommWindowRegister(c CommHandle, ptr driver.DevicePtr, size uint64, flags int) (window func() Window, err error)
	// CommWindowDeregister calls ncclCommWindowDeregister (2.27+).
	CommWindowDeregister(c CommHandle, w Window) error

	// GroupStart calls ncclGroupStart.
	GroupStart() error
	// GroupEnd calls ncclGroupEnd.
	GroupEnd() error
	// Send calls ncclSend.
	Send(buf driver.DevicePtr, count uint64, t DataType, peer int, c CommHandle, s driver.Stream) error
	// Recv calls ncclRecv.
	Recv(buf driver.DevicePtr, count uint64, t DataType, peer int, c CommHandle, s driver.Stream) error
	// AllReduce calls ncclAllReduce.
	AllReduce(send, recv driver.DevicePtr, count uint64, t DataType, op RedOp, c CommHandle, s driver.Stream) error
	// AllGather calls ncclAllGather.
	AllGather(send, recv driver.DevicePtr, sendCount uint64, t DataType, c CommHandle, s driver.Stream) error
	// ReduceScatter calls ncclReduceScatter.
	ReduceScatter(send, recv driver.DevicePtr, recvCount uint64, t DataType, op RedOp, c CommHandle, s driver.Stream) error
	// Broadcast calls ncclBroadcast.
	Broadcast(send, recv driver.DevicePtr, count uint64, t DataType, root int, c CommHandle, s driver.Stream) error
}
