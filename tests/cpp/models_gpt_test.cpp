// The GPT of torch_mp::models (csrc/torch_mp/models/gpt.h, what the C++ examples train): GPT-2's
// initialisation, the learning-rate schedule, the byte corpus and sampling, against the same
// numbers as Python's (tests/python/test_gpt.py).

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "torch_mp/models/gpt.h"
#include "torch_mp/models/gpt_training.h"

namespace {

namespace gpt = torch_mp::models;

TEST(ModelsGpt, EveryTableAndProjectionStartsAtGpt2sStandardDeviation) {
  torch::manual_seed(0);
  constexpr int64_t kLayers = 4;
  gpt::DenseGpt model(gpt::Config{
      .vocab = 62, .seq = 256, .hidden = 256, .heads = 4, .ffn = 1024, .layers = kLayers});
  const double residual = 0.02 / std::sqrt(2.0 * kLayers);
  EXPECT_DOUBLE_EQ(*gpt::gpt2_init_std("layers.0.self_attn.out_proj.weight", kLayers), residual);
  EXPECT_DOUBLE_EQ(*gpt::gpt2_init_std("layers.3.linear2.weight", kLayers), residual);
  EXPECT_DOUBLE_EQ(*gpt::gpt2_init_std("layers.1.moe.experts.fc2_weight", kLayers), residual);
  EXPECT_DOUBLE_EQ(*gpt::gpt2_init_std("layers.1.moe.experts.fc1_weight", kLayers), 0.02);
  EXPECT_DOUBLE_EQ(*gpt::gpt2_init_std("layers.3.linear1.weight", kLayers), 0.02);
  EXPECT_DOUBLE_EQ(*gpt::gpt2_init_std("pos.weight", kLayers), 0.02);
  int checked = 0;
  for (const auto& item : model->named_parameters()) {
    const auto& name = item.key();
    const auto& p = item.value();
    const auto std = gpt::gpt2_init_std(name, kLayers);
    if (!std) {  // LayerNorms: weight 1, bias 0
      EXPECT_NE(name.find("norm"), std::string::npos) << name;
      EXPECT_TRUE(p.equal(at::full_like(p, name.ends_with("weight") ? 1.0 : 0.0))) << name;
      continue;
    }
    // Of >= 15k draws: the sample's std is within 2.3 % of the true one (4 sigma).
    EXPECT_NEAR(p.std().item<double>(), *std, 0.03 * *std) << name;
    EXPECT_LT(std::abs(p.mean().item<double>()), 4 * *std / std::sqrt(p.numel())) << name;
    ++checked;
  }
  EXPECT_EQ(checked, 2 + 4 * kLayers);
  EXPECT_EQ(model->named_parameters().size(), 2 + 4 * kLayers + 2 * kLayers + 2);
}

TEST(ModelsGpt, TheLearningRateWarmsUpThenFollowsAHalfCosineToMinLr) {
  const gpt::LearningRate schedule{.lr = 1e-3, .warmup = 10, .decay_steps = 110, .min_lr = 1e-4};
  EXPECT_NEAR(schedule.at(1), 1e-4, 1e-12);
  EXPECT_NEAR(schedule.at(10), 1e-3, 1e-12);
  EXPECT_NEAR(schedule.at(60), 5.5e-4, 1e-12);
  EXPECT_NEAR(schedule.at(110), 1e-4, 1e-12);
  EXPECT_NEAR(schedule.at(200), 1e-4, 1e-12);
  EXPECT_EQ(gpt::LearningRate{.lr = 2e-3}.at(50), 2e-3);
}

TEST(ModelsGpt, TheCorpusIsTheShippedTextAsBytes) {
  const gpt::Corpus corpus(std::string(TORCH_MP_SOURCE_DIR) + "/" + gpt::kShakespeare);
  EXPECT_EQ(corpus.decode(corpus.ids.slice(0, 0, 14)), "First Citizen:");
  EXPECT_EQ(corpus.vocab, static_cast<int64_t>(corpus.bytes.size()));
  const auto [inputs, target] = corpus.batch(3, 4, 16);
  EXPECT_EQ(inputs.sizes(), (at::IntArrayRef{4, 16}));
  EXPECT_TRUE(inputs.slice(1, 1).equal(target.slice(1, 0, 15)));
}

TEST(ModelsGpt, SamplingContinuesThePromptGreedilyOrReproduciblyAtATemperature) {
  torch::manual_seed(0);
  gpt::DenseGpt model(
      gpt::Config{.vocab = 20, .seq = 8, .hidden = 16, .heads = 2, .ffn = 32, .layers = 2});
  const auto prompt = torch::tensor({1, 2, 3}, torch::kLong).unsqueeze(0);
  const auto greedy = gpt::sample(model, prompt, 12, 0.0);
  ASSERT_EQ(greedy.sizes(), (at::IntArrayRef{1, 15}));
  EXPECT_TRUE(greedy.slice(1, 0, 3).equal(prompt));
  {
    torch::NoGradGuard no_grad;
    EXPECT_EQ(greedy[0][14].item<int64_t>(),
              model->forward(greedy.slice(1, 6, 14))[-1][0].argmax().item<int64_t>());
  }
  const auto a = gpt::sample(model, prompt, 12, 1.0, at::make_generator<at::CPUGeneratorImpl>(5));
  const auto b = gpt::sample(model, prompt, 12, 1.0, at::make_generator<at::CPUGeneratorImpl>(5));
  EXPECT_TRUE(a.equal(b));
  EXPECT_LT(a.max().item<int64_t>(), 20);
}

}  // namespace
