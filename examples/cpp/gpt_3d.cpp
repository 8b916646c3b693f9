// Trains a small GPT on data x pipeline x tensor (x context) parallel ranks from a LibTorch
// application: the C++ counterpart of examples/python/gpt_3d.py.
//
//   torchrun --standalone --no-python --nproc-per-node=8 build/examples/cpp/gpt_3d \
//       --tp 2 --pp 2 --dp 2 --schedule 1f1b [--sequence-parallel] [--steps N] [--check] \
//       [--cp N [--cp-method ring|all_gather|all_to_all]] [--moe-experts E [--ep N]] \
//       [--save-every N --checkpoint DIR] [--resume] [--probe FILE] [--sample N]
//
// The model is torch_mp/models/gpt.h's (torch_mp.models.gpt's twin): token and learned position
// embeddings, pre-LN transformer layers under a causal mask, a final LayerNorm and an output head
// tied to the token embedding, initialised as GPT-2 is; trained byte by byte on Shakespeare's plays
// (gpt::kShakespeare, read from the repository's root, or --corpus FILE) with AdamW (warm-up,
// then cosine decay) and clipping. At the end rank 0 prints text sampled from the trained model.
//
// - tensor: VocabParallelEmbedding, ParallelTransformerLayer (heads and MLP split; with
//   --sequence-parallel also the LayerNorms and residuals), vocab_parallel_cross_entropy;
// - pipeline: the layers cut into one stage per pipeline rank; the first stage holds the
//   embeddings, the last the final norm and the head, a copy of the embedding tied to it
//   (Pipeline::tie_parameters);
// - data: every stage wrapped in torch_mp::DataParallel, each data rank given its share of the
//   batch; torch_mp::clip_grad_norm_ clips by the norm of the whole model;
// - context (--cp): each sequence split over the context group, each rank holding its
//   load-balanced part from the embeddings to the loss (the mean over the whole sequence), the
//   attention meeting the other parts by --cp-method; gradients averaged over data x context;
// - experts (--moe-experts E, --ep N): every layer's MLP a mixture of E experts (top
//   --moe-top-k), spread over expert groups of N data ranks (torch_mp::moe::MoE, tokens moved by
//   all-to-all); the load-balancing losses ride with the activations into the loss; DataParallel
//   reduces the experts' gradients over the ranks holding the same experts. Its --check
//   reference takes each data rank's micro-batch as its own piece (each piece's load-balancing
//   loss is that of its own tokens, as each rank computes it).
//
// With --check every rank also trains the dense model on the whole batch (gpt_3d_reference.h),
// and after every step takes the stages' parameters (rounding differences would otherwise
// compound as the model learns: examples/python/gpt_3d.py gives the measurements). Losses must
// agree to 1e-5 and the token table (gathered) to 1e-4 after every step (AdamW scales each
// element's update by its own gradient's root mean square, so elements inherit their gradient's
// relative error).
//
// --zero shards AdamW's state over the data ranks (torch_mp::DistributedOptimizer, ZeRO-1);
// --zero 2 the gradients too (DataParallelOptions::shard_gradients, ZeRO-2). --bf16 trains bf16
// parameters with fp32 main gradients and fp32 masters (ZeRO-2); its --check reference runs the
// same recipe on one process, held to bf16's roundings (examples/python/gpt_3d.py says why).
// --recompute full|selective recomputes each layer (or its attention core) in the backward, with
// the same dropout masks (ParallelTransformerLayerOptions::recompute).
//
// Checkpoints (torch_mp::checkpoint, the format Python's torch_mp.checkpoint reads and writes):
// --save-every N saves the model and AdamW state to --checkpoint DIR every N steps, in the dense
// model's names, in the background (torch_mp::checkpoint::async_save: a snapshot, then written
// while the next steps run); --resume continues from DIR, whatever layout (or front end) saved
// it. --probe
// FILE writes, at the end, the dense model's logits on one batch (the model exported with
// torch_mp::checkpoint::export_dense and rebuilt on rank 0), for comparison with Python.

#include <torch/torch.h>
#include <torch_mp/models/gpt.h>
#include <torch_mp/models/gpt_training.h>
#include <torch_mp/torch_mp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpt_3d_reference.h"

