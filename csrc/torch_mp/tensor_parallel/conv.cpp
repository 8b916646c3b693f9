#include "torch_mp/tensor_parallel/conv.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <variant>

#include "torch_mp/collectives.h"
#include "torch_mp/layout.h"
#include "torch_mp/operator_options.h"
#include "torch_mp/tensor_parallel/linear.h"
#include "torch_mp/tensor_parallel/sharding.h"

namespace torch_mp::tensor_parallel {
namespace {

constexpr int64_t kChannelDim = -3;  // of [N, C, H, W] and of unbatched [C, H, W]

std::optional<at::Tensor> optional_bias(const at::Tensor& bias) {
  return bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
}

bool is_same(const torch::nn::detail::conv_padding_t<2>& padding) {
  return std::holds_alternative<torch::enumtype::kSame>(padding);
}

bool is_valid(const torch::nn::detail::conv_padding_t<2>& padding) {
  return std::holds_alternative<torch::enumtype::kValid>(padding);
}

// The amounts at::pad takes for a non-zero padding mode: (left, right) of the last dim first,
// as torch.nn.Conv2d computes them (for "same": total d * (k - 1), the extra one on the right).
std::vector<int64_t> reversed_padding(const torch::nn::Conv2dOptions& o) {
  std::vector<int64_t> pads;
  for (int64_t i = 1; i >= 0; --i) {
    if (is_same(o.padding())) {
      const int64_t total = (*o.dilation())[i] * ((*o.kernel_size())[i] - 1);
      pads.push_back(total / 2);
      pads.push_back(total - total / 2);
    } else if (is_valid(o.padding())) {
      pads.insert(pads.end(), {0, 0});
    } else {
      const int64_t p = (*std::get<torch::ExpandingArray<2>>(o.padding()))[i];
      pads.insert(pads.end(), {p, p});
    }
  }
  return pads;
}

const char* pad_mode(const torch::nn::detail::conv_padding_mode_t& mode) {
  if (std::holds_alternative<torch::enumtype::kReflect>(mode)) {
    return "reflect";
  }
  if (std::holds_alternative<torch::enumtype::kReplicate>(mode)) {
    return "replicate";
  }
  return "circular";
}

}  // namespace

torch::nn::Conv2dOptions conv2d_options(int64_t in_channels,
                                        int64_t out_channels,
                                        std::array<int64_t, 2> kernel_size,
                                        std::array<int64_t, 2> stride,
                                        const std::string& padding,
                                        std::array<int64_t, 2> padding_size,
                                        std::array<int64_t, 2> dilation,
                                        int64_t groups,
                                        bool bias,
                                        const std::string& padding_mode) {
  auto options = torch::nn::Conv2dOptions(in_channels, out_channels, kernel_size)
                     .stride(stride)
                     .dilation(dilation)
                     .groups(groups)
                     .bias(bias);
  if (padding.empty()) {
    options.padding(padding_size);
  } else if (padding == "same") {
    options.padding(torch::kSame);
  } else {
    TORCH_CHECK(padding == "valid",
                "Conv2d: padding must be a pair of numbers, 'same' or 'valid', got '",
                padding,
                "'");
    options.padding(torch::kValid);
  }
  if (padding_mode == "reflect") {
    options.padding_mode(torch::kReflect);
  } else if (padding_mode == "replicate") {
    options.padding_mode(torch::kReplicate);
  } else if (padding_mode == "circular") {
    options.padding_mode(torch::kCircular);
  } else {
    TORCH_CHECK(padding_mode == "zeros",
                "Conv2d: padding_mode must be 'zeros', 'reflect', 'replicate' or 'circular', got '",
                padding_mode,
                "'");
  }
  return options;
}

torch::nn::Conv2dOptions conv2d_options_of(const torch::nn::detail::ConvNdOptions<2>& m) {
  return torch::nn::Conv2dOptions(m.in_channels(), m.out_channels(), m.kernel_size())
      .stride(m.stride())
      .padding(m.padding())
      .dilation(m.dilation())
      .groups(m.groups())
      .bias(m.bias())
      .padding_mode(m.padding_mode());
}

at::Tensor conv2d_as(const at::Tensor& input,
                     const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias,
                     const torch::nn::Conv2dOptions& o) {
  const auto stride = *o.stride();
  const auto dilation = *o.dilation();
  if (!std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode())) {
    const auto padded = at::pad(input, reversed_padding(o), pad_mode(o.padding_mode()));
    constexpr std::array<int64_t, 2> kNoPadding{0, 0};
    return at::conv2d(padded, weight, bias, stride, kNoPadding, dilation);
  }
  if (is_same(o.padding())) {
    return at::conv2d(input, weight, bias, stride, "same", dilation);
  }
  if (is_valid(o.padding())) {
    return at::conv2d(input, weight, bias, stride, "valid", dilation);
  }
  return at::conv2d(
      input, weight, bias, stride, *std::get<torch::ExpandingArray<2>>(o.padding()), dilation);
}

