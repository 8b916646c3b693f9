#include "torch_mp/plan/estimate.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <set>

#include "torch_mp/data_parallel/shard_layout.h"
#include "torch_mp/errors.h"
#include "torch_mp/pipeline/schedule.h"
#include "torch_mp/plan/sizes.h"

namespace torch_mp::plan {

namespace detail {

Parts parts_of(const Sizes& z) {
  const bool split = z.stages > 1;
  if (z.traced != nullptr) {
    Parts parts{z.traced->first_parameters, z.traced->layer_parameters, z.traced->last_parameters};
    if (z.traced->tied_head && split) {
      parts.last.push_back(parts.first.at(0));  // the head: a copy of the token embedding
    }
    return parts;
  }
  const int64_t h = z.h, t = z.t;
  Parts parts{
      // the token embedding (padded to a multiple of tp rows), the whole position table
      {{z.vocab_shard, h}, {z.positions, h}},
      // in_proj, out_proj, norm1 and norm2 (no biases), linear1, linear2
      {{3 * h / t, h}, {h, h / t}, {h}, {h}, {z.f / t, h}, {h, z.f / t}},
      {{h}, {h}},  // the final norm's weight and bias
  };
  if (z.moe()) {
    parts.layer = moe_layer_parameters(z);
  }
  if (split) {
    parts.last.push_back({z.vocab_shard, h});  // the head: a copy of the token embedding
  }
  return parts;
}

}  // namespace detail

namespace {

using data_parallel::ShardLayout;
using pipeline::ActionKind;
using namespace detail;  // NOLINT(google-build-using-namespace): the counts' sizes

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t size : shape) {
    n *= size;
  }
  return n;
}

// Parameters of stage `i`, in the order the stage holds them, each with its ZeRO-3 unit (0 for
// the ends unless the trace says, 1 + j for the stage's layer j).
void stage_parameters(const Sizes& z,
                      int64_t i,
                      std::vector<int64_t>& numel,
                      std::vector<size_t>& unit) {
  const Parts parts = parts_of(z);
  const auto add = [&](const Shapes& shapes, size_t u) {
    for (const auto& shape : shapes) {
      numel.push_back(numel_of(shape));
      unit.push_back(u);
    }
  };
  if (i == 0) {
    const auto& units = z.traced != nullptr ? z.traced->first_units : std::vector<int64_t>{};
    for (size_t k = 0; k < parts.first.size(); ++k) {
      numel.push_back(numel_of(parts.first[k]));
      unit.push_back(k < units.size() ? static_cast<size_t>(units[k]) : 0);
    }
  }
  for (int64_t j = 0; j < z.per_stage; ++j) {
    add(parts.layer, static_cast<size_t>(1 + j));
  }
  if (i == z.stages - 1) {
    add(parts.last, 0);
  }
}

// Buckets of ZeRO's flat layout (data_parallel::ShardLayout, on meta tensors of the shapes).
ShardLayout buckets_of(const std::vector<int64_t>& numel,
                       const std::vector<size_t>& units,
                       const Sizes& z,
                       const Layout& l) {
  std::vector<at::Tensor> meta;
  const auto dtype = z.d == 2 ? at::kBFloat16 : at::kFloat;
  for (const int64_t n : numel) {
    meta.push_back(at::empty({n}, at::TensorOptions().dtype(dtype).device(at::kMeta)));
  }
  return ShardLayout::of(meta, l.dp, 0, l.bucket_cap_mb, "plan.estimate", units);
}

// Operators one micro-batch's forward through stage `i` dispatches (each costs
// Machine::op_overhead): a traced model's as traced, the GPT's from kGptOperators.
int64_t operator_calls(const Sizes& z, int64_t i) {
  const bool last = i == z.stages - 1;
  if (z.traced != nullptr) {
    return z.per_stage * z.traced->layer_operators + (last ? z.traced->last_operators : 0);
  }
  const auto& ops = kGptOperators;
  const auto count = [&z](const OperatorCount& part) {
    return part.at(z.t > 1, z.sigma < 1.0, z.moe(), z.ep > 1);
  };
  return z.per_stage * count(z.moe() ? ops.moe_layer : ops.layer) +
         (i == 0 ? count(ops.embeddings) : 0) + (last ? count(ops.head_and_loss) : 0);
}

struct Walk {
  int64_t worst = 0;  // activations + transients + accumulating .grad + buffers at the peak
  int64_t activations = 0, accumulating = 0, buffers = 0, in_flight = 0;
};