namespace {

namespace gpt = torch_mp::models;  // (the GPT of csrc/torch_mp/models/gpt.h)
using gpt_3d::Reference;

struct Args {
  int64_t tp = 1, pp = 1, dp = -1, cp = 1, ep = 1;
  int64_t moe_experts = 0, moe_top_k = 2;
  std::string cp_method = "ring";
  std::string schedule = "1f1b";
  bool sequence_parallel = false;
  int zero = 0;  // 1: AdamW's state sharded over the data ranks; 2: the gradients too
  bool bf16 = false;
  std::string recompute;
  bool check = false;
  bool resume = false;
  int steps = 70;
  int save_every = 0;
  std::string checkpoint = "checkpoints/gpt_3d_cpp";
  std::string probe;
  std::string corpus = gpt::kShakespeare;
  int64_t batch = 32, microbatches = 4, seq = 32, hidden = 64, heads = 4, ffn = 128, layers = 4;
  int64_t warmup = 10, decay_steps = -1, sample = 200;
  double lr = 2e-3, min_lr = -1.0, clip = 0.5, temperature = 0.8;
  int64_t seed = 0;
};

Args parse(int argc, char** argv) {
  Args a;
  std::map<std::string, int64_t*> integers{{"--tp", &a.tp},
                                           {"--pp", &a.pp},
                                           {"--dp", &a.dp},
                                           {"--cp", &a.cp},
                                           {"--ep", &a.ep},
                                           {"--moe-experts", &a.moe_experts},
                                           {"--moe-top-k", &a.moe_top_k},
                                           {"--batch", &a.batch},
                                           {"--microbatches", &a.microbatches},
                                           {"--seq", &a.seq},
                                           {"--hidden", &a.hidden},
                                           {"--heads", &a.heads},
                                           {"--ffn", &a.ffn},
                                           {"--layers", &a.layers},
                                           {"--warmup", &a.warmup},
                                           {"--decay-steps", &a.decay_steps},
                                           {"--sample", &a.sample},
                                           {"--seed", &a.seed}};
  std::map<std::string, double*> reals{{"--lr", &a.lr},
                                       {"--min-lr", &a.min_lr},
                                       {"--clip", &a.clip},
                                       {"--temperature", &a.temperature}};
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--sequence-parallel") {
      a.sequence_parallel = true;
    } else if (flag == "--zero") {
      a.zero = 1;
      if (i + 1 < argc && (std::string(argv[i + 1]) == "1" || std::string(argv[i + 1]) == "2")) {
        a.zero = std::stoi(argv[++i]);
      }
    } else if (flag == "--bf16") {
      a.bf16 = true;
    } else if (flag == "--check") {
      a.check = true;
    } else if (flag == "--resume") {
      a.resume = true;
    } else if (i + 1 < argc && flag == "--save-every") {
      a.save_every = std::stoi(argv[++i]);
    } else if (i + 1 < argc && flag == "--checkpoint") {
      a.checkpoint = argv[++i];
    } else if (i + 1 < argc && flag == "--probe") {
      a.probe = argv[++i];
    } else if (i + 1 < argc && flag == "--corpus") {
      a.corpus = argv[++i];
    } else if (i + 1 < argc && integers.count(flag)) {
      *integers[flag] = std::stoll(argv[++i]);
    } else if (i + 1 < argc && reals.count(flag)) {
      *reals[flag] = std::stod(argv[++i]);
    } else if (i + 1 < argc && flag == "--steps") {
      a.steps = std::stoi(argv[++i]);
    } else if (i + 1 < argc && flag == "--schedule") {
      a.schedule = argv[++i];
    } else if (i + 1 < argc && flag == "--recompute") {
      a.recompute = argv[++i];
    } else if (i + 1 < argc && flag == "--cp-method") {
      a.cp_method = argv[++i];
    } else {
      throw std::invalid_argument("gpt_3d: unknown or incomplete argument " + flag);
    }
  }
  if (a.min_lr < 0) {
    a.min_lr = a.lr / 10;
  }
  if (a.decay_steps < 0) {
    a.decay_steps = a.steps;
  }
  return a;
}

gpt::Config config_of(const Args& a, int64_t vocab) {
  return {.vocab = vocab,
          .seq = a.seq,
          .hidden = a.hidden,
          .heads = a.heads,
          .ffn = a.ffn,
          .layers = a.layers,
          .moe_experts = a.moe_experts,
          .moe_top_k = a.moe_top_k};
}

std::string progress(int step, int steps, double loss, double tokens_per_s) {
  const int done = static_cast<int>(std::lround(20.0 * step / steps));
  std::ostringstream line;
  line << "[" << std::string(done, '#') << std::string(20 - done, '.') << "] step " << step << "/"
       << steps << "  loss " << std::fixed;
  line.precision(4);
  line << loss << "  ";
  line.precision(0);
  line << tokens_per_s << " tokens/s";
  return line.str();
}