at::Tensor column_parallel_conv2d(const at::Tensor& input,
                                  const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias,
                                  const torch::nn::Conv2dOptions& dense,
                                  bool gather_output,
                                  const GroupPtr& group) {
  check_shard_size(
      "ColumnParallelConv2d", "out_channels", weight.size(0), dense.out_channels(), group);
  const auto y = conv2d_as(copy_to_tp(input, group), weight, bias, dense);
  return gather_output ? gather_from_tp(y, group, kChannelDim) : y;
}

at::Tensor row_parallel_conv2d(const at::Tensor& input,
                               const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias,
                               const torch::nn::Conv2dOptions& dense,
                               bool input_is_parallel,
                               const GroupPtr& group) {
  check_shard_size("RowParallelConv2d", "in_channels", weight.size(1), dense.in_channels(), group);
  const auto x = input_is_parallel ? input : scatter_to_tp(input, group, kChannelDim);
  const auto y = reduce_from_tp(conv2d_as(x, weight, std::nullopt, dense), group);
  if (!bias || !bias->defined()) {
    return y;
  }
  return y + bias->view({-1, 1, 1});
}

namespace {

// What both layers check after agreeing on their options.
void check_conv2d_geometry(const torch::nn::Conv2dOptions& o,
                           int64_t shard_dim,
                           const GroupPtr& group) {
  const char* name = shard_dim == 0 ? "ColumnParallelConv2d" : "RowParallelConv2d";
  const auto& k = *o.kernel_size();
  const auto& s = *o.stride();
  const auto& d = *o.dilation();
  std::array<int64_t, 2> padding{0, 0};
  if (const auto* p = std::get_if<torch::ExpandingArray<2>>(&o.padding())) {
    padding = {(**p)[0], (**p)[1]};
  }
  TORCH_CHECK(o.groups() == 1, name, ": only groups=1 is supported, got ", o.groups());
  TORCH_CHECK(o.in_channels() > 0 && o.out_channels() > 0 && k[0] > 0 && k[1] > 0 && s[0] > 0 &&
                  s[1] > 0 && d[0] > 0 && d[1] > 0 && padding[0] >= 0 && padding[1] >= 0,
              name,
              ": channels, kernel_size, stride and dilation must be positive and padding "
              "non-negative");
  TORCH_CHECK(!is_same(o.padding()) || (s[0] == 1 && s[1] == 1),
              name,
              ": padding='same' is not supported for strided convolutions");
  divide(shard_dim == 0 ? o.out_channels() : o.in_channels(),
         group->getSize(),
         std::string(name) + (shard_dim == 0 ? ": out_channels" : ": in_channels"));
}

template <typename Options>
void check_parallel_conv2d(const Options& o) {
  TORCH_CHECK(o.group(), Options::kName, ": options.group() is not set");
  // Agreement first: a check that fails on one rank only would leave the others waiting.
  options::check_same_options(o, o.group(), Options::kName);
  check_conv2d_geometry(o.conv(), Options::kShardDim, o.group());
}

}  // namespace