// Replays pipeline rank `rank`'s actions: each F adds its micro-batch's activations, a B of a
// split backward adds what its W needs, BW (B on the first stage, which has no input gradient;
// W elsewhere) frees them. At each backward action, what is alive then.
Walk walk(const pipeline::Schedule& schedule,
          int64_t rank,
          const Sizes& z,
          const Layout& l,
          int64_t param_grad_bytes,
          int64_t gathered) {
  std::map<std::pair<int64_t, int64_t>, int64_t> live;
  // Messages (an activation or its gradient, packed with its header) held for each neighbouring
  // pipeline rank: per micro-batch in flight (two at most) one each way, a send not yet waited
  // for and a receive.
  const int64_t message = static_cast<int64_t>(z.d * z.n * z.h * z.sigma) + 64;
  std::set<int64_t> neighbours;
  for (const int64_t i : schedule.stages_of_rank(rank)) {
    for (const int64_t j : {i - 1, i + 1}) {
      if (j >= 0 && j < z.stages && schedule.rank_of_stage(j) != rank) {
        neighbours.insert(schedule.rank_of_stage(j));
      }
    }
  }
  const auto peers = static_cast<int64_t>(neighbours.size());
  bool gradients_made = false;
  Walk result;
  for (const auto& action : schedule.actions[static_cast<size_t>(rank)]) {
    const auto key = std::make_pair(action.stage, action.microbatch);
    if (action.kind == ActionKind::kForward) {
      live[key] = stage_activations(z, l, action.stage);
      result.in_flight = std::max<int64_t>(result.in_flight, static_cast<int64_t>(live.size()));
      continue;
    }
    const bool weight = action.kind == ActionKind::kBackwardWeight;
    if (!pipeline::is_compute(action.kind) || (weight && !live.count(key))) {
      continue;  // (the first stage's W: its B did everything)
    }
    int64_t held = 0;
    for (const auto& entry : live) {
      held += entry.second;
    }
    const int64_t transient = backward_transient(z, l, action.stage, weight);
    // (with fp32 main gradients the backward adds into them: no .grad accumulates)
    const int64_t accumulating = gradients_made && !z.masters ? param_grad_bytes : 0;
    const int64_t buffers =
        2 * std::min<int64_t>(static_cast<int64_t>(live.size()), 2) * peers * message + gathered;
    const int64_t total = held + transient + accumulating + buffers;
    if (total > result.worst) {
      result = {total, held + transient, accumulating, buffers, result.in_flight};
    }
    if (action.kind == ActionKind::kFullBackward || weight || action.stage == 0) {
      live.erase(key);
      gradients_made = true;
    } else {
      live[key] += weight_work(z, action.stage);
    }
  }
  return result;
}

// Of those, the attention core's (the GPT's; a traced decoder's are not told apart).
double attention_flops(const Sizes& z) {
  // (each context rank's queries against the whole sequence's keys, causal: half of 4nsh)
  return z.traced != nullptr ? 0.0 : z.per_stage * 2.0 * z.n * z.s * z.h / z.t;
}

// Floating-point operations of one micro-batch's forward through stage `i`.
double forward_flops(const Sizes& z, int64_t i) {
  if (z.traced != nullptr) {
    return z.per_stage * z.traced->layer_flops + (i == z.stages - 1 ? z.traced->last_flops : 0);
  }
  const double matmuls = 2.0 * z.n * (4.0 * z.h * z.h + 2.0 * z.h * z.f) / z.t;
  // QK^T and AV, causal: half of 4nsh
  double flops =
      z.moe() ? z.per_stage * moe_layer_flops(z) : z.per_stage * matmuls + attention_flops(z);
  if (i == z.stages - 1) {
    flops += 2.0 * z.n * z.h * z.vocab_shard;
  }
  return flops;
}

}  // namespace

