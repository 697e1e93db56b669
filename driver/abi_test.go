package driver

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"unsafe"
)

// factsLayout is docs/driver-facts.md, section 1's struct table, keyed like cLayout.
var factsLayout = map[string]int64{
	"sizeof(CUmemLocation)":                                          8,
	"offsetof(CUmemLocation, type)":                                  0,
	"offsetof(CUmemLocation, id)":                                    4,
	"sizeof(CUmemAllocationProp)":                                    32,
	"_Alignof(CUmemAllocationProp)":                                  8,
	"offsetof(CUmemAllocationProp, type)":                            0,
	"offsetof(CUmemAllocationProp, requestedHandleTypes)":            4,
	"offsetof(CUmemAllocationProp, location)":                        8,
	"offsetof(CUmemAllocationProp, location.id)":                     12,
	"offsetof(CUmemAllocationProp, win32HandleMetaData)":             16,
	"offsetof(CUmemAllocationProp, allocFlags)":                      24,
	"sizeof(((CUmemAllocationProp *)0)->allocFlags)":                 8,
	"offsetof(CUmemAllocationProp, allocFlags.compressionType)":      24,
	"offsetof(CUmemAllocationProp, allocFlags.gpuDirectRDMACapable)": 25,
	"offsetof(CUmemAllocationProp, allocFlags.usage)":                26,
	"offsetof(CUmemAllocationProp, allocFlags.reserved)":             28,
	"sizeof(((CUmemAllocationProp *)0)->allocFlags.reserved)":        4,
	"sizeof(CUmemAccessDesc)":                                        12,
	"offsetof(CUmemAccessDesc, location)":                            0,
	"offsetof(CUmemAccessDesc, flags)":                               8,
	"sizeof(CUmemFabricHandle)":                                      64,
	"sizeof(CUuuid)":                                                 16,
	"sizeof(CUresult)":                                               4,
	"sizeof(CUdevice)":                                               4,
	"sizeof(CUdeviceptr)":                                            8,
	"sizeof(CUmemGenericAllocationHandle)":                           8,
}

// TestCLayoutMatchesFacts checks our C declarations (as cgo sees them) and the Go structs passed to
// C by address against docs/driver-facts.md, on every machine.
func TestCLayoutMatchesFacts(t *testing.T) {
	got := cLayout()
	if got == nil {
		t.Skip("no C declarations in this build (cgo disabled or not Linux)")
	}
	for k, want := range factsLayout {
		if v, ok := got[k]; !ok || v != want {
			t.Errorf("%s = %d (present %v), docs/driver-facts.md says %d", k, v, ok, want)
		}
	}
	for k := range got {
		if _, ok := factsLayout[k]; !ok {
			t.Errorf("cLayout reports %s, which the test does not know", k)
		}
	}
	var d AccessDesc
	if unsafe.Sizeof(d) != 12 || unsafe.Offsetof(d.Flags) != 8 || unsafe.Offsetof(d.Location.ID) != 4 {
		t.Errorf("Go AccessDesc layout: size %d, flags at %d", unsafe.Sizeof(d), unsafe.Offsetof(d.Flags))
	}
}

