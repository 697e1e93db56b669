package driver

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
)

func requireGPU() bool { return os.Getenv("CUVMM_REQUIRE_GPU") == "1" }

func containsAll(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// withBuiltinText makes Result use the built-in table for the duration of a test, whatever library
// another test loaded.
func withBuiltinText(t *testing.T) {
	saved := loadedErrorText
	loadedErrorText = func(Result) (string, string, bool) { return "", "", false }
	t.Cleanup(func() { loadedErrorText = saved })
}

func TestResultText(t *testing.T) {
	withBuiltinText(t)
	for _, tc := range []struct {
		r          Result
		name, desc string
	}{
		{ErrorInvalidValue, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
		{ErrorOutOfMemory, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
		{ErrorStubLibrary, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
		{ErrorNotSupported, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
		{ErrorHostMemoryNotRegistered, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
		{Result(4242), "CUDA_ERROR_4242", "unknown CUresult"},
	} {
		if got := tc.r.Name(); got != tc.name {
			t.Errorf("Result(%d).Name() = %q, want %q", int32(tc.r), got, tc.name)
		}
		if got := tc.r.Description(); got != tc.desc {
			t.Errorf("Result(%d).Description() = %q, want %q", int32(tc.r), got, tc.desc)
		}
		if got, want := tc.r.Error(), tc.name+": "+tc.desc; got != want {
			t.Errorf("Result(%d).Error() = %q, want %q", int32(tc.r), got, want)
		}
	}
	for r, e := range builtinResults {
		if !strings.HasPrefix(e.name, "CUDA_") || e.desc == "" {
			t.Errorf("built-in text for %d: %+v", int32(r), e)
		}
	}
}

func TestResultIs(t *testing.T) {
	for _, tc := range []struct {
		code     int32
		sentinel error
	}{
		{1, ErrInvalidValue},
		{2, ErrOutOfMemory},
		{3, ErrNotInitialized},
		{4, ErrNotInitialized},
		{34, ErrNoDriver},
		{100, ErrNoDevice},
		{101, ErrNoDevice},
		{201, ErrInvalidContext},
		{217, ErrNotSupported},
		{400, ErrInvalidHandle},
		{700, ErrIllegalAddress},
		{800, ErrNotPermitted},
		{801, ErrNotSupported},
		{803, ErrNoDriver},
	} {
		err := Check(tc.code)
		if !errors.Is(err, tc.sentinel) {
			t.Errorf("Check(%d) = %v does not match %v", tc.code, err, tc.sentinel)
		}
		wrapped := fmt.Errorf("vmm: map 64 MiB at offset 0x200000: %w", err)
		if !errors.Is(wrapped, tc.sentinel) {
			t.Errorf("wrapped Check(%d) does not match %v", tc.code, tc.sentinel)
		}
		var r Result
		if !errors.As(wrapped, &r) || int32(r) != tc.code {
			t.Errorf("errors.As(wrapped %d) gave %d", tc.code, int32(r))
		}
	}
	// A Result matches only its own family.
	if errors.Is(Check(2), ErrInvalidValue) || errors.Is(Check(1), ErrOutOfMemory) || errors.Is(Check(999), ErrNotSupported) {
		t.Error("a Result matched another family's sentinel")
	}
}

func TestCheckSuccessIsNil(t *testing.T) {
	if err := Check(0); err != nil {
		t.Fatalf("Check(0) = %#v, want a nil error", err)
	}
	if err := result0(); err != nil {
		t.Fatalf("a successful call returned %#v", err)
	}
}

// result0 mimics what every method does with a zero code.
func result0() error { return Check(int32(Success)) }

func TestSymbolError(t *testing.T) {
	err := error(&SymbolError{Symbol: "cuMemGetHandleForAddressRange", Since: "11.7"})
	if !errors.Is(err, ErrNotSupported) {
		t.Error("a SymbolError must match ErrNotSupported")
	}
	if !containsAll(err.Error(), "cuMemGetHandleForAddressRange", "11.7", "not supported") {
		t.Errorf("SymbolError text %q", err)
	}
	for _, s := range symbols {
		if s.name == "" || s.since == "" {
			t.Errorf("symbol table entry %+v is incomplete", s)
		}
	}
}