void check_column_parallel_conv2d(const ColumnParallelConv2dOptions& options) {
  check_parallel_conv2d(options);
}

void check_row_parallel_conv2d(const RowParallelConv2dOptions& options) {
  check_parallel_conv2d(options);
}

template <typename Options>
torch::nn::Conv2dOptions conv2d_geometry(const Options& o) {
  const auto* numbers = std::get_if<torch::ExpandingArray<2>>(&o.padding());
  const auto pair = [](const torch::ExpandingArray<2>& a) {
    return std::array<int64_t, 2>{(*a)[0], (*a)[1]};
  };
  return conv2d_options(o.in_channels(),
                        o.out_channels(),
                        pair(o.kernel_size()),
                        pair(o.stride()),
                        numbers ? std::string() : std::get<std::string>(o.padding()),
                        numbers ? pair(*numbers) : std::array<int64_t, 2>{0, 0},
                        pair(o.dilation()),
                        o.groups(),
                        o.bias(),
                        o.padding_mode());
}

template <typename Options>
void set_conv2d_geometry(Options& o, const torch::nn::Conv2dOptions& dense) {
  Conv2dPadding padding = std::string(is_same(dense.padding()) ? "same" : "valid");
  if (const auto* numbers = std::get_if<torch::ExpandingArray<2>>(&dense.padding())) {
    padding = *numbers;
  }
  const auto& mode = dense.padding_mode();
  o.in_channels(dense.in_channels())
      .out_channels(dense.out_channels())
      .kernel_size(dense.kernel_size())
      .stride(dense.stride())
      .padding(padding)
      .dilation(dense.dilation())
      .groups(dense.groups())
      .bias(dense.bias())
      .padding_mode(std::holds_alternative<torch::enumtype::kZeros>(mode) ? "zeros"
                                                                          : pad_mode(mode));
}

template torch::nn::Conv2dOptions conv2d_geometry(const ColumnParallelConv2dOptions&);
template torch::nn::Conv2dOptions conv2d_geometry(const RowParallelConv2dOptions&);
template void set_conv2d_geometry(ColumnParallelConv2dOptions&, const torch::nn::Conv2dOptions&);
template void set_conv2d_geometry(RowParallelConv2dOptions&, const torch::nn::Conv2dOptions&);

// ---- modules ---------------------------------------------------------------------------------

template <typename Options>
ParallelConv2dImpl<Options>::ParallelConv2dImpl(Options options_, bool initialise)
    : options(std::move(options_)), initialise_(initialise) {
  reset();
}

template <typename Options>
void ParallelConv2dImpl<Options>::reset() {
  options.group(tp_group_or_default(options.group()));
  const auto conv = options.conv();
  check_parallel_conv2d(options);
  const int64_t t = options.group()->getSize();
  const auto& k = *conv.kernel_size();
  std::vector<int64_t> shape{conv.out_channels(), conv.in_channels(), k[0], k[1]};
  shape[Options::kShardDim] /= t;
  weight = this->register_parameter("weight", at::empty(shape));
  const int64_t bias_size = Options::kShardDim == 0 ? shape[0] : conv.out_channels();
  bias = this->register_parameter(
      "bias", conv.bias() ? at::empty({bias_size}) : at::Tensor(), /*requires_grad=*/conv.bias());
  set_weight_and_bias_layout(weight, bias, Options::kShardDim, options.group());
  if (initialise_) {
    reset_parameters();
  }
}

template <typename Options>
void ParallelConv2dImpl<Options>::reset_parameters() {
  init_sharded_like_dense_(weight, optional_bias(bias), Options::kShardDim, options.group());
}

