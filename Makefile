# Every target does its own set-up on a fresh machine (virtual environment, system packages,
# build), and a second run rebuilds only what changed.
#
#   make test   build, then run the C++ tests (ctest) and the Python tests (pytest)
#   make demo   build, then train a small GPT on 8 ranks (tensor 2 x pipeline 2 x data 2) under
#               torchrun, compare it with a one-process run, print a sample of its text and
#               draw its loss curve and pipeline timeline into demo/
#   make build  just build (libtorch_mp, torch_mp/_C, C++ tests and examples) into build/

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

SYSTEM_PACKAGES := libgtest-dev libgloo-dev ccache

.PHONY: all build test test-cpp test-python demo system-packages clean

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

# GoogleTest, the Gloo headers (for creating Gloo groups from C++) and ccache, from Debian's
# packages when we are root and they are missing.
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

clean:
	rm -rf $(BUILD) torch_mp/_C*.so