/// A file beside the checkpoints, one per job (MASTER_PORT differs between jobs on one machine).
std::string scratch_file(const Args& a, const std::string& what) {
  const char* port = std::getenv("MASTER_PORT");
  const auto path = std::filesystem::path(a.checkpoint).parent_path() /
                    ("gpt_3d_" + what + "_" + std::string(port ? port : "0") + ".safetensors");
  std::filesystem::create_directories(path.parent_path());
  return path.string();
}

/// The dense model holding the stages' weights, on rank 0 (null elsewhere): exported to the
/// dense file `exported` (a collective), rebuilt from it.
gpt::DenseGpt gathered_model(const Args& a,
                             const gpt::Corpus& corpus,
                             const std::vector<torch_mp::checkpoint::Stage>& stages,
                             const std::shared_ptr<torch_mp::Mesh>& mesh,
                             const std::string& exported) {
  torch_mp::checkpoint::export_dense(exported, stages, mesh);
  if (mesh->rank != 0) {
    return nullptr;
  }
  gpt::DenseGpt dense(config_of(a, corpus.vocab));
  gpt_3d::load_dense_file(dense, exported);
  return dense;
}

/// Writes `a.probe`: a batch of tokens and the logits of the dense model holding the stages'
/// weights.
void write_probe(const Args& a,
                 const gpt::Corpus& corpus,
                 const std::vector<torch_mp::checkpoint::Stage>& stages,
                 const std::shared_ptr<torch_mp::Mesh>& mesh) {
  auto dense = gathered_model(a, corpus, stages, mesh, a.probe + ".model.safetensors");
  if (!dense) {
    return;
  }
  torch::NoGradGuard no_grad;
  const auto tokens = corpus.batch(0, 2, a.seq).first;
  torch_mp::checkpoint::save_file({{"tokens", tokens}, {"logits", dense->forward(tokens)}},
                                  a.probe);
}

/// Rank 0 prints `a.sample` bytes of text sampled from the trained model.
void show_sample(const Args& a,
                 const gpt::Corpus& corpus,
                 const std::vector<torch_mp::checkpoint::Stage>& stages,
                 const std::shared_ptr<torch_mp::Mesh>& mesh) {
  const auto exported = scratch_file(a, "sample");
  auto dense = gathered_model(a, corpus, stages, mesh, exported);
  if (!dense) {
    return;
  }
  std::filesystem::remove(exported);
  const auto prompt = corpus.ids.slice(0, 0, a.seq / 2).unsqueeze(0);
  const auto ids = gpt::sample(
      dense, prompt, a.sample, a.temperature, at::make_generator<at::CPUGeneratorImpl>(a.seed));
  std::printf(
      "sampled from the trained model (temperature %.1f), after the prompt \"%s\":\n%s\n----\n",
      a.temperature,
      corpus.decode(prompt[0]).c_str(),
      corpus.decode(ids[0]).c_str());
}

/// Rank 0's first line: the layout and the recipe.
void print_layout(const Args& a, const gpt::Config& config, const torch_mp::Mesh& mesh, int zero) {
  std::printf(
      "gpt_3d: %lld layers of hidden size %lld, vocabulary %lld: tp=%lld x pp=%lld x "
      "dp=%lld%s%s ranks%s, schedule %s, sequence parallel %s, torch_mp::DataParallel%s%s%s%s\n",
      static_cast<long long>(a.layers),
      static_cast<long long>(a.hidden),
      static_cast<long long>(config.vocab),
      static_cast<long long>(mesh.tp_size()),
      static_cast<long long>(mesh.pp_size()),
      static_cast<long long>(mesh.dp_size()),
      a.cp > 1 ? (" x cp=" + std::to_string(a.cp) + " (" + a.cp_method + ")").c_str() : "",
      a.moe_experts > 0 ? (" x ep=" + std::to_string(a.ep)).c_str() : "",
      a.moe_experts > 0 ? (", MoE layers of " + std::to_string(a.moe_experts) + " experts (top " +
                           std::to_string(a.moe_top_k) + ")")
                              .c_str()
                        : "",
      a.schedule.c_str(),
      a.sequence_parallel ? "on" : "off",
      zero > 0 ? (zero > 1 ? ", AdamW and gradients sharded over the data ranks"
                           : ", AdamW sharded over the data ranks")
               : "",
      a.bf16 ? ", bf16 with fp32 main gradients and masters" : "",
      a.recompute.empty() ? "" : ", recompute ",
      a.recompute.c_str());
}

