# cuvmm: the two set-up commands are `make demo` and `make test`.
GO       ?= go
BUNDLE   ?= build/gpu
NVCC     ?= nvcc

.PHONY: all test vet leakcheck eager demo build gpu-bundle bench fuzz ptx clean

all: test

## test: go vet, then every package's tests with the race detector (the simulator runs them all;
## real-driver subtests skip with a reason when there is no GPU), then every fuzz target briefly.
test: vet
	$(GO) test -race -count=1 ./...
	$(MAKE) leakcheck
	$(MAKE) eager
	$(MAKE) fuzz FUZZTIME=$(FUZZTIME_CI)

## leakcheck: the owning packages' tests built with the cuvmmleak tag, which reports every object
## that became unreachable without Close (with the stack that made it) and fails the run.
leakcheck:
	$(GO) test -tags cuvmmleak -count=1 ./internal/lifetime/ ./vmm/... ./growbuf/... ./stripe/... ./pinned/... \
		./ipc/... ./offload/... ./pool/... ./nccl/...

## eager: the library's packages again with the simulator moving queued work's data before the
## queuing call returns (CUVMM_SIM_DEFER=0), where every other run moves it only when its stream is
## synchronized with, as a GPU does: the code must be right either way.
eager:
	CUVMM_SIM_DEFER=0 $(GO) test -count=1 ./vmm/... ./growbuf/... ./stripe/... ./pinned/... ./ipc/... \
		./offload/... ./pool/... ./nccl/... ./measure/...

vet:
	$(GO) vet ./...

## demo: the tour of vmmdemo subcommands, on the real GPU or else the simulator.
demo:
	$(GO) run ./cmd/vmmdemo tour

build:
	$(GO) build -o build/vmmdemo ./cmd/vmmdemo

## gpu-bundle: test binaries, vmmdemo and run.sh in $(BUNDLE), for a GPU host without Go.
gpu-bundle:
	GO="$(GO)" scripts/gpu-bundle.sh "$(BUNDLE)"

## bench: Go benchmarks (each reports a ratio against a baseline measured in the same run).
bench:
	$(GO) test -run '^$$' -bench . -benchmem ./...

## fuzz: a run of FUZZTIME (default 20s) of each fuzz target; `make test` runs each for
## FUZZTIME_CI (5000 inputs, a few seconds) after the tests, which also run the seed corpora. The
## short run counts inputs rather than time: with a time budget, Go 1.26's fuzz coordinator can
## report "context deadline exceeded" as a failure when the budget ends mid-input (Go issue 75804).
FUZZTIME    ?= 20s
FUZZTIME_CI ?= 5000x
fuzz:
	@grep -rl --include='*_test.go' '^func Fuzz' . | xargs -n1 dirname | sort -u | while read -r dir; do \
	  for f in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$dir/*_test.go | cut -c6-); do \
	    echo "fuzz $$dir $$f ($(FUZZTIME))"; \
	    log=$$(mktemp); \
	    $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) $$dir > $$log 2>&1 \
	      || { cat $$log; rm -f $$log; exit 1; }; \
	    rm -f $$log; \
	  done || exit 1; \
	done

## ptx: regenerate the embedded kernels from their CUDA C source (needs nvcc).
ptx:
	$(NVCC) -ptx -arch=compute_75 -O3 internal/kernels/kernels.cu -o internal/kernels/kernels.ptx

clean:
	rm -rf build