// abiConstants maps each <cuda.h> name to the value this package declares for it.
func abiConstants() map[string]int64 {
	m := map[string]int64{
		"CU_MEM_ALLOCATION_TYPE_PINNED":            int64(AllocationTypePinned),
		"CU_MEM_HANDLE_TYPE_NONE":                  int64(HandleTypeNone),
		"CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR": int64(HandleTypePosixFD),
		"CU_MEM_HANDLE_TYPE_WIN32":                 int64(HandleTypeWin32),
		"CU_MEM_HANDLE_TYPE_WIN32_KMT":             int64(HandleTypeWin32KMT),
		"CU_MEM_HANDLE_TYPE_FABRIC":                int64(HandleTypeFabric),
		"CU_MEM_LOCATION_TYPE_INVALID":             int64(LocationInvalid),
		"CU_MEM_LOCATION_TYPE_DEVICE":              int64(LocationDevice),
		"CU_MEM_LOCATION_TYPE_HOST":                int64(LocationHost),
		"CU_MEM_LOCATION_TYPE_HOST_NUMA":           int64(LocationHostNUMA),
		"CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT":   int64(LocationHostNUMACurrent),
		"CU_MEM_ACCESS_FLAGS_PROT_NONE":            int64(AccessNone),
		"CU_MEM_ACCESS_FLAGS_PROT_READ":            int64(AccessRead),
		"CU_MEM_ACCESS_FLAGS_PROT_READWRITE":       int64(AccessReadWrite),
		"CU_MEM_ALLOC_GRANULARITY_MINIMUM":         int64(GranularityMinimum),
		"CU_MEM_ALLOC_GRANULARITY_RECOMMENDED":     int64(GranularityRecommended),
		"CU_MEM_ALLOCATION_COMP_NONE":              int64(CompressionNone),
		"CU_MEM_ALLOCATION_COMP_GENERIC":           int64(CompressionGeneric),
		"CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD":      int64(RangeHandleTypeDMABufFD),
		"CU_MEMHOSTREGISTER_PORTABLE":              int64(HostRegisterPortable),
		"CU_MEMHOSTREGISTER_DEVICEMAP":             int64(HostRegisterDeviceMap),
		"CU_MEMHOSTREGISTER_IOMEMORY":              int64(HostRegisterIOMemory),
		"CU_MEMHOSTREGISTER_READ_ONLY":             int64(HostRegisterReadOnly),
		"CU_MEMHOSTALLOC_PORTABLE":                 int64(HostAllocPortable),
		"CU_MEMHOSTALLOC_DEVICEMAP":                int64(HostAllocDeviceMap),
		"CU_MEMHOSTALLOC_WRITECOMBINED":            int64(HostAllocWriteCombined),
		"CU_STREAM_DEFAULT":                        int64(StreamDefault),
		"CU_STREAM_NON_BLOCKING":                   int64(StreamNonBlocking),
		"CU_EVENT_DEFAULT":                         int64(EventDefault),
		"CU_EVENT_BLOCKING_SYNC":                   int64(EventBlockingSync),
		"CU_EVENT_DISABLE_TIMING":                  int64(EventDisableTiming),

		// Graphs
		"CU_STREAM_CAPTURE_MODE_GLOBAL":                     int64(CaptureModeGlobal),
		"CU_STREAM_CAPTURE_MODE_THREAD_LOCAL":               int64(CaptureModeThreadLocal),
		"CU_STREAM_CAPTURE_MODE_RELAXED":                    int64(CaptureModeRelaxed),
		"sizeof(CUgraph)":                                   int64(unsafe.Sizeof(Graph(0))),
		"sizeof(CUgraphExec)":                               int64(unsafe.Sizeof(GraphExec(0))),
		"CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES":   int64(MemPoolReuseFollowEventDependencies),
		"CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC":         int64(MemPoolReuseAllowOpportunistic),
		"CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES": int64(MemPoolReuseAllowInternalDependencies),
		"CU_MEMPOOL_ATTR_RELEASE_THRESHOLD":                 int64(MemPoolReleaseThreshold),
		"CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT":              int64(MemPoolReservedMemCurrent),
		"CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH":                 int64(MemPoolReservedMemHigh),
		"CU_MEMPOOL_ATTR_USED_MEM_CURRENT":                  int64(MemPoolUsedMemCurrent),
		"CU_MEMPOOL_ATTR_USED_MEM_HIGH":                     int64(MemPoolUsedMemHigh),
		"sizeof(CUmemoryPool)":                              int64(unsafe.Sizeof(MemPool(0))),

		"CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT":                          int64(AttrMultiprocessorCount),
		"CU_DEVICE_ATTRIBUTE_PCI_BUS_ID":                                    int64(AttrPCIBusID),
		"CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID":                                 int64(AttrPCIDeviceID),
		"CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING":                            int64(AttrUnifiedAddressing),
		"CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID":                                 int64(AttrPCIDomainID),
		"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR":                      int64(AttrComputeCapabilityMajor),
		"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR":                      int64(AttrComputeCapabilityMinor),
		"CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM":       int64(AttrCanUseHostPointerForRegisteredMem),
		"CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED":                       int64(AttrHostRegisterSupported),
		"CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED":           int64(AttrVirtualMemoryManagementSupported),
		"CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED":   int64(AttrHandleTypePosixFDSupported),
		"CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED":                 int64(AttrGenericCompressionSupported),
		"CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED":       int64(AttrGPUDirectRDMAWithCUDAVMMSupported),
		"CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED":             int64(AttrReadOnlyHostRegisterSupported),
		"CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED":                             int64(AttrDMABufSupported),
		"CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED":                  int64(AttrHandleTypeFabricSupported),
		"CU_DEVICE_ATTRIBUTE_NUMA_CONFIG":                                   int64(AttrNUMAConfig),
		"CU_DEVICE_ATTRIBUTE_NUMA_ID":                                       int64(AttrNUMAID),
		"CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID":                                  int64(AttrHostNUMAID),
		"CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED": int64(AttrHostNUMAVirtualMemoryManagementSupported),
		"CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED":      int64(AttrHostVirtualMemoryManagementSupported),
	}
	for r, e := range builtinResults {
		m[e.name] = int64(r)
	}
	return m
}

