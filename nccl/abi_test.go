package nccl

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// The NCCL ABI check: a C program compiled against the installed <nccl.h> prints every size, offset
// and value this package declares, and the test compares them with our C declarations (as cgo
// compiled them) and our Go constants. It runs wherever nccl.h and a compiler are found; under
// CUVMM_REQUIRE_NCCL=1 a missing header or compiler is a failure.

// abiConstants maps each <nccl.h> name to the value this package declares for it.
func abiConstants() map[string]int64 {
	m := map[string]int64{
		"NCCL_UNIQUE_ID_BYTES":                                       UniqueIDBytes,
		"NCCL_CONFIG_UNDEF_INT":                                      ConfigUndef,
		"NCCL_WIN_DEFAULT":                                           0,
		"NCCL_WIN_COLL_SYMMETRIC":                                    1,
		"((ncclConfig_t)NCCL_CONFIG_INITIALIZER).magic":              0xcafebeef,
		"((ncclConfig_t)NCCL_CONFIG_INITIALIZER).blocking":           ConfigUndef,
		"((ncclConfig_t)NCCL_CONFIG_INITIALIZER).nvlinkCentricSched": ConfigUndef,
		"ncclNumTypes":                                               int64(len(dataTypeSizes)),
		"ncclSum":                                                    int64(Sum), "ncclProd": int64(Prod), "ncclMax": int64(Max), "ncclMin": int64(Min), "ncclAvg": int64(Avg),
	}
	for r, n := range resultNames {
		m[n] = int64(r)
	}
	types := map[DataType]string{Int8: "ncclInt8", Uint8: "ncclUint8", Int32: "ncclInt32", Uint32: "ncclUint32",
		Int64: "ncclInt64", Uint64: "ncclUint64", Float16: "ncclFloat16", Float32: "ncclFloat32",
		Float64: "ncclFloat64", Bfloat16: "ncclBfloat16", Float8e4m3: "ncclFloat8e4m3", Float8e5m2: "ncclFloat8e5m2"}
	for t, n := range types {
		m[n] = int64(t)
	}
	return m
}

// ncclInclude finds the directory of nccl.h: $CUVMM_NCCL_INCLUDE, the include directory beside
// $CUVMM_NCCL_LIBRARY's lib directory, or the nvidia-nccl Python package's.
func ncclInclude() (string, []string) {
	var tried []string
	check := func(dir string) bool {
		tried = append(tried, dir)
		_, err := os.Stat(filepath.Join(dir, "nccl.h"))
		return dir != "" && err == nil
	}
	if d := os.Getenv("CUVMM_NCCL_INCLUDE"); d != "" && check(d) {
		return d, tried
	}
	if l := os.Getenv(EnvLibrary); l != "" {
		if d := filepath.Join(filepath.Dir(filepath.Dir(l)), "include"); check(d) {
			return d, tried
		}
	}
	const py = `import os, nvidia
for root in nvidia.__path__:
    for d, _, files in os.walk(root):
        if "nccl.h" in files:
            print(d); raise SystemExit
`
	if out, err := exec.Command("python3", "-c", py).Output(); err == nil {
		if d := strings.TrimSpace(string(out)); check(d) {
			return d, tried
		}
	} else {
		tried = append(tried, "python3 nvidia packages: "+err.Error())
	}
	if check("/usr/include") {
		return "/usr/include", tried
	}
	return "", tried
}

// cudaIncludes lists the CUDA include directories nccl.h needs (cuda_runtime.h).
func cudaIncludes() []string {
	var out []string
	for _, env := range []string{"CUDA_HOME", "CUDA_PATH"} {
		if d := os.Getenv(env); d != "" {
			out = append(out, filepath.Join(d, "include"))
		}
	}
	return append(out, "/usr/local/cuda/include")
}

func TestABIAgainstNCCLHeader(t *testing.T) {
	layout := cLayout()
	if layout == nil {
		t.Skip("no C declarations in this build (cgo disabled or not Linux)")
	}
	inc, tried := ncclInclude()
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	_, ccErr := exec.LookPath(cc)
	if inc == "" || ccErr != nil {
		why := fmt.Sprintf("needs <nccl.h> (tried %q) and a C compiler (%v)", tried, ccErr)
		if os.Getenv("CUVMM_REQUIRE_NCCL") == "1" {
			t.Fatal("CUVMM_REQUIRE_NCCL=1: " + why)
		}
		t.Skip(why)
	}
	want := map[string]int64{}
	for k, v := range layout {
		want[k] = v
	}
	for k, v := range abiConstants() {
		want[k] = v
	}
	names := make([]string, 0, len(want))
	for k := range want {
		names = append(names, k)
	}
	sort.Strings(names)
	extra := []string{"NCCL_VERSION_CODE", "sizeof(ncclConfig_t)"}

	got := probe(t, cc, inc, append(append([]string{}, names...), extra...))
	for _, n := range names {
		if g, ok := got[n]; !ok || g != want[n] {
			t.Errorf("ABI mismatch: %s is %d in nccl.h (present %v), %d in this package", n, g, ok, want[n])
		}
	}
	code, size := got["NCCL_VERSION_CODE"], got["sizeof(ncclConfig_t)"]
	if code/100 == VersionConfigHeader/100 && size != configSize() {
		t.Errorf("sizeof(ncclConfig_t) is %d in nccl.h %s, %d in this package's 2.28 declaration", size, FormatVersion(int(code)), configSize())
	}
	if size < configSize() {
		t.Errorf("sizeof(ncclConfig_t) is %d in nccl.h %s, smaller than this package's %d", size, FormatVersion(int(code)), configSize())
	}
	t.Logf("checked %d sizes, offsets and values against %s/nccl.h (NCCL %s, ncclConfig_t %d bytes)", len(names), inc, FormatVersion(int(code)), size)
}

// probe compiles and runs a C program against inc/nccl.h that prints each expression in exprs.
func probe(t *testing.T, cc, inc string, exprs []string) map[string]int64 {
	t.Helper()
	var b strings.Builder
	b.WriteString("#include <stddef.h>\n#include <stdio.h>\n#include <nccl.h>\nint main(void) {\n")
	for _, n := range exprs {
		fmt.Fprintf(&b, "printf(\"%%s\\t%%lld\\n\", %q, (long long)(%s));\n", n, n)
	}
	b.WriteString("return 0;\n}\n")
	dir := t.TempDir()
	src, bin := filepath.Join(dir, "abi.c"), filepath.Join(dir, "abi")
	if err := os.WriteFile(src, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{"-I" + inc}
	for _, d := range cudaIncludes() {
		args = append(args, "-I"+d)
	}
	out, err := exec.Command(cc, append(args, "-o", bin, src)...).CombinedOutput()
	if err != nil {
		t.Fatalf("compiling the ABI probe against %s/nccl.h failed (cuda_runtime.h is looked for in %v):\n%s", inc, cudaIncludes(), out)
	}
	out, err = exec.Command(bin).Output()
	if err != nil {
		t.Fatalf("running the ABI probe: %v", err)
	}
	got := map[string]int64{}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		k, v, _ := strings.Cut(sc.Text(), "\t")
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			t.Fatalf("probe output %q", sc.Text())
		}
		got[k] = n
	}
	return got
}
