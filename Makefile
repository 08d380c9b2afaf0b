SHELL := /bin/bash
# Thin wrapper over CMake/CTest. `make check` is what CI runs (.ci/run).
#   make demo | deps | build | check | test-quick | check SAN=address,undefined | check SAN=thread | format | bench |
#        faults | soak | fuzz | image-check | clean
SAN ?=
JOBS ?= $(shell nproc)
ifeq ($(SAN),)
BUILD_DIR ?= build
else
BUILD_DIR ?= build-$(subst $(comma),-,$(SAN))
endif
comma := ,
CMAKE_FLAGS ?=
CTEST_ARGS ?=
FORMAT_FILES = $(shell git ls-files --cached --others --exclude-standard '*.c' '*.h' '*.cu' '*.cuh' 2>/dev/null)

.PHONY: all deps build check test test-quick demo format format-check bench faults soak fuzz image-check clean

all: build

deps:
	tools/install-deps.sh

$(BUILD_DIR)/CMakeCache.txt:
	cmake -S . -B $(BUILD_DIR) -DSAN=$(SAN) $(CMAKE_FLAGS)

build: $(BUILD_DIR)/CMakeCache.txt
	cmake --build $(BUILD_DIR) -j $(JOBS)

# deps + format check + build + every test; prints each Check suite's summary line and CTest's.
check: deps format-check build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) $(CTEST_ARGS) 2>&1 | tee ctest.log; \
	  rc=$${PIPESTATUS[0]}; grep -h '^[0-9]*%: Checks' Testing/Temporary/LastTest.log || true; exit $$rc

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) $(CTEST_ARGS)

# the quick tier: unit suites and fuzz replays (CTest label quick), under a minute on 2 cores
test-quick: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) -L quick $(CTEST_ARGS)

format:
	clang-format -i $(FORMAT_FILES)

format-check:
	@out=$$(clang-format --dry-run $(FORMAT_FILES) 2>&1); \
	if [ -n "$$out" ]; then echo "$$out" | grep 'warning:' | head -20; \
	  echo "format-check: files above are not clang-formatted; run 'make format'"; exit 1; fi; \
	echo "format-check: $(words $(FORMAT_FILES)) files clean"

bench: build
	tools/run-bench.sh $(BUILD_DIR)

# every fault × transfer mode × pipe under load (tests/faults/run_faults.py; a short subset is in `make check`),
# then again with kv-aware routing and local prefills under 48 tokens; then migration (decodes killed,
# restarted one by one and drained, a prefill drained: tests/faults/run_migration.py) on every pipe, and at
# the issue's long shapes with --batch-invariant nodes, where every answer must equal pd-serve's exactly
faults: build
	python3 tests/faults/run_migration.py $(BUILD_DIR)/bin
	python3 tests/faults/run_migration.py $(BUILD_DIR)/bin --long --modes pull:tcp,push:ucx --rounds 1 --node-args=--batch-invariant
	python3 tests/faults/run_faults.py $(BUILD_DIR)/bin $(FAULTS_ARGS)
	python3 tests/faults/run_faults.py $(BUILD_DIR)/bin --conditional 48 $(FAULTS_ARGS)
	python3 tests/faults/run_faults.py $(BUILD_DIR)/bin --p2p $(FAULTS_ARGS)

# 1 prefill + 1 decode + proxy just under saturation for SOAK_SECONDS, hostile connections on the side
# (tests/faults/run_soak.py; a 20 s form is in `make check`)
SOAK_SECONDS ?= 600
soak: build
	python3 tests/faults/run_soak.py $(BUILD_DIR)/bin --seconds $(SOAK_SECONDS) $(SOAK_ARGS)

# deploy/Dockerfile built without a container engine: each stage in a debootstrapped Debian 12
# root (chroot + unshare), the build stage's tests, the runtime stage serving (tools/image_check.py;
# root, ~15 min)
image-check:
	python3 tools/image_check.py $(IMAGE_CHECK_ARGS)

# libFuzzer search over every tests/fuzz target, FUZZ_SECONDS each (their corpora replay in `make check`)
FUZZ_SECONDS ?= 60
fuzz: deps
	FUZZ_TARGETS="$(FUZZ_TARGETS)" tools/run-fuzz.sh $(FUZZ_SECONDS)

# deps + build, then 1 prefill + 1 decode + proxy on loopback under pd-bench load (~30 s)
demo: deps
	$(MAKE) build
	tools/demo.sh $(BUILD_DIR)

clean:
	rm -rf build build-*
