#!/usr/bin/env bash
# The device check of the GPU issue, in one run (about 15 minutes on one H200, the build
# included). On a machine with a GPU it
#   1. builds torch_mp against the torch installed there (any 2.11+ with CUDA; no pip needed),
#   2. runs the CUDA tests: the fused cross-entropy kernels against the CPU path (pytest, when
#      installed), C++ NCCL groups (GoogleTest, when installed), and benchmarks/gpu/checks.py:
#      NCCL at world size 1 (and 2 on one GPU where NCCL allows it) with the tensor-parallel
#      layers exact against the dense ones,
#   3. prints the table: a GPT block (forward + backward, bf16) through torch_mp at tp = 1
#      against plain PyTorch, the fused cross-entropy against F.cross_entropy, TFLOP/s.
# Without a GPU it does what a CPU allows: the build (CUDA sources compiled when nvcc is there)
# and the same steps, each saying why it skips.
#
#   bash benchmarks/gpu/check.sh                  # from the repository root
#   PYTHON=python3.12 BUILD=build-gpu bash benchmarks/gpu/check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
BUILD=${BUILD:-build-gpu}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
JOBS=${MAX_JOBS:-$(nproc)}
status=0
step() { printf '\n==== %s (%s)\n' "$1" "$(date +%T)"; }

step "environment"
"$PYTHON" - <<'PY'
import torch, sys
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"devices {torch.cuda.device_count()}"
      + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
PY
command -v nvidia-smi >/dev/null && nvidia-smi -L

step "build against this torch"
if [ ! -f "$BUILD/build.ninja" ]; then
  generator=$(command -v ninja >/dev/null && echo "-G Ninja" || echo "")
  cmake -S . -B "$BUILD" $generator -DCMAKE_BUILD_TYPE=Release \
    -DPython3_EXECUTABLE="$(command -v "$PYTHON")" \
    -DCMAKE_PREFIX_PATH="$("$PYTHON" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')" \
    -DTORCH_MP_BUILD_EXAMPLES=OFF || exit 1
fi
cmake --build "$BUILD" -j "$JOBS" || exit 1
"$PYTHON" -c "from torch_mp import _C; print('fused CUDA kernels built:', _C.has_fused_cuda_kernels())"

step "C++: NCCL groups"
if [ -x "$BUILD/tests/cpp/torch_mp_tests" ]; then
  "$BUILD/tests/cpp/torch_mp_tests" --gtest_filter='NcclGroup*' || status=1
else
  echo "skipped: GoogleTest is not installed here, so the C++ tests were not built"
fi

step "Python: fused kernels against the CPU path"
if "$PYTHON" -c "import pytest" 2>/dev/null; then
  "$PYTHON" -m pytest -q -p no:cacheprovider tests/python/test_cuda_kernels.py || status=1
else
  echo "skipped: pytest is not installed here (checks.py covers the kernels at world size 1)"
fi

step "NCCL, exactness and the table"
"$PYTHON" benchmarks/gpu/checks.py || status=1
if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/gpu/checks.py \
    --nccl-only || echo "NCCL at 2 ranks on one GPU: refused here (see above); world size 1 only"
fi
exit $status
