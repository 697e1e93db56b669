//go:build cgo && linux

package nccl

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// fakeLibrary compiles a shared library from C source (a stand-in for some NCCL build) and returns
// its path.
func fakeLibrary(t *testing.T, name, src string) string {
	t.Helper()
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("needs a C compiler to build fake libraries: %v", err)
	}
	dir := t.TempDir()
	c := filepath.Join(dir, name+".c")
	so := filepath.Join(dir, name+".so")
	require.NoError(t, os.WriteFile(c, []byte(src), 0o644))
	out, err := exec.Command(cc, "-shared", "-fPIC", "-o", so, c).CombinedOutput()
	require.NoError(t, err, "%s", out)
	return so
}

func TestNoLibrary(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "libnccl.so.2")
	_, err := openFirst([]string{"libnccl-that-does-not-exist.so.2", missing, "$" + EnvLibrary + " (not set)"})
	require.ErrorIs(t, err, ErrNoNCCL)
	require.ErrorContains(t, err, "libnccl-that-does-not-exist.so.2")
	require.ErrorContains(t, err, missing)
	require.ErrorContains(t, err, EnvLibrary)

	notNCCL := fakeLibrary(t, "libother", "int something(void) { return 1; }\n")
	_, err = OpenLibrary(notNCCL)
	require.ErrorIs(t, err, ErrNoNCCL)
	require.ErrorContains(t, err, "not an NCCL library")
}

func TestLibraryTooOld(t *testing.T) {
	old := fakeLibrary(t, "libnccl212", "int ncclGetVersion(int *v) { *v = 21200; return 0; }\n")
	_, err := OpenLibrary(old)
	require.ErrorIs(t, err, ErrNotSupported)
	require.ErrorContains(t, err, "2.14.0")
	require.ErrorContains(t, err, "2.12.0")
	var ve *VersionError
	require.True(t, errors.As(err, &ve))

	// A library too old among the candidates is skipped for a newer one after it.
	newer := fakeLibrary(t, "libnccl226", "int ncclGetVersion(int *v) { *v = 22600; return 0; }\n")
	lib, err := openFirst([]string{old, newer})
	require.NoError(t, err)
	require.Equal(t, 22600, lib.Version())
}

// TestMissingSymbols: a library with only some entry points loads; each missing one fails only its
// own call, with the minimum version in the error.
func TestMissingSymbols(t *testing.T) {
	path := fakeLibrary(t, "libnccl226", `
#include <string.h>
int ncclGetVersion(int *v) { *v = 22600; return 0; }
const char *ncclGetErrorString(int r) { return "fake error text"; }
int ncclGetUniqueId(char *id) { memset(id, 7, 128); return 0; }
int ncclCommRegister(void *c, void *p, unsigned long n, void **h) { return 5; }
`)
	api, err := OpenLibrary(path)
	require.NoError(t, err)
	id, err := api.GetUniqueID()
	require.NoError(t, err)
	require.Equal(t, byte(7), id[127])
	require.Equal(t, "fake error text", api.GetErrorString(InvalidUsage))

	_, err = api.CommWindowRegister(1, 0x1000, 4096, 0)
	require.ErrorIs(t, err, ErrNotSupported)
	require.ErrorContains(t, err, "ncclCommWindowRegister needs NCCL 2.27.0")
	require.ErrorContains(t, err, "2.26.0")

	err = api.CommDeregister(1, 1)
	require.ErrorIs(t, err, ErrNotSupported)
	require.ErrorContains(t, err, "does not export it")

	_, err = api.CommRegister(1, 0x1000, 4096)
	var ce *CallError
	require.True(t, errors.As(err, &ce), "%v", err)
	require.Equal(t, "ncclCommRegister", ce.Call)
	require.ErrorIs(t, err, ErrInvalidValue, "ncclInvalidUsage")
}

func TestResultErrors(t *testing.T) {
	require.ErrorIs(t, InvalidArgument, ErrInvalidValue)
	require.ErrorIs(t, RemoteError, ErrRemote)
	require.ErrorIs(t, InProgress, ErrInProgress)
	require.ErrorIs(t, UnhandledCudaError, ErrCUDA)
	require.NoError(t, Check(0))
	require.Equal(t, "ncclRemoteError", RemoteError.Name())
	require.Contains(t, Result(99).Error(), "ncclResult(99)")
	require.Equal(t, "2.28.9", FormatVersion(22809))
	require.Equal(t, "2.8.4", FormatVersion(2804))
}