// cudaInclude finds the toolkit's include directory.
func cudaInclude() string {
	for _, env := range []string{"CUDA_HOME", "CUDA_PATH"} {
		if d := os.Getenv(env); d != "" {
			if _, err := os.Stat(filepath.Join(d, "include", "cuda.h")); err == nil {
				return filepath.Join(d, "include")
			}
		}
	}
	if _, err := os.Stat("/usr/local/cuda/include/cuda.h"); err == nil {
		return "/usr/local/cuda/include"
	}
	return ""
}

var gccLineError = regexp.MustCompile(`abi\.c:(\d+):\d+: error: (.*)`)

// TestABIAgainstCudaH compiles a C program against the installed <cuda.h> that prints every size,
// offset and value this package declares, and compares: the header with the Go constants, and the
// header's layout with our own C declarations. A name the header lacks is reported by name.
func TestABIAgainstCudaH(t *testing.T) {
	inc := cudaInclude()
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	_, ccErr := exec.LookPath(cc)
	if inc == "" || ccErr != nil {
		why := "needs <cuda.h> (in /usr/local/cuda/include, $CUDA_HOME/include or $CUDA_PATH/include) and a C compiler"
		if inc == "" {
			why += "; no cuda.h found"
		}
		if ccErr != nil {
			why += "; " + ccErr.Error()
		}
		if requireGPU() {
			t.Fatal("CUVMM_REQUIRE_GPU=1: " + why)
		}
		t.Skip(why)
	}
	layout := cLayout()
	if layout == nil {
		t.Skip("no C declarations in this build (cgo disabled or not Linux)")
	}

	// Every expected value, from our layout or our constants.
	want := map[string]int64{}
	source := map[string]string{}
	for k, v := range layout {
		want[k], source[k] = v, "cuda_abi.h"
	}
	for k, v := range abiConstants() {
		want[k], source[k] = v, "Go constant"
	}
	names := make([]string, 0, len(want))
	for k := range want {
		names = append(names, k)
	}
	sort.Strings(names)

	dir := t.TempDir()
	src := filepath.Join(dir, "abi.c")
	bin := filepath.Join(dir, "abi")
	var compileErrs []string
	for attempt := 0; ; attempt++ {
		var b strings.Builder
		b.WriteString("#include <cuda.h>\n#include <stddef.h>\n#include <stdio.h>\nint main(void) {\n")
		const firstLine = 5
		for _, n := range names {
			fmt.Fprintf(&b, "printf(\"%%s\\t%%lld\\n\", %q, (long long)(%s));\n", n, n)
		}
		b.WriteString("return 0;\n}\n")
		if err := os.WriteFile(src, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(cc, "-I"+inc, "-o", bin, src).CombinedOutput()
		if err == nil {
			break
		}
		// Drop the lines the compiler refused (a name this header does not have) and say so.
		bad := map[int]string{}
		for _, m := range gccLineError.FindAllStringSubmatch(string(out), -1) {
			line, _ := strconv.Atoi(m[1])
			if i := line - firstLine; i >= 0 && i < len(names) {
				if _, seen := bad[i]; !seen {
					bad[i] = m[2]
				}
			}
		}
		if len(bad) == 0 || attempt >= 3 {
			t.Fatalf("compiling the ABI probe against %s/cuda.h failed:\n%s", inc, out)
		}
		var keep []string
		for i, n := range names {
			if msg, ok := bad[i]; ok {
				compileErrs = append(compileErrs, fmt.Sprintf("%s: not usable with this cuda.h: %s", n, msg))
				continue
			}
			keep = append(keep, n)
		}
		names = keep
	}
	for _, e := range compileErrs {
		t.Error(e)
	}

	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatalf("running the ABI probe: %v", err)
	}
	got := map[string]int64{}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), "\t")
		if !ok {
			continue
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			t.Fatalf("probe output %q", sc.Text())
		}
		got[k] = n
	}
	for _, n := range names {
		g, ok := got[n]
		if !ok {
			t.Errorf("%s: no value printed", n)
			continue
		}
		if g != want[n] {
			t.Errorf("ABI mismatch: %s is %d in cuda.h, %d in %s", n, g, want[n], source[n])
		}
	}
	t.Logf("checked %d sizes, offsets and values against %s/cuda.h", len(names), inc)

	// Informational: symbols the header does not mention (a plain legacy name we resolve on purpose,
	// for example, may only be declared under a macro).
	if hdr, err := os.ReadFile(filepath.Join(inc, "cuda.h")); err == nil {
		var absent []string
		for _, s := range symbols {
			if !regexp.MustCompile(`\b` + s.name + `\b`).Match(hdr) {
				absent = append(absent, s.name)
			}
		}
		if len(absent) > 0 {
			t.Logf("note: resolved symbols that cuda.h does not mention: %v", absent)
		}
	}
}
