#pragma once
// gpt_3d --check's one-process reference: the same model and recipe trained on the whole batch
// in one process, compared with the parallel run step by step (gpt_3d.cpp).

#include <torch/torch.h>
#include <torch_mp/models/gpt.h>
#include <torch_mp/torch_mp.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace gpt_3d {

namespace gpt = torch_mp::models;

inline constexpr double kLossTolerance = 1e-5, kParameterTolerance = 1e-4;
inline constexpr double kBf16LossTolerance = 1e-3, kBf16ParameterTolerance = 1e-2;

inline void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
}

/// `dense`'s parameters set to the tensors of the dense file `path`.
inline void load_dense_file(gpt::DenseGpt& dense, const std::string& path) {
  const auto weights = torch_mp::checkpoint::load_file(path);
  torch::NoGradGuard no_grad;
  for (auto& item : dense->named_parameters()) {
    item.value().copy_(weights.at(item.key()));
  }
}

/// The largest |difference| between this rank's trained token table (first stage) and head
/// (last stage), gathered over the tensor group, and the reference's table.
inline double table_difference(const gpt::GptStage& mine, const gpt::DenseGpt& reference) {
  double worst = 0.0;
  for (const auto& table : {mine->tok, mine->head}) {
    if (table) {
      const auto gathered = table->to_dense()->weight;
      worst = std::max(worst,
                       (gathered.to(torch::kFloat) - reference->tok->weight.to(torch::kFloat))
                           .abs()
                           .max()
                           .item<double>());
    }
  }
  return worst;
}

/// The one-process run of the same recipe: AdamW over the model's parameters, or, with --bf16,
/// over fp32 masters of its bf16 parameters (the gradients taken in fp32, the parameters
/// written back rounded); clipped as the parallel run is.
struct Reference {
  gpt::DenseGpt model = nullptr;
  bool bf16 = false;
  std::vector<at::Tensor> params, masters;
  std::unique_ptr<torch::optim::AdamW> optimizer;

  Reference(gpt::DenseGpt dense, bool bf16, double lr) : model(std::move(dense)), bf16(bf16) {
    if (bf16) {
      model->to(torch::kBFloat16);
    }
    params = model->parameters();
    refresh_masters();
    optimizer = std::make_unique<torch::optim::AdamW>(
        masters, torch::optim::AdamWOptions(lr).weight_decay(0.01));
  }

  /// One step on the whole batch, cut into `pieces` micro-batches (with MoE layers each its own
  /// load-balancing loss), clipped to `clip`, at learning rate `lr`: the pieces' mean loss.
  double step(
      const at::Tensor& inputs, const at::Tensor& target, int64_t pieces, double clip, double lr) {
    optimizer->zero_grad();
    model->zero_grad();
    double loss = 0.0;
    for (int64_t i = 0; i < pieces; ++i) {
      auto [logits, aux_loss] = model->forward_with_aux(inputs.chunk(pieces)[i]);
      const auto part = (gpt::dense_loss(logits, target.chunk(pieces)[i]) + aux_loss) /
                        static_cast<double>(pieces);
      part.backward();
      loss += part.item<double>();
    }
    if (bf16) {
      for (size_t i = 0; i < params.size(); ++i) {
        masters[i].mutable_grad() = params[i].grad().to(torch::kFloat);
      }
    }
    torch::nn::utils::clip_grad_norm_(masters, clip);
    set_learning_rate(*optimizer, lr);
    optimizer->step();
    if (bf16) {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].copy_(masters[i]);
      }
    }
    return loss;
  }

  /// The stages' parameters taken on every rank: exported to `path` (a collective) and read
  /// back once rank 0 has written it, so that the next step starts from the same weights.
  void sync(const std::vector<torch_mp::checkpoint::Stage>& stages,
            const std::shared_ptr<torch_mp::Mesh>& mesh,
            const std::string& path) {
    torch_mp::checkpoint::export_dense(path, stages, mesh);
    torch_mp::comm::all_reduce(torch::zeros({1}), mesh->world);  // rank 0 is past its export too
    load_dense_file(model, path);
    refresh_masters();
  }

  void refresh_masters() {
    torch::NoGradGuard no_grad;
    if (!bf16) {
      masters = params;
      return;
    }
    if (masters.empty()) {
      for (const auto& p : params) {
        masters.push_back(p.detach().to(torch::kFloat));
      }
    }
    for (size_t i = 0; i < params.size(); ++i) {
      masters[i].copy_(params[i]);
    }
  }
};

/// Whether the run agreed with the one-process reference: the worst differences over every
/// rank (a collective) within the tolerances; rank 0 prints them.
inline bool agrees(double worst_loss, double worst_table, bool bf16, const torch_mp::Mesh& mesh) {
  auto worst = torch::tensor({worst_loss, worst_table}, torch::kDouble);
  worst = torch_mp::comm::all_reduce(worst, mesh.world, c10d::ReduceOp::MAX);
  worst_loss = worst[0].item<double>();
  worst_table = worst[1].item<double>();
  const double loss_tolerance = bf16 ? kBf16LossTolerance : kLossTolerance;
  const double table_tolerance = bf16 ? kBf16ParameterTolerance : kParameterTolerance;
  const bool ok = worst_loss <= loss_tolerance && worst_table <= table_tolerance;
  if (mesh.rank == 0) {
    std::printf(
        "agreement with the one-process reference (each step from the same parameters): losses "
        "max |diff| %.2e (tolerance %.0e), token table max |diff| %.2e (tolerance %.0e): %s\n",
        worst_loss,
        loss_tolerance,
        worst_table,
        table_tolerance,
        ok ? "OK" : "MISMATCH");
  }
  return ok;
}

}  // namespace gpt_3d
