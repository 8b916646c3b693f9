// Fused kernels of vocab_parallel_cross_entropy: one pass over the logit shard for the forward
// sums, one in-place pass that turns the saved exp values into the gradient.
//
// A block handles one row at a time (grid-stride over rows); its threads stride over the row's
// columns in 16-byte vectors, with scalar steps before the first 16-byte boundary of the row and
// after its last whole vector (rows of odd length start anywhere):
//
//   columns  | head: scalar | whole 16-byte vectors ........................ | tail: scalar |
//   meaning  | real vocabulary (< real_columns) ............ | padding: exp 0, gradient 0 ...  |
//
// Sums are kept in float (double for double logits) and reduced over the block at the end.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "torch_mp/tensor_parallel/cross_entropy_cuda.h"

namespace torch_mp::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;
static_assert(kThreads % kWarpSize == 0 && kWarps <= kWarpSize,
              "block_sum reduces the per-warp sums with one warp");

/// kVec elements moved as one 16-byte (or, for kVec = 1, one-element) load or store.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Vector {
  T values[kVec];
};

/// Sums `value` over the 32 lanes of the calling warp; every lane gets the sum.
template <typename T>
__device__ T warp_sum(T value) {
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, mask);
  }
  return value;
}

/// Sums `value` over the block (kThreads threads, all of which must call it); every thread gets
/// the sum. `scratch` holds kWarps values and is free again when the call returns.
template <typename T>
__device__ T block_sum(T value, T* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  value = warp_sum(value);
  if (lane == 0) {
    scratch[warp] = value;
  }
  __syncthreads();
  value = lane < kWarps ? scratch[lane] : T(0);
  __syncthreads();
  return warp_sum(value);
}

/// Sets out[c] = op(c, in[c]) for the `columns` columns of one row, the block's threads sharing
/// the work. `in` and `out` may be the same row; with kVec > 1 they must lie at the same offset
/// from a 16-byte boundary.
template <int kVec, typename T, typename Op>
__device__ void transform_row(const T* in, T* out, int64_t columns, Op op) {
  const auto misalignment =
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(in) / sizeof(T) % kVec);
  const int64_t to_boundary = (kVec - misalignment) % kVec;
  const int64_t head = columns < to_boundary ? columns : to_boundary;
  for (int64_t c = threadIdx.x; c < head; c += kThreads) {
    out[c] = op(c, in[c]);
  }
  using Vec = Vector<T, kVec>;
  const int64_t vectors = (columns - head) / kVec;
  const auto* in_vectors = reinterpret_cast<const Vec*>(in + head);
  auto* out_vectors = reinterpret_cast<Vec*>(out + head);
  for (int64_t i = threadIdx.x; i < vectors; i += kThreads) {
    Vec vector = in_vectors[i];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      vector.values[k] = op(head + i * kVec + k, vector.values[k]);
    }
    out_vectors[i] = vector;
  }
  for (int64_t c = head + vectors * kVec + threadIdx.x; c < columns; c += kThreads) {
    out[c] = op(c, in[c]);
  }
}

/// The target's column in the row, or -1; a target in the padding is a caller's bug.
__device__ int64_t checked_target(const int64_t* target_local, int64_t row, int64_t real_columns) {
  const int64_t target = target_local[row];
  CUDA_KERNEL_ASSERT(target >= -1 && target < real_columns);
  return target;
}

/// Writes exp(z - max) (0 on padding) and the row's [sum exp, target's z - max, sum (z - max)].
template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads) forward_kernel(const scalar_t* __restrict__ logits,
                                                           const float* __restrict__ row_max,
                                                           const int64_t* __restrict__ target_local,
                                                           int64_t rows,
                                                           int64_t columns,
                                                           int64_t real_columns,
                                                           scalar_t* __restrict__ exp_logits,
                                                           float* __restrict__ stats) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t scratch[kWarps];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const scalar_t* row_logits = logits + row * columns;
    const acc_t max = row_max[row];
    acc_t sum_exp = 0;
    acc_t sum_shifted = 0;
    transform_row<kVec>(
        row_logits, exp_logits + row * columns, columns, [&](int64_t c, scalar_t z) -> scalar_t {
          if (c >= real_columns) {
            return static_cast<scalar_t>(0);
          }
          const acc_t shifted = static_cast<acc_t>(z) - max;
          const acc_t exp = std::exp(shifted);
          sum_exp += exp;
          sum_shifted += shifted;
          return static_cast<scalar_t>(exp);
        });
    sum_exp = block_sum(sum_exp, scratch);
    sum_shifted = block_sum(sum_shifted, scratch);
    if (threadIdx.x == 0) {
      const int64_t target = checked_target(target_local, row, real_columns);
      float* row_stats = stats + row * 3;
      row_stats[0] = static_cast<float>(sum_exp);
      row_stats[1] =
          target >= 0 ? static_cast<float>(static_cast<acc_t>(row_logits[target]) - max) : 0.0f;
      row_stats[2] = static_cast<float>(sum_shifted);
    }
  }
}