template <typename Options>
at::Tensor ParallelConv2dImpl<Options>::forward(const at::Tensor& input) {
  if constexpr (Options::kShardDim == 0) {
    return column_parallel_conv2d(
        input, weight, optional_bias(bias), options.conv(), options.flag(), options.group());
  } else {
    return row_parallel_conv2d(
        input, weight, optional_bias(bias), options.conv(), options.flag(), options.group());
  }
}

template <typename Options>
void ParallelConv2dImpl<Options>::pretty_print(std::ostream& stream) const {
  stream << "torch_mp::" << Options::kName << "(" << options::describe(options)
         << ", tp_size=" << options.group()->getSize() << ")";
}

template <typename Options>
std::shared_ptr<ParallelConv2dImpl<Options>> ParallelConv2dImpl<Options>::uninitialised(
    Options options) {
  return std::shared_ptr<ParallelConv2dImpl>(
      new ParallelConv2dImpl(std::move(options), /*initialise=*/false));
}

template <typename Options>
std::shared_ptr<ParallelConv2dImpl<Options>> ParallelConv2dImpl<Options>::from_dense(
    const torch::nn::Conv2d& dense, Options options) {
  const auto a = conv2d_options_of(dense->options);
  const auto b = options.conv();
  TORCH_CHECK(a.in_channels() == b.in_channels() && a.out_channels() == b.out_channels() &&
                  *a.kernel_size() == *b.kernel_size() && a.bias() == b.bias(),
              Options::kName,
              ".from_dense: options.conv() must describe the dense layer (in_channels, "
              "out_channels, kernel_size, bias)");
  // Geometry comes from the dense layer itself.
  options.conv(a);
  auto layer = uninitialised(std::move(options));
  layer->to(dense->weight.device(), dense->weight.scalar_type());
  load_dense_linear_(layer->weight,
                     optional_bias(layer->bias),
                     dense->weight,
                     optional_bias(dense->bias),
                     Options::kShardDim,
                     layer->options.group());
  return layer;
}

template <typename Options>
torch::nn::Conv2d ParallelConv2dImpl<Options>::to_dense() const {
  const auto [dense_weight, dense_bias] =
      gather_dense_linear(weight, optional_bias(bias), Options::kShardDim, options.group());
  const KeepDefaultRng keep_rng;  // the dense layer's own initialisation is overwritten
  torch::nn::Conv2d dense(options.conv());
  dense->to(weight.device(), weight.scalar_type());
  at::NoGradGuard no_grad;
  dense->weight.copy_(dense_weight);
  if (dense_bias) {
    dense->bias.copy_(*dense_bias);
  }
  return dense;
}

template class ParallelConv2dImpl<ColumnParallelConv2dOptions>;
template class ParallelConv2dImpl<RowParallelConv2dOptions>;

// ---- the operators ----------------------------------------------------------------------------

namespace {

at::Tensor column_parallel_conv2d_op(const at::Tensor& input,
                                     const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias_tensor,
                                     const ColumnParallelConv2dOptions& o) {
  check_bias_given(o, bias_tensor);
  return column_parallel_conv2d(input, weight, bias_tensor, o.conv(), o.gather_output(), o.group());
}

at::Tensor row_parallel_conv2d_op(const at::Tensor& input,
                                  const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias_tensor,
                                  const RowParallelConv2dOptions& o) {
  check_bias_given(o, bias_tensor);
  return row_parallel_conv2d(
      input, weight, bias_tensor, o.conv(), o.input_is_parallel(), o.group());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_mp, m) {
  options::def_layer_operator<&column_parallel_conv2d_op>(
      m, "column_parallel_conv2d(Tensor input, Tensor weight, Tensor? bias_tensor)");
  options::def_layer_operator<&row_parallel_conv2d_op>(
      m, "row_parallel_conv2d(Tensor input, Tensor weight, Tensor? bias_tensor)");
}

}  // namespace torch_mp::tensor_parallel
