#include "torch_mp/tensor_parallel/cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <limits>
#include <sstream>

#include "torch_mp/collectives.h"
#include "torch_mp/tensor_parallel/embedding.h"

#ifdef TORCH_MP_WITH_CUDA
#include "torch_mp/tensor_parallel/cross_entropy_cuda.h"
#endif

namespace torch_mp::tensor_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The two passes over the shard. Shapes and meanings as in
// csrc/torch_mp/tensor_parallel/cross_entropy_cuda.h: forward returns exp(z - max) (0 on padding)
// and per-row [sum exp, target logit - max, sum (z - max)]; backward turns the exp buffer into the
// gradient in place. The type sums are taken in: float for float, half and bfloat16 logits, double
// for double.
at::ScalarType accumulate_type(const at::Tensor& logits) {
  return at::toOpMathType(logits.scalar_type());
}

// Whether the fused CUDA kernels take this tensor (they accumulate in float).
bool fused(const at::Tensor& logits) {
#ifdef TORCH_MP_WITH_CUDA
  return logits.is_cuda() && accumulate_type(logits) == at::kFloat;
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor> forward_pass(const at::Tensor& logits,
                                                const at::Tensor& row_max,
                                                const at::Tensor& target_local,
                                                int64_t real_columns) {
#ifdef TORCH_MP_WITH_CUDA
  if (fused(logits)) {
    return cuda::vocab_cross_entropy_forward(logits, row_max, target_local, real_columns);
  }
#endif
  // One shard-sized buffer (for fp32): z - max, then exp(z - max) in place.
  auto shifted = logits.to(accumulate_type(logits)) - row_max.unsqueeze(1);
  const auto real = shifted.narrow(1, 0, real_columns);
  // (A shard may hold padding only: V = 5 over 4 ranks gives rank 3 no real entry.)
  const auto target_logit =
      real_columns == 0 ? at::zeros({logits.size(0)}, shifted.options())
                        : real.gather(1, target_local.clamp(0, real_columns - 1).unsqueeze(1))
                              .squeeze(1)
                              .masked_fill(target_local.lt(0), 0);
  const auto sum_shifted = real.sum(1);
  shifted.exp_();
  shifted.narrow(1, real_columns, shifted.size(1) - real_columns).zero_();
  const auto sum_exp = shifted.sum(1);
  return {shifted.to(logits.scalar_type()), at::stack({sum_exp, target_logit, sum_shifted}, 1)};
}

void backward_pass_(at::Tensor& exp_logits,
                    const at::Tensor& sum_exp,
                    const at::Tensor& target_local,
                    const at::Tensor& row_scale,
                    double smoothing,
                    int64_t vocab_size,
                    int64_t real_columns) {
#ifdef TORCH_MP_WITH_CUDA
  if (fused(exp_logits)) {
    cuda::vocab_cross_entropy_backward_(
        exp_logits, sum_exp, target_local, row_scale, smoothing, vocab_size, real_columns);
    return;
  }
#endif
  auto real = exp_logits.narrow(1, 0, real_columns);
  real.div_(sum_exp.unsqueeze(1));
  if (smoothing > 0) {
    real.sub_(smoothing / static_cast<double>(vocab_size));
  }
  const auto here = target_local.ge(0);
  const auto rows = at::arange(exp_logits.size(0), target_local.options()).masked_select(here);
  const auto columns = target_local.masked_select(here);
  exp_logits.index_put_({rows, columns},
                        at::scalar_tensor(-(1.0 - smoothing), exp_logits.options()),
                        /*accumulate=*/true);
  real.mul_(row_scale.unsqueeze(1));
}

// Raises on every rank, after the first all-reduce, when any rank's input was invalid (`problem`
// non-empty there) or the ranks disagree on the loss's settings: a check that failed on one rank
// alone would leave the others waiting in the collective. `agreed` holds, per setting, its
// maximum and the maximum of its negation over the group.
void raise_on_every_rank(const std::string& problem, const at::Tensor& agreed) {
  TORCH_CHECK(problem.empty(), problem);
  const auto values = agreed.to(at::kDouble).cpu();
  const auto* v = values.const_data_ptr<double>();
  TORCH_CHECK(v[0] == 0,
              "vocab_parallel_cross_entropy: another rank of the group was given invalid input "
              "(that rank raised the reason)");
  for (int64_t i = 1; i + 1 < values.numel(); i += 2) {
    TORCH_CHECK(v[i] == -v[i + 1],
                "vocab_parallel_cross_entropy: vocab_size, ignore_index, label_smoothing and "
                "reduction must be the same on every rank of the group, but ranks disagree");
  }
}

// Why `target` cannot be taken ("" if it can): ids outside [0, vocab_size) other than
// ignore_index. It reads the ids' values, so it runs inside the forward operator's kernel.
std::string target_problem(const at::Tensor& target, int64_t ignore_index, int64_t vocab_size) {
  const auto valid = target.ne(ignore_index);
  if (!valid.any().item<bool>()) {
    return "";
  }
  const auto [lowest, highest] = at::aminmax(target.masked_select(valid));
  if (lowest.item<int64_t>() >= 0 && highest.item<int64_t>() < vocab_size) {
    return "";
  }
  std::ostringstream problem;
  problem << "vocab_parallel_cross_entropy: target ids must be in [0, " << vocab_size
          << ") or ignore_index (" << ignore_index << "), got ids in [" << lowest.item<int64_t>()
          << ", " << highest.item<int64_t>() << "]";
  return problem.str();
}

// ---- the operators of the two passes ----------------------------------------------------------
// vocab_parallel_cross_entropy_forward(logits [N, V_local], target [N], ...) returns the per-row
// losses [N] (0 for ignored rows, in the accumulate type), exp(z - max) [N, V_local], the sum of
// exp per row [N] and each row's target column on this rank (-1 elsewhere) [N]. `problem` is
// this rank's reason to reject its arguments ("" if none); problems are raised on every rank.
// vocab_parallel_cross_entropy_backward_ turns the exp buffer into the gradient in place.

using Forward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Forward forward_kernel(const at::Tensor& logits,
                       const at::Tensor& target,
                       int64_t ignore_index,
                       double smoothing,
                       int64_t vocab_size,
                       int64_t reduction,
                       c10::string_view given_problem,
                       c10::string_view group_name) {
  const GroupPtr group = group_named(group_name);
  const auto acc = logits.options().dtype(accumulate_type(logits));
  const int64_t rows = logits.size(0);
  const VocabRange range = vocab_range(vocab_size, group);
  const std::string problem = given_problem.empty()
                                  ? target_problem(target, ignore_index, vocab_size)
                                  : std::string(given_problem);

  // The row max over the real entries of every shard, with the agreement check riding along.
  auto row_max = problem.empty() && range.real > 0
                     ? logits.narrow(1, 0, range.real).amax(1).to(acc.dtype())
                     : at::full({rows}, -std::numeric_limits<double>::infinity(), acc);
  const double flag = problem.empty() ? 0.0 : 1.0;
  const auto settings = at::tensor({flag,
                                    static_cast<double>(vocab_size),
                                    -static_cast<double>(vocab_size),
                                    static_cast<double>(ignore_index),
                                    -static_cast<double>(ignore_index),
                                    smoothing,
                                    -smoothing,
                                    static_cast<double>(reduction),
                                    -static_cast<double>(reduction)},
                                   at::TensorOptions().dtype(at::kDouble))
                            .to(acc);
  const auto reduced = comm::all_reduce(at::cat({row_max, settings}), group, c10d::ReduceOp::MAX);
  raise_on_every_rank(problem, reduced.narrow(0, rows, settings.numel()));
  row_max = reduced.narrow(0, 0, rows);

  const auto ignored = target.eq(ignore_index);
  const auto here = target.ge(range.start)
                        .logical_and_(target.lt(range.start + range.real))
                        .logical_and_(ignored.logical_not());
  const auto target_local = (target - range.start).masked_fill_(here.logical_not(), -1);
  auto [exp_logits, stats] = forward_pass(logits, row_max, target_local, range.real);
  stats = comm::all_reduce(stats.to(acc.dtype()), group);
  const auto sum_exp = stats.select(1, 0);
  const auto log_sum_exp = sum_exp.log();
  auto loss = log_sum_exp - stats.select(1, 1);
  if (smoothing > 0) {
    const auto mean_neg_log_p = log_sum_exp - stats.select(1, 2) / static_cast<double>(vocab_size);
    loss = loss * (1.0 - smoothing) + mean_neg_log_p * smoothing;
  }
  loss.masked_fill_(ignored, 0);
  return {loss, exp_logits, sum_exp.contiguous(), target_local};
}

Forward forward_meta(const at::Tensor& logits,
                     const at::Tensor& target,
                     int64_t,
                     double,
                     int64_t,
                     int64_t,
                     c10::string_view,
                     c10::string_view) {
  const auto acc = logits.options().dtype(accumulate_type(logits));
  const auto rows = logits.sym_size(0);
  return {at::empty_symint({rows}, acc),
          at::empty_like(logits, at::MemoryFormat::Contiguous),
          at::empty_symint({rows}, acc),
          at::empty_like(target, target.options().dtype(at::kLong))};
}

void backward_meta_(at::Tensor&,
                    const at::Tensor&,
                    const at::Tensor&,
                    const at::Tensor&,
                    double,
                    int64_t,
                    int64_t) {}

// The loss as an autograd function over the two operators. Returns the per-row losses [N].
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx,
                            const at::Tensor& logits,
                            const at::Tensor& target,
                            const GroupPtr& group,
                            int64_t ignore_index,
                            double smoothing,
                            int64_t vocab_size,
                            int64_t reduction,
                            const std::string& problem) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("torch_mp::vocab_parallel_cross_entropy_forward", "")
            .typed<Forward(const at::Tensor&,
                           const at::Tensor&,
                           int64_t,
                           double,
                           int64_t,
                           int64_t,
                           c10::string_view,
                           c10::string_view)>();
    auto [loss, exp_logits, sum_exp, target_local] = op.call(
        logits, target, ignore_index, smoothing, vocab_size, reduction, problem, group_name(group));
    ctx->save_for_backward({exp_logits, sum_exp, target_local, target.eq(ignore_index)});
    ctx->saved_data["smoothing"] = smoothing;
    ctx->saved_data["vocab_size"] = vocab_size;
    ctx->saved_data["real"] = vocab_range(vocab_size, group).real;
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "vocab_parallel_cross_entropy is not twice differentiable (create_graph=True)");
    TORCH_CHECK(!ctx->saved_data.count("done"),
                "vocab_parallel_cross_entropy: backward ran twice through the same loss (the "
                "saved softmax becomes the gradient); recompute the loss instead of "
                "retain_graph=True");
    ctx->saved_data["done"] = true;
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("torch_mp::vocab_parallel_cross_entropy_backward_", "")
            .typed<void(at::Tensor&,
                        const at::Tensor&,
                        const at::Tensor&,
                        const at::Tensor&,
                        double,
                        int64_t,
                        int64_t)>();
    const auto saved = ctx->get_saved_variables();
    auto exp_logits = saved[0];
    const auto acc = accumulate_type(exp_logits);
    const auto row_scale = grads[0].to(acc).masked_fill(saved[3], 0).contiguous();
    op.call(exp_logits,
            saved[1],
            saved[2],
            row_scale,
            ctx->saved_data["smoothing"].toDouble(),
            ctx->saved_data["vocab_size"].toInt(),
            ctx->saved_data["real"].toInt());
    return {exp_logits,
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

// "none", "mean" or "sum" as at::Reduction, or nothing.
std::optional<at::Reduction::Reduction> parse_reduction(const std::string& reduction) {
  if (reduction == "none") {
    return at::Reduction::None;
  }
  if (reduction == "mean") {
    return at::Reduction::Mean;
  }
  if (reduction == "sum") {
    return at::Reduction::Sum;
  }
  return std::nullopt;
}

// Both public overloads. A `reduction` of nullopt is invalid (`reduction_text` names it).
at::Tensor cross_entropy(const at::Tensor& logits,
                         const at::Tensor& target,
                         const GroupPtr& group,
                         int64_t ignore_index,
                         double label_smoothing,
                         std::optional<at::Reduction::Reduction> reduction,
                         const std::string& reduction_text,
                         std::optional<int64_t> vocab_size,
                         const GroupPtr& context_group) {
  // Structural errors (every rank running the same program meets them alike) raise here.
  TORCH_CHECK(group, "vocab_parallel_cross_entropy: no process group");
  TORCH_CHECK(logits.dim() >= 1 && at::isFloatingType(logits.scalar_type()),
              "vocab_parallel_cross_entropy: logits must be a floating-point tensor [..., V/t]");
  comm::check_replicated(target, group, "vocab_parallel_cross_entropy: the targets");
  TORCH_CHECK(target.sym_sizes() == logits.sym_sizes().slice(0, logits.dim() - 1),
              "vocab_parallel_cross_entropy: target must have the logits' shape without the last "
              "(vocabulary) dim: logits ",
              logits.sym_sizes(),
              ", target ",
              target.sym_sizes());
  TORCH_CHECK(!at::isFloatingType(target.scalar_type()),
              "vocab_parallel_cross_entropy: target must hold class ids (an integer tensor); "
              "probability targets are not supported");
  const int64_t local = logits.size(-1);
  const int64_t given_vocab = vocab_size.value_or(local * group->getSize());
  const int64_t vocab = given_vocab > 0 ? given_vocab : std::max<int64_t>(local, 1);
  const VocabRange range = vocab_range(vocab, group);
  const auto flat_target = target.reshape({-1}).to(at::kLong);
  const auto valid = flat_target.ne(ignore_index);

  // Problems with this rank's arguments or data are raised on every rank after the first
  // collective (see raise_on_every_rank), not here.
  std::ostringstream problem;
  if (!reduction) {
    problem << "vocab_parallel_cross_entropy: reduction must be 'none', 'mean' or 'sum', got '"
            << reduction_text << "'";
  } else if (!(label_smoothing >= 0.0 && label_smoothing <= 1.0)) {
    problem << "vocab_parallel_cross_entropy: label_smoothing must be in [0, 1], got "
            << label_smoothing;
  } else if (given_vocab <= 0) {
    problem << "vocab_parallel_cross_entropy: vocab_size must be positive, got " << given_vocab;
  } else if (range.rows != local) {
    problem << "vocab_parallel_cross_entropy: a logit shard of " << local
            << " entries does not fit a vocabulary of " << vocab << " split over "
            << group->getSize() << " ranks (" << range.rows << " per rank, padded)";
  }  // (the targets' values are checked by the forward operator's kernel)
  const auto kind = reduction.value_or(at::Reduction::Mean);
  const auto losses = VocabParallelCrossEntropy::apply(logits.reshape({-1, local}).contiguous(),
                                                       flat_target,
                                                       group,
                                                       ignore_index,
                                                       label_smoothing,
                                                       vocab,
                                                       static_cast<int64_t>(kind),
                                                       problem.str());
  // Reduced in the accumulate type (a float sum of many fp16 losses, or their count, would
  // overflow); only the result takes the logits' type.
  if (kind == at::Reduction::None) {
    return losses.view_symint(target.sym_sizes()).to(logits.scalar_type());
  }
  auto sum = losses.sum();
  auto count = valid.sum().to(losses.scalar_type());
  if (context_group && context_group->getSize() > 1) {
    // Over the context group's tokens: one all-reduce of [sum, count] forward
    // (reduce_from_tp's), and of the sum's gradient backward (copy_to_tp's), its adjoint.
    const auto both = reduce_from_tp(at::stack({sum, count}), context_group);
    sum = copy_to_tp(both[0], context_group);
    count = both[1].detach();
  }
  return (kind == at::Reduction::Sum ? sum : sum / count).to(logits.scalar_type());
}

}  // namespace