Estimate estimate(const ModelShape& model, const Layout& layout) {
  check_layout(model, layout);
  Layout l = layout;
  l.dp *= l.cp;  // the gradients are reduced, and ZeRO shards, over the data x context ranks
  const int64_t master_bytes = l.master_bytes();
  if (master_bytes != 0) {
    l.zero = std::max(l.zero, 2);  // the recipe: fp32 main gradients in ZeRO-2's buckets
  }
  const int64_t stages_per_rank = pipeline::default_stages_per_rank(l.schedule);
  const int64_t stages = l.pp * stages_per_rank;
  TORCH_MP_CHECK_LAYOUT(
      l.zero < 2 || stages_per_rank == 1,
      "plan.estimate: ZeRO-",
      l.zero,
      " with two stages per rank (",
      l.schedule,
      ") is not supported: each stage is its own DataParallel, which one "
      "DistributedOptimizer cannot span; use zero=1 or a schedule of one stage per rank");
  TORCH_MP_CHECK_LAYOUT(model.layers % stages == 0,
                        "plan.estimate: ",
                        model.layers,
                        " layers cannot be cut into ",
                        stages,
                        " equal stages (pp=",
                        l.pp,
                        ", schedule ",
                        l.schedule,
                        ")");
  const Sizes z{l.tp,
                model.hidden,
                model.ffn,
                model.heads,
                ceil_div(model.vocab, l.tp),
                model.positions,
                l.micro_batch * l.seq_len / l.cp,
                l.seq_len,
                l.cp,
                l.dtype_bytes(),
                stages,
                model.layers / stages,
                l.sequence_parallel ? 1.0 / static_cast<double>(l.tp) : 1.0,
                master_bytes != 0,
                model.traced ? &*model.traced : nullptr,
                model.experts,
                model.top_k,
                l.ep,
                expert_load(model, l)};
  const auto schedule =
      pipeline::make_schedule(l.schedule, stages, l.num_microbatches, stages_per_rank);
  const int64_t moments = l.optimizer == "sgd" ? 0 : 2;
  const int64_t state_bytes = z.masters ? master_bytes : z.d;

  Estimate result;
  std::vector<RankEstimate> rows;
  for (int64_t r = 0; r < l.pp; ++r) {
    RankEstimate row;
    std::vector<int64_t> all_numel;
    std::vector<ShardLayout> per_stage;
    for (const int64_t i : schedule.stages_of_rank(r)) {
      std::vector<int64_t> numel;
      std::vector<size_t> units;
      stage_parameters(z, i, numel, units);
      all_numel.insert(all_numel.end(), numel.begin(), numel.end());
      per_stage.push_back(buckets_of(numel, l.zero == 3 ? units : std::vector<size_t>{}, z, l));
    }
    int64_t numel = 0;
    for (const int64_t n : all_numel) {
      numel += n;
    }
    // ZeRO-1: the optimizer's own layout over all the rank's parameters; ZeRO-2/3: each stage's
    // DataParallel's.
    std::vector<ShardLayout> layouts =
        l.zero == 1 ? std::vector<ShardLayout>{buckets_of(all_numel, {}, z, l)} : per_stage;
    int64_t chunks = 0, padded = 0, largest = 0;
    for (const auto& shard_layout : layouts) {
      for (const auto& bucket : shard_layout.buckets) {
        chunks += bucket.chunk;
        padded += bucket.chunk * l.dp;
        largest = std::max(largest, bucket.chunk * l.dp);
      }
    }
    const int64_t owned = l.zero >= 1 ? chunks : numel;
    if (l.zero >= 2) {  // each stage's DataParallel's sharded state, by its own arithmetic
      const auto grad_dtype = z.masters ? std::optional<at::ScalarType>(at::kFloat) : std::nullopt;
      for (const auto& stage_layout : per_stage) {
        const auto held = data_parallel::sharded_bytes(stage_layout, l.dp, grad_dtype, l.zero == 3);
        row.gradients += held.main_gradients + held.reduced_gradients;
        row.persistent_buffers += held.staging;
        row.parameters += held.parameter_shards;
      }
    } else {  // DataParallel's flat gradient buffer
      row.gradients = numel * z.d;
    }
    if (l.zero < 3) {  // ZeRO-1/2: flat buckets, the parameters views of them
      row.parameters = l.zero >= 1 && l.dp > 1 ? padded * z.d : numel * z.d;
    }
    row.optimizer_state = owned * moments * state_bytes + (z.masters ? owned * master_bytes : 0);
    const int64_t gathered = l.zero == 3 ? 2 * largest * z.d : 0;  // this unit and the next
    const Walk w = walk(schedule, r, z, l, numel * z.d, gathered);
    for (const int64_t i : schedule.stages_of_rank(r)) {
      row.activations_per_microbatch += stage_activations(z, l, i);
    }
    row.microbatches_in_flight = w.in_flight;
    row.activations = w.activations;
    row.accumulating_gradients = w.accumulating;
    row.communication_buffers = row.persistent_buffers + w.buffers;
    row.peak = row.between_steps() + w.worst;
    row.pipeline_ranks = {r};
    rows.push_back(row);
  }
  // One row per kind of rank: the first stage's, the last's, and the middle ones' (one row for
  // those that come out the same, "pipeline rank r" for one that does not).
  const int64_t last = l.pp - 1;
  for (int64_t r = 0; r <= last; ++r) {
    RankEstimate& row = rows[static_cast<size_t>(r)];
    row.kind = r == 0 && r == last ? "every rank"
               : r == 0            ? "first stage"
               : r == last         ? "last stage"
                                   : "pipeline rank " + std::to_string(r);
    auto same = std::find_if(result.ranks.begin(), result.ranks.end(), [&](const RankEstimate& e) {
      const int64_t other = e.pipeline_ranks[0];
      return r != last && other != 0 && e.peak == row.peak &&
             e.between_steps() == row.between_steps();
    });
    if (same != result.ranks.end()) {
      same->pipeline_ranks.push_back(r);
      same->kind = "middle stages";
    } else {
      result.ranks.push_back(row);
    }
  }
  // Work and traffic of a step on the busiest rank.
  const double recompute_share = l.recompute == Recompute::kFull ? 1.0 : 0.0;
  double flops = 0;
  double pp_bytes = 0;
  for (int64_t r = 0; r < l.pp; ++r) {
    double rank_flops = 0, rank_pp = 0;
    for (const int64_t i : schedule.stages_of_rank(r)) {
      const double repeated = l.recompute == Recompute::kSelective ? attention_flops(z) : 0.0;
      rank_flops += ((3.0 + recompute_share) * forward_flops(z, i) + repeated) * l.num_microbatches;
      const int64_t neighbours = (i > 0 ? 1 : 0) + (i + 1 < stages ? 1 : 0);
      rank_pp += neighbours * z.d * z.n * z.h * z.sigma * l.num_microbatches;
    }
    flops = std::max(flops, rank_flops);
    pp_bytes = std::max(pp_bytes, rank_pp);
  }
  result.flops_per_rank = flops;
  const double ring = 2.0 * static_cast<double>(l.tp - 1) / static_cast<double>(l.tp);
  Layout kept = l;  // (what each stage saves without recomputation)
  kept.recompute = Recompute::kNone;
  // Per layer, two all-reduces of [n, h] (or, under sequence parallelism, all-gathers and
  // reduce-scatters of the same volume), as many in the backward; one in a MoE layer (its
  // experts run whole on every tensor rank).
  const int64_t tp_collectives = l.tp > 1 ? (z.moe() ? 1 : 2) * z.per_stage : 0;
  for (int64_t i = 0; i < stages; ++i) {
    result.stages.push_back({forward_flops(z, i),
                             operator_calls(z, i),
                             attention_flops(z),
                             stage_activations(z, kept, i),
                             tp_collectives * ring * z.d * z.n * z.h,
                             tp_collectives,
                             // the ring's keys and values, cp - 1 steps a layer
                             2.0 * (z.c - 1) * z.d * z.n * z.h / z.t * z.per_stage,
                             (z.c - 1) * z.per_stage,
                             z.per_stage * moe_layer_ep_bytes(z),
                             l.ep > 1 ? 2 * z.per_stage : 0});
  }
  result.pp_message_bytes = static_cast<double>(z.d) * z.n * z.h * z.sigma;
  result.bytes_sent["tp"] = 2.0 * result.stages.front().tp_bytes * stages_per_rank *
                            static_cast<double>(l.num_microbatches);
  result.bytes_sent["pp"] = pp_bytes;
  // (the backward's ring carries the gradients too: twice the forward's)
  result.bytes_sent["cp"] = (3.0 + recompute_share) * result.stages.front().cp_bytes *
                            stages_per_rank * static_cast<double>(l.num_microbatches);
  // (the all-to-alls' backwards are all-to-alls of the same volume)
  result.bytes_sent["ep"] = 2.0 * result.stages.front().ep_bytes * stages_per_rank *
                            static_cast<double>(l.num_microbatches);
  const int64_t grad_bytes = z.masters ? master_bytes : z.d;
  int64_t rank_numel = 0;
  for (const int64_t r : schedule.stages_of_rank(0)) {
    std::vector<int64_t> numel;
    std::vector<size_t> units;
    stage_parameters(z, r, numel, units);
    for (const int64_t n : numel) {
      rank_numel += n;
    }
  }
  const auto share_of = [](int64_t group) {
    return group > 1 ? static_cast<double>(group - 1) / static_cast<double>(group) : 0.0;
  };
  const double share = share_of(l.dp);
  // DDP: the gradients all-reduced; ZeRO-1/2: reduce-scattered and the parameters all-gathered;
  // ZeRO-3: gathered twice (forward, backward). The experts' gradients (ep > 1, ZeRO 0) are
  // all-reduced over the ranks that hold the same experts.
  double dp_bytes = l.zero == 0   ? 2.0 * share * rank_numel * grad_bytes
                    : l.zero <= 2 ? share * rank_numel * (grad_bytes + z.d)
                                  : share * rank_numel * (grad_bytes + 2 * z.d);
  if (l.ep > 1) {
    double expert_numel = 0;  // (the experts' stacked weights: a layer's 3-d parameters)
    for (const auto& shape : parts_of(z).layer) {
      expert_numel += shape.size() == 3 ? static_cast<double>(numel_of(shape)) : 0.0;
    }
    expert_numel *= static_cast<double>(z.per_stage * stages_per_rank);
    dp_bytes -= 2.0 * (share - share_of(l.dp / l.ep)) * expert_numel * grad_bytes;
  }
  result.bytes_sent["dp"] = dp_bytes;
  result.dp_gathered_bytes = l.zero == 0 ? 0.0 : dp_bytes - share * rank_numel * grad_bytes;
  return result;
}

}  // namespace torch_mp::plan
