#include "torch_mp/plan/time.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "torch_mp/pipeline/schedule.h"
#include "torch_mp/pipeline/simulate.h"

namespace torch_mp::plan {

StepTime step_time(const Estimate& e, const Layout& l, const Machine& m) {
  TORCH_CHECK_VALUE(m.flops > 0 && m.memory_bandwidth > 0,
                    "plan: the machine needs flops and memory_bandwidth above 0, got flops=",
                    m.flops,
                    ", memory_bandwidth=",
                    m.memory_bandwidth);
  TORCH_CHECK(!e.stages.empty() && static_cast<int64_t>(e.stages.size()) % l.pp == 0,
              "plan: the estimate has no stages of this layout (pp=",
              l.pp,
              ")");
  const auto link = [&m](const char* dimension, int64_t size) {
    if (size == 1) {
      return 0.0;
    }
    const auto it = m.links.find(dimension);
    TORCH_CHECK_VALUE(it != m.links.end() && it->second > 0,
                      "plan: the machine has no link for \"",
                      dimension,
                      "\" (",
                      dimension,
                      "=",
                      size,
                      "): give its bytes/s in links");
    return it->second;
  };
  // A ring collective of p ranks takes 2 (p - 1) messages' latency.
  const auto ring_latency = [&m](int64_t p) {
    return 2.0 * static_cast<double>(p - 1) * m.latency;
  };
  const int64_t data = l.dp * l.cp;  // (the gradients are reduced over the data x context ranks)
  const double tp_link = link("tp", l.tp), pp_link = link("pp", l.pp), dp_link = link("dp", data);
  const double cp_link = link("cp", l.cp), ep_link = link("ep", l.ep);
  const auto stages = static_cast<int64_t>(e.stages.size());
  const int64_t per_rank = stages / l.pp;
  const double recompute = l.recompute == Recompute::kFull ? 1.0 : 0.0;

  StepTime t;
  // the busiest stage's, both ways
  double tp_per_microbatch = 0, cp_per_microbatch = 0, ep_per_microbatch = 0;
  for (const StageWork& s : e.stages) {
    // Matmuls at the machine's rate (and each operator's overhead), and the elementwise work as
    // traffic: what the forward saves is written once and read back (the backward moves about twice
    // as much).
    const double compute = s.forward_flops / m.flops +
                           static_cast<double>(s.operators) * m.op_overhead +
                           2.0 * s.saved_bytes / m.memory_bandwidth;
    const double tp =
        l.tp > 1 ? s.tp_bytes / tp_link + static_cast<double>(s.tp_messages) * ring_latency(l.tp)
                 : 0.0;
    // (the context ring's steps, counted as not hidden behind the attention)
    const double cp =
        l.cp > 1 ? s.cp_bytes / cp_link + static_cast<double>(s.cp_messages) * m.latency : 0.0;
    // (an all-to-all of p ranks: p - 1 messages)
    const double ep = l.ep > 1
                          ? s.ep_bytes / ep_link + static_cast<double>(s.ep_messages) *
                                                       static_cast<double>(l.ep - 1) * m.latency
                          : 0.0;
    t.forward = std::max(t.forward, compute + tp + cp + ep);
    const double repeated = l.recompute == Recompute::kSelective ? s.attention_flops / m.flops : 0;
    t.backward = std::max(t.backward,
                          (2.0 + recompute) * compute + repeated + (1.0 + recompute) * tp +
                              (2.0 + recompute) * cp +  // (the ring carries gradients back too)
                              ep);
    tp_per_microbatch = std::max(tp_per_microbatch, (2.0 + recompute) * tp);
    cp_per_microbatch = std::max(cp_per_microbatch, (3.0 + recompute) * cp);
    ep_per_microbatch = std::max(ep_per_microbatch, 2.0 * ep);
  }
  pipeline::CostModel costs;
  costs.forward = t.forward;
  costs.backward = t.backward;
  costs.comm = l.pp > 1 ? e.pp_message_bytes / pp_link + m.latency : 0.0;
  const auto schedule = pipeline::make_schedule(l.schedule, stages, l.num_microbatches, per_rank);
  const auto replay = pipeline::simulate(schedule, costs);
  t.pipeline = replay.makespan;
  t.bubble_fraction = replay.bubble_fraction;

  // DataParallel reduces each bucket as the last micro-batch's backward fills it: what outlasts
  // that backward stays exposed (and the last bucket at least); ZeRO's parameter gathers wait.
  const double dp_bytes = e.bytes_sent.count("dp") ? e.bytes_sent.at("dp") : 0.0;
  const double reduced = dp_bytes - e.dp_gathered_bytes;
  double reduce = 0, gather = 0;
  if (data > 1) {
    const double bucket = l.bucket_cap_mb * 1048576.0;
    const double buckets = std::max(1.0, std::ceil(reduced / bucket));
    reduce = reduced / dp_link + buckets * ring_latency(data);
    gather = e.dp_gathered_bytes > 0 ? e.dp_gathered_bytes / dp_link + buckets * ring_latency(data)
                                     : 0.0;
    t.data_parallel = std::max(reduce - t.backward, reduce / buckets) + gather;
  }
  // The optimizer reads and writes its state and the parameters it owns, and reads their
  // gradients.
  for (const RankEstimate& row : e.ranks) {
    const int64_t owners = l.zero >= 1 && l.zero < 3 ? data : 1;
    const double traffic = 2.0 * row.optimizer_state + 2.0 * row.parameters / owners +
                           static_cast<double>(row.gradients) / (l.zero == 1 ? data : 1);
    t.optimizer = std::max(t.optimizer, traffic / m.memory_bandwidth);
  }
  t.seconds = t.pipeline + t.data_parallel + t.optimizer;
  const double tokens = static_cast<double>(l.dp * l.micro_batch * l.seq_len * l.num_microbatches);
  t.tokens_per_second = tokens / t.seconds;
  t.communication["tp"] = tp_per_microbatch * per_rank * l.num_microbatches;
  t.communication["pp"] = l.pp > 1 ? e.bytes_sent.at("pp") / pp_link : 0.0;
  t.communication["dp"] = reduce + gather;
  t.communication["cp"] = cp_per_microbatch * per_rank * l.num_microbatches;
  t.communication["ep"] = ep_per_microbatch * per_rank * l.num_microbatches;
  return t;
}

}  // namespace torch_mp::plan