/// The whole batch's loss: the last stage's, once per data rank (the context ranks' are the
/// same mean over their sequences), averaged. A collective.
double batch_loss(const std::optional<at::Tensor>& loss, const torch_mp::Mesh& mesh) {
  auto shared = torch::zeros({1}, torch::kDouble);
  if (loss && mesh.tp_rank() == 0 && mesh.cp_rank() == 0) {
    shared[0] = loss->item<double>();
  }
  return torch_mp::comm::all_reduce(shared, mesh.world).item<double>() /
         static_cast<double>(mesh.dp_size());
}

/// AdamW, or at --zero its state sharded over the data ranks (torch_mp::DistributedOptimizer,
/// ZeRO-1; with --bf16 over fp32 masters).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Args& a,
                                                        const std::vector<at::Tensor>& parameters,
                                                        const torch_mp::Mesh& mesh,
                                                        int zero) {
  const auto adamw = torch::optim::AdamWOptions(a.lr).weight_decay(0.01);
  if (zero == 0) {
    return std::make_unique<torch::optim::AdamW>(parameters, adamw);
  }
  auto sharded = torch_mp::DistributedOptimizerOptions().group(mesh.dp_cp_group);
  if (a.bf16) {
    sharded.master_dtype(torch::kFloat);
  }
  return std::make_unique<torch_mp::DistributedOptimizer>(parameters, adamw, sharded);
}

