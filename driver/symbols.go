package driver

// symbol indexes the table of driver entry points resolved when a library is loaded.
type symbol int

// The entry points, one per API method (plus the two error-text calls). The order is the order of
// docs/driver-facts.md, section 1's table.
const (
	symInit symbol = iota
	symDriverGetVersion
	symDeviceGet
	symDeviceGetCount
	symDeviceGetName
	symDeviceGetAttribute
	symDeviceTotalMem
	symDeviceCanAccessPeer
	symDeviceGetUUID
	symDevicePrimaryCtxRetain
	symDevicePrimaryCtxRelease
	symCtxSetCurrent
	symCtxGetCurrent
	symCtxSynchronize
	symGetErrorName
	symGetErrorString
	symMemGetInfo
	symMemCreate
	symMemRelease
	symMemGetAllocationGranularity
	symMemGetAllocationPropertiesFromHandle
	symMemRetainAllocationHandle
	symMemAddressReserve
	symMemAddressFree
	symMemMap
	symMemUnmap
	symMemSetAccess
	symMemGetAccess
	symMemExportToShareableHandle
	symMemImportFromShareableHandle
	symMemGetHandleForAddressRange
	symMemHostRegister
	symMemHostUnregister
	symMemHostGetDevicePointer
	symMemHostAlloc
	symMemFreeHost
	symMemcpy
	symMemcpyHtoD
	symMemcpyDtoH
	symMemcpyDtoD
	symMemcpyAsync
	symMemcpyHtoDAsync
	symMemcpyDtoHAsync
	symMemcpyPeerAsync
	symMemsetD8
	symMemsetD32
	symMemsetD8Async
	symStreamCreate
	symStreamDestroy
	symStreamSynchronize
	symEventCreate
	symEventRecord
	symEventSynchronize
	symEventElapsedTime
	symEventDestroy
	symModuleLoadData
	symModuleGetFunction
	symModuleUnload
	symLaunchKernel
	symMemAlloc
	symMemFree

	// Graphs
	symStreamBeginCapture
	symStreamEndCapture
	symGraphInstantiate
	symGraphLaunch
	symGraphExecDestroy
	symGraphDestroy
	// Stream-ordered allocation and event queries.
	symStreamWaitEvent
	symEventQuery
	symMemAllocAsync
	symMemFreeAsync
	symDeviceGetDefaultMemPool
	symMemPoolSetAttribute
	symMemPoolGetAttribute
	symMemPoolTrimTo

	numSymbols
)

// symbolInfo names one entry point.
type symbolInfo struct {
	// name is the exact versioned symbol. The driver also exports the plain legacy names with the
	// pre-3.2 ABI (32-bit sizes), so resolving "cuMemAlloc" instead of "cuMemAlloc_v2" would give a
	// silently wrong call; the _v2 names here are deliberate.
	name string
	// since is the first CUDA version whose driver exports name, for SymbolError.
	since string
	// fallback is resolved when name is missing; it must have the same C signature.
	fallback string
}

