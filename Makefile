# Every target does its own set-up on a fresh machine (virtual environment, system packages,
# build), and a second run rebuilds only what changed.
#
#   make test   build, then run the C++ tests (ctest) and the Python tests (pytest)
#   make demo   build, then train a small GPT on 8 ranks (tensor 2 x pipeline 2 x data 2) under
#               torchrun, compare it with a one-process run, print a sample of its text and
#               draw its loss curve and pipeline timeline into demo/
#   make build  just build (libtorch_mp, torch_mp/_C, C++ tests and examples) into build/
#   make fuzz   fuzz the readers of files from elsewhere (JSON, safetensors headers, a
#               checkpoint's index) with libFuzzer, ASan and UBSan for FUZZ_SECONDS each, at once

VENV       ?= .venv
BUILD      ?= build
PYTHON     := $(VENV)/bin/python
MAX_JOBS   ?= 2
DEMO_STEPS ?= 70
# No GPU here: name an architecture so that CUDA builds of torch need not detect one.
export TORCH_CUDA_ARCH_LIST ?= 9.0
export OMP_NUM_THREADS ?= 1
unexport PYTHONDONTWRITEBYTECODE
# On CI every build is a fresh clone with an empty cache: ccache could only add its hashing and
# preprocessing (~10 s per compiler run here, 25 % of a fresh build), so it steps aside there.
ifdef CI
export CCACHE_DISABLE := 1
endif

SYSTEM_PACKAGES := libgtest-dev libgloo-dev ccache nlohmann-json3-dev

.PHONY: all build test test-cpp test-python demo fuzz system-packages clean

all: build

# ---- set-up -----------------------------------------------------------------------------------

# --no-compile: byte-compiling every module of torch and transformers at install takes longer
# than the install itself (82 s against 49 s for torch here); Python compiles, once, only the
# modules that are imported, provided that it may write its caches: the tests start ~150 Python
# processes, and each would otherwise compile what it imports from source (6 s to import torch
# instead of 3 s).
$(VENV)/.installed: requirements-dev.txt
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet --no-compile -r requirements-dev.txt
	touch $@

# GoogleTest, the Gloo headers (for creating Gloo groups from C++), ccache and nlohmann/json (the
# parser of checkpoint files' JSON), from Debian's packages when we are root and they are missing.
system-packages:
	@if dpkg -s $(SYSTEM_PACKAGES) >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing $(SYSTEM_PACKAGES)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null; \
	else \
	  echo "warning: please install $(SYSTEM_PACKAGES) (the C++ tests need GoogleTest, C++ init needs the Gloo headers)"; \
	fi

$(BUILD)/build.ninja: $(VENV)/.installed | system-packages
	$(VENV)/bin/cmake -S . -B $(BUILD) -G Ninja \
	  -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) \
	  -DPython3_EXECUTABLE=$(abspath $(PYTHON)) \
	  -DCMAKE_PREFIX_PATH="$$($(PYTHON) -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"

build: $(BUILD)/build.ninja
	$(VENV)/bin/cmake --build $(BUILD) -j $(MAX_JOBS)
	@$(MAKE) --no-print-directory $(VENV)/.editable

# torch_mp installed into the environment, editable: the package is this checkout (its _C the
# one just built), so `import torch_mp` and `torchrun script.py` work from any directory.
$(VENV)/.editable: setup.py
	PATH="$(abspath $(VENV))/bin:$$PATH" TORCH_MP_BUILD_DIR=$(BUILD) \
	  $(PYTHON) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

# ---- tests and demo ---------------------------------------------------------------------------

test-cpp: build
	cd $(BUILD) && $(abspath $(VENV))/bin/ctest --output-on-failure

test-python: build
	$(PYTHON) -m pytest

test: test-cpp test-python

# Writes the loss curve and the last step's pipeline timeline into demo/.
demo: build
	$(VENV)/bin/torchrun --standalone --nproc-per-node=8 \
	  examples/python/gpt_3d.py --tp 2 --pp 2 --dp 2 --schedule 1f1b --steps $(DEMO_STEPS) --check \
	  --plot demo/loss.png --trace demo/timeline.png

# ---- fuzzing ----------------------------------------------------------------------------------

# The readers' fuzzers (tests/fuzz) are built with clang apart from the main build. Each runs for
# FUZZ_SECONDS (all at once, a core each as far as they go), growing a corpus of its own under
# $(FUZZ_BUILD)/corpus from the seeds in tests/fuzz/corpus/<target>; an input that crashes one is
# written into tests/fuzz/corpus/<target> (crash-*), where the C++ tests replay it on every
# `make test` once it is committed. The last lines of each log give executions and coverage.
FUZZ_SECONDS ?= 600
FUZZ_BUILD   := $(BUILD)/fuzz
FUZZ_TARGETS := json safetensors_header index
FUZZ_PACKAGES := clang libclang-rt-14-dev nlohmann-json3-dev

fuzz: $(VENV)/.installed
	@dpkg -s $(FUZZ_PACKAGES) >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(FUZZ_PACKAGES) >/dev/null; }
	CXX=clang++ $(VENV)/bin/cmake -S tests/fuzz -B $(FUZZ_BUILD) -G Ninja \
	  -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DTORCH_DIR="$$($(PYTHON) -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
	$(VENV)/bin/cmake --build $(FUZZ_BUILD) -j $(MAX_JOBS)
	@pids=; for target in $(FUZZ_TARGETS); do \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$target; \
	  $(FUZZ_BUILD)/$${target}_fuzzer $(FUZZ_BUILD)/corpus/$$target tests/fuzz/corpus/$$target \
	    -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
	    -print_final_stats=1 -artifact_prefix=tests/fuzz/corpus/$$target/ \
	    > $(FUZZ_BUILD)/$$target.log 2>&1 & pids="$$pids $$!"; \
	done; failed=0; for pid in $$pids; do wait $$pid || failed=1; done; \
	for target in $(FUZZ_TARGETS); do \
	  echo "== $$target: $$(grep -E '^#[0-9]+[[:space:]]+DONE' $(FUZZ_BUILD)/$$target.log | tail -1)"; \
	  grep -E '^stat::number_of_executed_units|^stat::peak_rss_mb' $(FUZZ_BUILD)/$$target.log; \
	done; \
	if [ $$failed != 0 ]; then echo "a fuzzer found a crash: see $(FUZZ_BUILD)/*.log"; exit 1; fi

clean:
	rm -rf $(BUILD) torch_mp/_C*.so