/// Turns the exp values into the gradient in place (formula in cross_entropy.h).
template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(scalar_t* exp_logits,
                    const float* __restrict__ sum_exp,
                    const int64_t* __restrict__ target_local,
                    const float* __restrict__ row_scale,
                    at::opmath_type<scalar_t> target_weight,
                    at::opmath_type<scalar_t> uniform_weight,
                    int64_t rows,
                    int64_t columns,
                    int64_t real_columns) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    scalar_t* row_values = exp_logits + row * columns;
    const acc_t inverse_sum = acc_t(1) / static_cast<acc_t>(sum_exp[row]);
    const acc_t scale = row_scale[row];
    const int64_t target = checked_target(target_local, row, real_columns);
    transform_row<kVec>(row_values, row_values, columns, [&](int64_t c, scalar_t exp) -> scalar_t {
      // Ignored rows get exact zeros, whatever their (possibly overflowed) softmax holds.
      if (c >= real_columns || scale == acc_t(0)) {
        return static_cast<scalar_t>(0);
      }
      acc_t gradient = static_cast<acc_t>(exp) * inverse_sum - uniform_weight;
      if (c == target) {
        gradient -= target_weight;
      }
      return static_cast<scalar_t>(gradient * scale);
    });
  }
}

/// Enough blocks to fill the current device once, but no more than there are rows.
unsigned int block_count(int64_t rows) {
  const int device = c10::cuda::current_device();
  int processors = 0;
  int threads_per_processor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&processors, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(
      &threads_per_processor, cudaDevAttrMaxThreadsPerMultiProcessor, device));
  const int64_t resident =
      static_cast<int64_t>(processors) * std::max(1, threads_per_processor / kThreads);
  return static_cast<unsigned int>(std::min(rows, resident));
}

/// Whether rows of `a` and `b` (same shape, contiguous) can be walked with the same 16-byte
/// vectors: their starts lie at the same offset from a 16-byte boundary.
bool same_alignment(const void* a, const void* b) {
  return reinterpret_cast<uintptr_t>(a) % 16 == reinterpret_cast<uintptr_t>(b) % 16;
}

/// Checks that `tensor` is a CUDA tensor on `device` of shape [rows] and type `dtype`.
void check_row_vector(const char* function,
                      const char* name,
                      const at::Tensor& tensor,
                      c10::Device device,
                      int64_t rows,
                      at::ScalarType dtype) {
  TORCH_CHECK(tensor.device() == device,
              function,
              ": ",
              name,
              " must be on the logits' device ",
              device,
              ", got ",
              tensor.device());
  TORCH_CHECK(tensor.dim() == 1 && tensor.size(0) == rows,
              function,
              ": ",
              name,
              " must have shape [",
              rows,
              "] (one entry per row), got ",
              tensor.sizes());
  TORCH_CHECK(tensor.scalar_type() == dtype,
              function,
              ": ",
              name,
              " must be ",
              dtype,
              ", got ",
              tensor.scalar_type());
}