bool has_fused_cuda_kernels() {
#ifdef TORCH_MP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits,
                                        const at::Tensor& target,
                                        const GroupPtr& group,
                                        int64_t ignore_index,
                                        double label_smoothing,
                                        at::Reduction::Reduction reduction,
                                        std::optional<int64_t> vocab_size,
                                        const GroupPtr& context_group) {
  return cross_entropy(logits,
                       target,
                       group,
                       ignore_index,
                       label_smoothing,
                       reduction,
                       "",
                       vocab_size,
                       context_group);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits,
                                        const at::Tensor& target,
                                        const GroupPtr& group,
                                        int64_t ignore_index,
                                        double label_smoothing,
                                        const std::string& reduction,
                                        std::optional<int64_t> vocab_size,
                                        const GroupPtr& context_group) {
  return cross_entropy(logits,
                       target,
                       group,
                       ignore_index,
                       label_smoothing,
                       parse_reduction(reduction),
                       reduction,
                       vocab_size,
                       context_group);
}

namespace {

at::Tensor vocab_parallel_cross_entropy_op(const at::Tensor& logits,
                                           const at::Tensor& target,
                                           int64_t ignore_index,
                                           double label_smoothing,
                                           c10::string_view reduction,
                                           std::optional<int64_t> vocab_size,
                                           c10::string_view group,
                                           c10::string_view context_group) {
  return vocab_parallel_cross_entropy(logits,
                                      target,
                                      group_named(group),
                                      ignore_index,
                                      label_smoothing,
                                      std::string(reduction),
                                      vocab_size,
                                      group_named_or_none(context_group));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  m.def(
      "vocab_parallel_cross_entropy(Tensor logits, Tensor target, int ignore_index, "
      "float label_smoothing, str reduction, int? vocab_size, str group, "
      "str context_group=\"\") -> Tensor",
      &vocab_parallel_cross_entropy_op);
  m.def(
      "vocab_parallel_cross_entropy_forward(Tensor logits, Tensor target, int ignore_index, "
      "float label_smoothing, int vocab_size, int reduction, str problem, str group) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "vocab_parallel_cross_entropy_backward_(Tensor(a!) exp_logits, Tensor sum_exp, "
      "Tensor target_local, Tensor row_scale, float label_smoothing, int vocab_size, "
      "int real_columns) -> ()");
}

TORCH_LIBRARY_IMPL(torch_mp, CompositeExplicitAutograd, m) {
  m.impl("vocab_parallel_cross_entropy_forward", &forward_kernel);
  m.impl("vocab_parallel_cross_entropy_backward_", &backward_pass_);
}

TORCH_LIBRARY_IMPL(torch_mp, Meta, m) {
  m.impl("vocab_parallel_cross_entropy_forward", &forward_meta);
  m.impl("vocab_parallel_cross_entropy_backward_", &backward_meta_);
}

}  // namespace torch_mp::tensor_parallel
