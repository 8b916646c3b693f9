#!/usr/bin/env bash
# The device check of the GPU issue, in one run (meant to finish in under 8 minutes on one H200
# with 16 cores, the build included, so that a failed first run leaves time for a second). It
#   1. builds only libtorch_mp, the Python extension and benchmarks/gpu/nccl_group (no tests, no
#      examples) against the torch installed there (any 2.11+ with CUDA), with every core,
#   2. runs the C++ NCCL group from a small LibTorch program (nccl_group: an all-reduce and a
#      pipeline step, exact against one process),
#   3. runs benchmarks/gpu/checks.py over NCCL at world size 1, then 2 on the one GPU where NCCL
#      allows it: the tensor-parallel MLP and transformer layer, the pipeline (every schedule),
#      context-parallel attention (every method), the MoE layer, each exact against one process,
#      and at world size 1 the fused cross-entropy kernels against the CPU path and the table
#      (a GPT block in bf16 against PyTorch's, with TFLOP/s and MFU; the fused cross-entropy
#      against F.cross_entropy, time and peak memory).
# Without a GPU it does what a CPU allows: the build (CUDA sources compiled when nvcc is there),
# then the same exactness checks over Gloo under NCCL's rules (TORCH_MP_CHECK_COLLECTIVES=1) at
# world sizes 1 and 2, each step saying what it skips.
#
# With $OUT set (the device machine sets it), the log goes to $OUT/check.log and the table to
# $OUT/table.md as well.
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
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  exec > >(tee "$OUT/check.log") 2>&1
fi
started=$(date +%s)
status=0
step() { printf '\n==== %s (%s, %ss in)\n' "$1" "$(date +%T)" "$(($(date +%s) - started))"; }
has_gpu() { "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; }

step "environment"
"$PYTHON" - <<'PY'
import torch, sys
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"devices {torch.cuda.device_count()}"
      + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
PY
command -v nvidia-smi >/dev/null && nvidia-smi -L

step "build libtorch_mp, the extension and nccl_group against this torch ($JOBS jobs)"
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  generator=$(command -v ninja >/dev/null && echo "-G Ninja" || echo "")
  launcher=$(command -v ccache >/dev/null && echo "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache" || echo "")
  cmake -S . -B "$BUILD" $generator $launcher -DCMAKE_BUILD_TYPE=Release \
    -DPython3_EXECUTABLE="$(command -v "$PYTHON")" \
    -DCMAKE_PREFIX_PATH="$("$PYTHON" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')" \
    -DTORCH_MP_BUILD_TESTS=OFF -DTORCH_MP_BUILD_EXAMPLES=OFF -DTORCH_MP_BUILD_GPU_CHECK=ON \
    || exit 1
fi
cmake --build "$BUILD" -j "$JOBS" || exit 1
"$PYTHON" -c "from torch_mp import _C; print('fused CUDA kernels built:', _C.has_fused_cuda_kernels())"

step "C++: an NCCL group from a small LibTorch program"
"$BUILD/benchmarks/gpu/nccl_group" || status=1

if has_gpu; then
  step "NCCL at world size 1: exactness, the fused kernels and the table"
  "$PYTHON" benchmarks/gpu/checks.py ${OUT:+--out "$OUT"} || status=1
  step "NCCL at world size 2 on the one GPU"
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/gpu/checks.py \
    --nccl-only || echo "NCCL at 2 ranks on one GPU: refused here (see above); world size 1 only"
else
  step "no GPU: the exactness checks over Gloo under NCCL's rules"
  echo "skipped: the NCCL runs, the fused CUDA kernels and the table (they need a GPU)"
  export TORCH_MP_CHECK_COLLECTIVES=1
  "$PYTHON" benchmarks/gpu/checks.py --cpu || status=1
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/gpu/checks.py \
    --cpu --nccl-only || status=1
fi
step "done: status $status"
exit $status