/// Checks a logit-shaped tensor [N, V_local] and `real_columns` in [0, V_local].
void check_shard(const char* function,
                 const char* name,
                 const at::Tensor& tensor,
                 int64_t real_columns) {
  TORCH_CHECK(
      tensor.is_cuda(), function, ": ", name, " must be a CUDA tensor, got ", tensor.device());
  TORCH_CHECK(tensor.dim() == 2,
              function,
              ": ",
              name,
              " must have shape [N, V_local], got ",
              tensor.sizes());
  TORCH_CHECK(real_columns >= 0 && real_columns <= tensor.size(1),
              function,
              ": real_columns (",
              real_columns,
              ") must be in [0, ",
              tensor.size(1),
              "] (the shard's width)");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> vocab_cross_entropy_forward(const at::Tensor& logits,
                                                               const at::Tensor& row_max,
                                                               const at::Tensor& target_local,
                                                               int64_t real_columns) {
  constexpr const char* kFunction = "vocab_cross_entropy_forward";
  check_shard(kFunction, "logits", logits, real_columns);
  const int64_t rows = logits.size(0);
  const int64_t columns = logits.size(1);
  check_row_vector(kFunction, "row_max", row_max, logits.device(), rows, at::kFloat);
  check_row_vector(kFunction, "target_local", target_local, logits.device(), rows, at::kLong);

  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor input = logits.contiguous();
  const at::Tensor max = row_max.contiguous();
  const at::Tensor target = target_local.contiguous();
  at::Tensor exp_logits = at::empty_like(input, at::MemoryFormat::Contiguous);
  at::Tensor stats = at::empty({rows, 3}, input.options().dtype(at::kFloat));
  if (rows == 0) {
    return {exp_logits, stats};
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), kFunction, [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const auto kernel = same_alignment(input.const_data_ptr(), exp_logits.const_data_ptr())
                            ? forward_kernel<scalar_t, kVec>
                            : forward_kernel<scalar_t, 1>;
    kernel<<<block_count(rows), kThreads, 0, stream>>>(input.const_data_ptr<scalar_t>(),
                                                       max.const_data_ptr<float>(),
                                                       target.const_data_ptr<int64_t>(),
                                                       rows,
                                                       columns,
                                                       real_columns,
                                                       exp_logits.mutable_data_ptr<scalar_t>(),
                                                       stats.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {exp_logits, stats};
}

void vocab_cross_entropy_backward_(at::Tensor& exp_logits,
                                   const at::Tensor& sum_exp,
                                   const at::Tensor& target_local,
                                   const at::Tensor& row_scale,
                                   double smoothing,
                                   int64_t vocab_size,
                                   int64_t real_columns) {
  constexpr const char* kFunction = "vocab_cross_entropy_backward_";
  check_shard(kFunction, "exp_logits", exp_logits, real_columns);
  TORCH_CHECK(exp_logits.is_contiguous(),
              kFunction,
              ": exp_logits is updated in place and must be contiguous");
  const int64_t rows = exp_logits.size(0);
  const int64_t columns = exp_logits.size(1);
  check_row_vector(kFunction, "sum_exp", sum_exp, exp_logits.device(), rows, at::kFloat);
  check_row_vector(kFunction, "target_local", target_local, exp_logits.device(), rows, at::kLong);
  check_row_vector(kFunction, "row_scale", row_scale, exp_logits.device(), rows, at::kFloat);
  TORCH_CHECK(smoothing >= 0.0 && smoothing <= 1.0,
              kFunction,
              ": smoothing must be in [0, 1], got ",
              smoothing);
  TORCH_CHECK(vocab_size > 0 && vocab_size >= real_columns,
              kFunction,
              ": vocab_size (",
              vocab_size,
              ") must be positive and at least real_columns (",
              real_columns,
              ")");
  if (rows == 0) {
    return;
  }

  const c10::cuda::CUDAGuard guard(exp_logits.device());
  const at::Tensor sums = sum_exp.contiguous();
  const at::Tensor target = target_local.contiguous();
  const at::Tensor scale = row_scale.contiguous();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, exp_logits.scalar_type(), kFunction, [&] {
        using acc_t = at::opmath_type<scalar_t>;
        backward_kernel<scalar_t, 16 / sizeof(scalar_t)>
            <<<block_count(rows), kThreads, 0, stream>>>(
                exp_logits.mutable_data_ptr<scalar_t>(),
                sums.const_data_ptr<float>(),
                target.const_data_ptr<int64_t>(),
                scale.const_data_ptr<float>(),
                static_cast<acc_t>(1.0 - smoothing),
                static_cast<acc_t>(smoothing / static_cast<double>(vocab_size)),
                rows,
                columns,
                real_columns);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

}  // namespace torch_mp::cuda