int run(int argc, char** argv) {
  const Args a = parse(argc, argv);
  auto options =
      torch_mp::InitOptions().tp(a.tp).pp(a.pp).cp(a.cp).ep(a.ep).timeout(std::chrono::seconds(60));
  if (a.dp > 0) {
    options.dp(a.dp);
  }
  const auto mesh = torch_mp::init(options);
  const bool is_rank0 = mesh->rank == 0;
  const gpt::Corpus corpus(a.corpus);
  const auto config = config_of(a, corpus.vocab);

  torch::manual_seed(a.seed);  // the same dense model on every rank
  gpt::DenseGpt dense(config);
  std::unique_ptr<Reference> reference;
  if (a.check) {
    gpt::DenseGpt copy(config);
    torch::NoGradGuard no_grad;
    const auto from = dense->named_parameters();
    for (auto& item : copy->named_parameters()) {
      item.value().copy_(from[item.key()]);
    }
    reference = std::make_unique<Reference>(copy, a.bf16, a.lr);
  }
  TORCH_CHECK(a.layers % a.pp == 0, "gpt_3d: --layers must be divisible by --pp");
  const int64_t per_stage = a.layers / a.pp, stage = mesh->pp_rank();
  gpt::GptStage mine(dense,
                     stage * per_stage,
                     per_stage,
                     stage == 0,
                     stage == a.pp - 1,
                     a.sequence_parallel,
                     mesh->tp_group,
                     a.recompute,
                     a.cp > 1 ? mesh->cp_group : nullptr,
                     a.cp_method,
                     mesh->ep_group);
  const int zero = a.bf16 ? 2 : a.zero;
  // Parameters are replicated over data x context ranks (dp_group when cp = 1).
  auto data_parallel = torch_mp::DataParallelOptions().group(mesh->dp_cp_group);
  data_parallel.shard_gradients(zero >= 2);
  if (a.bf16) {
    mine->to(torch::kBFloat16);
    data_parallel.grad_dtype(torch::kFloat);
  }
  torch_mp::DataParallel wrapped(mine, data_parallel);
  // The stage runs forward_all: one tensor or, with MoE layers, the activations and the
  // load-balancing loss so far.
  torch_mp::pipeline::Pipeline pipe(
      {torch_mp::pipeline::stage_of(wrapped,
                                    [mine](const std::vector<at::Tensor>& inputs) mutable {
                                      return mine->forward_all(inputs);
                                    })},
      [mine](const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& target) {
        return mine->loss(outputs, target[0]);
      },
      torch_mp::pipeline::PipelineOptions()
          .schedule(a.schedule)
          .num_microbatches(a.microbatches)
          .group(mesh->pp_group));
  std::vector<at::Tensor> tied;
  if (mine->first != mine->last) {
    tied.push_back(mine->first ? mine->tok->weight : mine->head->weight);
  }
  pipe.tie_parameters(tied);
  const auto parameters = mine->parameters();
  const auto owned_optimizer = make_optimizer(a, parameters, *mesh, zero);
  torch::optim::Optimizer& optimizer = *owned_optimizer;
  const gpt::LearningRate schedule{
      .lr = a.lr, .warmup = a.warmup, .decay_steps = a.decay_steps, .min_lr = a.min_lr};
  if (is_rank0) {
    print_layout(a, config, *mesh, zero);
  }
  // Saved and loaded under DenseGpt's names.
  const std::vector<torch_mp::checkpoint::Stage> stages{{mine.ptr(), mine->dense_names()}};
  int first_step = 1;
  if (a.resume && std::filesystem::exists(a.checkpoint)) {
    TORCH_CHECK(!a.check, "gpt_3d: --check trains the reference from step 1; not with --resume");
    const auto extra = torch_mp::checkpoint::load(a.checkpoint, stages, &optimizer, mesh);
    first_step = std::stoi(extra.at("step")) + 1;
    if (is_rank0) {
      std::printf("resumed from %s after step %d\n", a.checkpoint.c_str(), first_step - 1);
    }
  }
  const int64_t global_batch = a.batch * mesh->dp_size();
  double worst_loss = 0.0, worst_table = 0.0;
  const auto synced = a.check ? scratch_file(a, "sync") : std::string();
  std::shared_ptr<torch_mp::checkpoint::AsyncSave> saving;  // the checkpoint being written
  const auto start = std::chrono::steady_clock::now();
  for (int step = first_step; step <= a.steps; ++step) {
    const auto [inputs, target] = corpus.batch(step, global_batch, a.seq);
    const auto share = [&](const torch::Tensor& t) {
      return t.slice(0, mesh->dp_rank() * a.batch, (mesh->dp_rank() + 1) * a.batch);
    };
    optimizer.zero_grad();
    const auto loss =
        pipe.step(mine->first ? std::vector<at::Tensor>{share(inputs)} : std::vector<at::Tensor>{},
                  mine->last ? std::vector<at::Tensor>{share(target)} : std::vector<at::Tensor>{});
    torch_mp::clip_grad_norm_(parameters, a.clip, 2.0, mesh);
    gpt_3d::set_learning_rate(optimizer, schedule.at(step));
    optimizer.step();
    const double value = batch_loss(loss, *mesh);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::string line =
        progress(step, a.steps, value, global_batch * a.seq * (step - first_step + 1) / seconds);
    if (a.check) {
      // With MoE layers each data rank's micro-batch is a piece of its own (its load-balancing
      // loss that of its own tokens); the loss is the pieces' mean.
      const int64_t pieces = a.moe_experts > 0 ? mesh->dp_size() * a.microbatches : 1;
      const double expected = reference->step(inputs, target, pieces, a.clip, schedule.at(step));
      worst_loss = std::max(worst_loss, std::abs(value - expected));
      // Collectives: compare the token table, then start the next step from the same weights.
      worst_table = std::max(worst_table, gpt_3d::table_difference(mine, reference->model));
      if (step < a.steps) {
        reference->sync(stages, mesh, synced);
      }
      char text[64];
      std::snprintf(text, sizeof(text), "  (one process: %.4f)", expected);
      line += text;
    }
    if (is_rank0) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
    if (a.save_every > 0 && step % a.save_every == 0) {
      saving = torch_mp::checkpoint::async_save(
          a.checkpoint, stages, &optimizer, {{"step", std::to_string(step)}}, mesh);
    }
  }
  if (saving) {
    saving->wait();
    if (is_rank0) {
      std::printf("checkpoints saved in the background to %s\n", a.checkpoint.c_str());
    }
  }
  if (!a.probe.empty()) {
    write_probe(a, corpus, stages, mesh);
  }
  if (a.sample > 0) {
    show_sample(a, corpus, stages, mesh);
  }
  if (!a.check) {
    return EXIT_SUCCESS;
  }
  if (is_rank0 && !synced.empty()) {
    std::filesystem::remove(synced);
  }
  return gpt_3d::agrees(worst_loss, worst_table, a.bf16, *mesh) ? EXIT_SUCCESS : EXIT_FAILURE;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::fprintf(stderr,
                 "gpt_3d (RANK=%s): %s\n",
                 std::getenv("RANK") ? std::getenv("RANK") : "?",
                 e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "gpt_3d (RANK=%s): %s\n",
                 std::getenv("RANK") ? std::getenv("RANK") : "?",
                 e.what());
  }
  return EXIT_FAILURE;
}