// symbols is the table of versioned entry points (docs/driver-facts.md, section 1). The real driver resolves
// each with dlsym by exactly this name, never through cuGetProcAddress, so that what is called is
// predictable and visible here.
var symbols = [numSymbols]symbolInfo{
	symInit:                                 {name: "cuInit", since: "2.0"},
	symDriverGetVersion:                     {name: "cuDriverGetVersion", since: "2.2"},
	symDeviceGet:                            {name: "cuDeviceGet", since: "2.0"},
	symDeviceGetCount:                       {name: "cuDeviceGetCount", since: "2.0"},
	symDeviceGetName:                        {name: "cuDeviceGetName", since: "2.0"},
	symDeviceGetAttribute:                   {name: "cuDeviceGetAttribute", since: "2.0"},
	symDeviceTotalMem:                       {name: "cuDeviceTotalMem_v2", since: "3.2"},
	symDeviceCanAccessPeer:                  {name: "cuDeviceCanAccessPeer", since: "4.0"},
	symDeviceGetUUID:                        {name: "cuDeviceGetUuid_v2", since: "11.4"},
	symDevicePrimaryCtxRetain:               {name: "cuDevicePrimaryCtxRetain", since: "7.0"},
	symDevicePrimaryCtxRelease:              {name: "cuDevicePrimaryCtxRelease_v2", since: "11.0"},
	symCtxSetCurrent:                        {name: "cuCtxSetCurrent", since: "4.0"},
	symCtxGetCurrent:                        {name: "cuCtxGetCurrent", since: "4.0"},
	symCtxSynchronize:                       {name: "cuCtxSynchronize", since: "2.0"}, // the (void) form; CUDA 13's cuCtxSynchronize_v2 takes a context
	symGetErrorName:                         {name: "cuGetErrorName", since: "6.0"},
	symGetErrorString:                       {name: "cuGetErrorString", since: "6.0"},
	symMemGetInfo:                           {name: "cuMemGetInfo_v2", since: "3.2"},
	symMemCreate:                            {name: "cuMemCreate", since: "10.2"},
	symMemRelease:                           {name: "cuMemRelease", since: "10.2"},
	symMemGetAllocationGranularity:          {name: "cuMemGetAllocationGranularity", since: "10.2"},
	symMemGetAllocationPropertiesFromHandle: {name: "cuMemGetAllocationPropertiesFromHandle", since: "10.2"},
	symMemRetainAllocationHandle:            {name: "cuMemRetainAllocationHandle", since: "11.0"},
	symMemAddressReserve:                    {name: "cuMemAddressReserve", since: "10.2"},
	symMemAddressFree:                       {name: "cuMemAddressFree", since: "10.2"},
	symMemMap:                               {name: "cuMemMap", since: "10.2"},
	symMemUnmap:                             {name: "cuMemUnmap", since: "10.2"},
	symMemSetAccess:                         {name: "cuMemSetAccess", since: "10.2"},
	symMemGetAccess:                         {name: "cuMemGetAccess", since: "10.2"},
	symMemExportToShareableHandle:           {name: "cuMemExportToShareableHandle", since: "10.2"},
	symMemImportFromShareableHandle:         {name: "cuMemImportFromShareableHandle", since: "10.2"},
	symMemGetHandleForAddressRange:          {name: "cuMemGetHandleForAddressRange", since: "11.7"},
	symMemHostRegister:                      {name: "cuMemHostRegister_v2", since: "6.5"},
	symMemHostUnregister:                    {name: "cuMemHostUnregister", since: "4.0"},
	symMemHostGetDevicePointer:              {name: "cuMemHostGetDevicePointer_v2", since: "3.2"},
	symMemHostAlloc:                         {name: "cuMemHostAlloc", since: "3.2"},
	symMemFreeHost:                          {name: "cuMemFreeHost", since: "2.0"},
	symMemcpy:                               {name: "cuMemcpy", since: "4.0"},
	symMemcpyHtoD:                           {name: "cuMemcpyHtoD_v2", since: "3.2"},
	symMemcpyDtoH:                           {name: "cuMemcpyDtoH_v2", since: "3.2"},
	symMemcpyDtoD:                           {name: "cuMemcpyDtoD_v2", since: "3.2"},
	symMemcpyAsync:                          {name: "cuMemcpyAsync", since: "4.0"},
	symMemcpyHtoDAsync:                      {name: "cuMemcpyHtoDAsync_v2", since: "3.2"},
	symMemcpyDtoHAsync:                      {name: "cuMemcpyDtoHAsync_v2", since: "3.2"},
	symMemcpyPeerAsync:                      {name: "cuMemcpyPeerAsync", since: "4.0"},
	symMemsetD8:                             {name: "cuMemsetD8_v2", since: "3.2"},
	symMemsetD32:                            {name: "cuMemsetD32_v2", since: "3.2"},
	symMemsetD8Async:                        {name: "cuMemsetD8Async", since: "3.2"}, // born with 64-bit sizes: no _v2
	symStreamCreate:                         {name: "cuStreamCreate", since: "2.0"},
	symStreamDestroy:                        {name: "cuStreamDestroy_v2", since: "4.0"},
	symStreamSynchronize:                    {name: "cuStreamSynchronize", since: "2.0"},
	symEventCreate:                          {name: "cuEventCreate", since: "2.0"},
	symEventRecord:                          {name: "cuEventRecord", since: "2.0"},
	symEventSynchronize:                     {name: "cuEventSynchronize", since: "2.0"},
	symEventElapsedTime:                     {name: "cuEventElapsedTime_v2", since: "12.8", fallback: "cuEventElapsedTime"},
	symEventDestroy:                         {name: "cuEventDestroy_v2", since: "4.0"},
	symModuleLoadData:                       {name: "cuModuleLoadData", since: "2.0"},
	symModuleGetFunction:                    {name: "cuModuleGetFunction", since: "2.0"},
	symModuleUnload:                         {name: "cuModuleUnload", since: "2.0"},
	symLaunchKernel:                         {name: "cuLaunchKernel", since: "4.0"},
	symMemAlloc:                             {name: "cuMemAlloc_v2", since: "3.2"},
	symMemFree:                              {name: "cuMemFree_v2", since: "3.2"},

	// Graphs. cuStreamBeginCapture_v2 takes the capture mode (the plain name is the 10.0 form
	// without it); cuGraphInstantiateWithFlags is what cuGraphInstantiate means since CUDA 12 (the
	// plain symbol is the 11.x form with an error-log buffer).
	symStreamBeginCapture: {name: "cuStreamBeginCapture_v2", since: "10.1"},
	symStreamEndCapture:   {name: "cuStreamEndCapture", since: "10.0"},
	symGraphInstantiate:   {name: "cuGraphInstantiateWithFlags", since: "11.4"},
	symGraphLaunch:        {name: "cuGraphLaunch", since: "10.0"},
	symGraphExecDestroy:   {name: "cuGraphExecDestroy", since: "10.0"},
	symGraphDestroy:       {name: "cuGraphDestroy", since: "10.0"},
	// Stream-ordered allocation and event queries. The plain names are the legacy-default-stream
	// forms (the _ptsz variants are the per-thread-default-stream ones).
	symStreamWaitEvent:         {name: "cuStreamWaitEvent", since: "3.2"},
	symEventQuery:              {name: "cuEventQuery", since: "2.0"},
	symMemAllocAsync:           {name: "cuMemAllocAsync", since: "11.2"},
	symMemFreeAsync:            {name: "cuMemFreeAsync", since: "11.2"},
	symDeviceGetDefaultMemPool: {name: "cuDeviceGetDefaultMemPool", since: "11.2"},
	symMemPoolSetAttribute:     {name: "cuMemPoolSetAttribute", since: "11.2"},
	symMemPoolGetAttribute:     {name: "cuMemPoolGetAttribute", since: "11.2"},
	symMemPoolTrimTo:           {name: "cuMemPoolTrimTo", since: "11.2"},
}
