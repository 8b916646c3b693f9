// Bindings of the estimate and the step time (csrc/torch_mp/plan/estimate.h, time.h):
// torch_mp._C.plan_estimate and plan_step_time, which torch_mp.plan calls with plain sizes and
// dicts. Argument conversion only.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>

#include "torch_mp/errors.h"
#include "torch_mp/plan/estimate.h"
#include "torch_mp/plan/probe.h"
#include "torch_mp/plan/sizes.h"
#include "torch_mp/plan/time.h"

namespace py = pybind11;

namespace torch_mp::python {

namespace {

constexpr const char* kLayoutDoc =
    R"(How a model is laid out and trained: one value, the C++ torch_mp::plan::Layout.

Made from keywords (all but micro_batch and seq_len have defaults), compared by value, hashable,
and changed by copy: ``Layout(dp=8, micro_batch=1, seq_len=2048).replace(zero=1)``.
:func:`torch_mp.plan.estimate`, :func:`~torch_mp.plan.measure` and
:func:`~torch_mp.plan.measure_time` take it (or the same keywords), and
:func:`~torch_mp.plan.search`'s candidates carry it.

Keywords:
    tp, pp, dp, cp, ep: The mesh's sizes (cp: the GPT's, each sequence cut in 2 cp balanced
        chunks; ep: the experts of MoE layers, over groups cut from the dp x cp ranks, at ZeRO 0).
    zero: 0 none; 1 the optimizer state sharded over the data ranks; 2 the gradients too; 3 the
        parameters too (at pp 1).
    recompute: None, "selective" (the attention core) or "full" (each layer).
    dtype: The parameters' and the compute's dtype.
    master_dtype: The optimizer's fp32 masters (and fp32 main gradients) of a 16-bit model.
        None: fp32 masters for a 16-bit dtype (the recipe, which implies zero >= 2 as
        Trainer3D's bf16 does), none for fp32; master_dtype=dtype: none.
    micro_batch, seq_len, num_microbatches: Each data rank's micro-batches per step.
    schedule: The pipeline schedule (torch_mp.pipeline.schedule_names()); the stages each rank
        runs are the schedule's own (torch_mp.pipeline.default_stages_per_rank).
    optimizer: "adamw" or "adam" (two moments per parameter), "sgd" (none).
    sequence_parallel: Activations between the matmuls split over the tensor group.
    bucket_cap_mb: DataParallel's and the distributed optimizer's bucket size.
    expert_load: MoE layers at ep > 1: the rows the busiest rank's experts receive over their
        balanced share (micro_batch * seq_len * top_k). None: what routing at random gives the
        busiest of ep ranks, 1 + sqrt(2 ln ep) * sqrt((ep - 1) / (ep * micro_batch * seq_len *
        top_k)).)";

// Sets `field` from `fields[key]` where the dict has it.
auto setter(const py::dict& fields) {
  return [&fields](const char* key, auto& field) {
    if (fields.contains(key)) {
      field = fields[key].cast<std::decay_t<decltype(field)>>();
    }
  };
}

const char* recompute_name(plan::Recompute r) {
  return r == plan::Recompute::kFull        ? "full"
         : r == plan::Recompute::kSelective ? "selective"
                                            : nullptr;
}

plan::Recompute recompute_of(const std::optional<std::string>& name) {
  if (!name || *name == "none") {
    return plan::Recompute::kNone;
  }
  if (*name == "full") {
    return plan::Recompute::kFull;
  }
  TORCH_MP_CHECK_LAYOUT(*name == "selective",
                        "plan.Layout: recompute must be None, \"selective\" or \"full\", got \"",
                        *name,
                        "\"");
  return plan::Recompute::kSelective;
}

// The keywords a Layout is made of, in the order its repr shows them: what plan.estimate took as
// keywords before it took a Layout (torch_mp.plan.Layout's docstring says what each means).
py::dict keywords_of(const plan::Layout& l) {
  py::dict k;
  k["tp"] = l.tp;
  k["pp"] = l.pp;
  k["dp"] = l.dp;
  k["cp"] = l.cp;
  k["ep"] = l.ep;
  k["zero"] = l.zero;
  const char* recompute = recompute_name(l.recompute);
  k["recompute"] = recompute ? py::object(py::str(recompute)) : py::object(py::none());
  k["dtype"] = l.dtype;
  k["master_dtype"] = l.master_dtype;
  k["micro_batch"] = l.micro_batch;
  k["seq_len"] = l.seq_len;
  k["num_microbatches"] = l.num_microbatches;
  k["schedule"] = l.schedule;
  k["optimizer"] = l.optimizer;
  k["sequence_parallel"] = l.sequence_parallel;
  k["bucket_cap_mb"] = l.bucket_cap_mb;
  k["expert_load"] =
      l.expert_load == 0 ? py::object(py::none()) : py::object(py::float_(l.expert_load));
  return k;
}

// The Layout its keywords make (through the constructor, which checks them).
plan::Layout layout_of(const py::dict& keywords) {
  return py::type::of<plan::Layout>()(**keywords).cast<plan::Layout>();
}

// "Layout(tp=2, dp=4, dtype=torch.bfloat16, micro_batch=1, seq_len=2048)": the fields that differ
// from a default Layout's, and the two that have no default.
std::string repr_of(const plan::Layout& l) {
  const auto mine = keywords_of(l);
  const auto plain = keywords_of(plan::Layout{});
  std::string out = "Layout(";
  for (const auto& [key, value] : mine) {
    const auto name = key.cast<std::string>();
    if (name != "micro_batch" && name != "seq_len" && value.equal(plain[key])) {
      continue;
    }
    out += (out.size() > 7 ? ", " : "") + name + "=" + py::repr(value).cast<std::string>();
  }
  return out + ")";
}

}  // namespace

void bind_plan(py::module_& m) {
  m.def(
      "plan_time_all_reduce",
      [](int64_t elements, const std::string& group, int64_t repeats) {
        return plan::time_all_reduce(group_named(group), elements, repeats);
      },
      py::arg("elements"),
      py::arg("group"),
      py::arg("repeats"),
      py::call_guard<py::gil_scoped_release>(),
      "The median seconds of an all-reduce of `elements` float32 over `group` (probe.h).");
  py::class_<plan::Layout>(m, "Layout", kLayoutDoc)
      .def(py::init([](int64_t micro_batch,
                       int64_t seq_len,
                       int64_t tp,
                       int64_t pp,
                       int64_t dp,
                       int64_t cp,
                       int64_t ep,
                       int zero,
                       const std::optional<std::string>& recompute,
                       at::ScalarType dtype,
                       std::optional<at::ScalarType> master_dtype,
                       int64_t num_microbatches,
                       std::string schedule,
                       std::string optimizer,
                       bool sequence_parallel,
                       double bucket_cap_mb,
                       std::optional<double> expert_load) {
             TORCH_CHECK_TYPE(
                 at::isFloatingType(dtype) && (!master_dtype || at::isFloatingType(*master_dtype)),
                 "plan.Layout: dtype and master_dtype must be floating-point "
                 "torch.dtypes, got ",
                 dtype,
                 " and ",
                 master_dtype ? c10::toString(*master_dtype) : "None");
             plan::Layout l;
             l.tp = tp, l.pp = pp, l.dp = dp, l.cp = cp, l.ep = ep, l.zero = zero;
             l.recompute = recompute_of(recompute);
             l.sequence_parallel = sequence_parallel;
             l.dtype = dtype, l.master_dtype = master_dtype;
             l.micro_batch = micro_batch, l.seq_len = seq_len;
             l.num_microbatches = num_microbatches;
             l.schedule = std::move(schedule), l.optimizer = std::move(optimizer);
             l.bucket_cap_mb = bucket_cap_mb;
             l.expert_load = expert_load.value_or(0.0);
             return l;
           }),
           py::kw_only(),
           py::arg("micro_batch"),
           py::arg("seq_len"),
           py::arg("tp") = 1,
           py::arg("pp") = 1,
           py::arg("dp") = 1,
           py::arg("cp") = 1,
           py::arg("ep") = 1,
           py::arg("zero") = 0,
           py::arg("recompute") = py::none(),
           py::arg("dtype") = at::kFloat,
           py::arg("master_dtype") = py::none(),
           py::arg("num_microbatches") = 1,
           py::arg("schedule") = "1f1b",
           py::arg("optimizer") = "adamw",
           py::arg("sequence_parallel") = false,
           py::arg("bucket_cap_mb") = 25.0,
           py::arg("expert_load") = py::none())
      .def_readonly("tp", &plan::Layout::tp)
      .def_readonly("pp", &plan::Layout::pp)
      .def_readonly("dp", &plan::Layout::dp)
      .def_readonly("cp", &plan::Layout::cp)
      .def_readonly("ep", &plan::Layout::ep)
      .def_readonly("zero", &plan::Layout::zero)
      .def_property_readonly("recompute",
                             [](const plan::Layout& l) -> std::optional<std::string> {
                               const char* name = recompute_name(l.recompute);
                               return name ? std::optional<std::string>(name) : std::nullopt;
                             })
      .def_readonly("dtype", &plan::Layout::dtype)
      .def_readonly("master_dtype", &plan::Layout::master_dtype)
      .def_readonly("micro_batch", &plan::Layout::micro_batch)
      .def_readonly("seq_len", &plan::Layout::seq_len)
      .def_readonly("num_microbatches", &plan::Layout::num_microbatches)
      .def_readonly("schedule", &plan::Layout::schedule)
      .def_readonly("optimizer", &plan::Layout::optimizer)
      .def_readonly("sequence_parallel", &plan::Layout::sequence_parallel)
      .def_readonly("bucket_cap_mb", &plan::Layout::bucket_cap_mb)
      .def_property_readonly("expert_load",
                             [](const plan::Layout& l) -> std::optional<double> {
                               return l.expert_load == 0 ? std::nullopt
                                                         : std::optional<double>(l.expert_load);
                             })
      .def("keywords", &keywords_of, "The layout as the keywords it is made of (a new dict).")
      .def(
          "replace",
          [](const plan::Layout& l, const py::kwargs& changes) {
            auto keywords = keywords_of(l);
            for (const auto& [key, value] : changes) {
              keywords[key] = value;
            }
            return layout_of(keywords);
          },
          "A copy with the keywords given changed: layout.replace(tp=2, zero=1).")
      .def("__repr__", &repr_of)
      .def("__eq__",
           [](const plan::Layout& a, const py::object& b) {
             return py::isinstance<plan::Layout>(b) &&
                    keywords_of(a).equal(keywords_of(b.cast<plan::Layout>()));
           })
      .def(
          "__hash__",
          [](const plan::Layout& l) { return py::hash(py::tuple(keywords_of(l).attr("items")())); })
      .def(py::pickle(&keywords_of, &layout_of));
  using plan::RankEstimate;
  py::class_<RankEstimate>(m, "RankEstimate")
      .def_readonly("kind", &RankEstimate::kind)
      .def_readonly("pipeline_ranks", &RankEstimate::pipeline_ranks)
      .def_readonly("parameters", &RankEstimate::parameters)
      .def_readonly("gradients", &RankEstimate::gradients)
      .def_readonly("optimizer_state", &RankEstimate::optimizer_state)
      .def_readonly("communication_buffers", &RankEstimate::communication_buffers)
      .def_readonly("persistent_buffers", &RankEstimate::persistent_buffers)
      .def_readonly("activations_per_microbatch", &RankEstimate::activations_per_microbatch)
      .def_readonly("microbatches_in_flight", &RankEstimate::microbatches_in_flight)
      .def_readonly("activations", &RankEstimate::activations)
      .def_readonly("accumulating_gradients", &RankEstimate::accumulating_gradients)
      .def_readonly("peak", &RankEstimate::peak)
      .def_property_readonly("between_steps", &RankEstimate::between_steps);
  py::class_<plan::StepTime>(m, "StepTime")
      .def_readonly("seconds", &plan::StepTime::seconds)
      .def_readonly("forward", &plan::StepTime::forward)
      .def_readonly("backward", &plan::StepTime::backward)
      .def_readonly("pipeline", &plan::StepTime::pipeline)
      .def_readonly("bubble_fraction", &plan::StepTime::bubble_fraction)
      .def_readonly("data_parallel", &plan::StepTime::data_parallel)
      .def_readonly("optimizer", &plan::StepTime::optimizer)
      .def_readonly("tokens_per_second", &plan::StepTime::tokens_per_second)
      .def_readonly("communication", &plan::StepTime::communication);
  // (dynamic: torch_mp.plan.estimate attaches the step time of a machine as .time)
  py::class_<plan::Estimate>(m, "Estimate", py::dynamic_attr())
      .def_readonly("ranks", &plan::Estimate::ranks)
      .def_readonly("flops_per_rank", &plan::Estimate::flops_per_rank)
      .def_readonly("bytes_sent", &plan::Estimate::bytes_sent)
      .def("__str__", &plan::Estimate::to_string);
  m.def(
      "plan_estimate",
      [](int64_t vocab,
         int64_t positions,
         int64_t hidden,
         int64_t heads,
         int64_t ffn,
         int64_t layers,
         int64_t experts,
         const plan::Layout& layout,
         const py::object& traced,
         int64_t top_k) {
        plan::ModelShape model{vocab, positions, hidden, heads, ffn, layers, experts};
        model.top_k = top_k;
        if (!traced.is_none()) {
          const auto fields = traced.cast<py::dict>();
          const auto take = setter(fields);
          plan::Traced t;
          take("layer_parameters", t.layer_parameters);
          take("first_parameters", t.first_parameters);
          take("last_parameters", t.last_parameters);
          take("first_units", t.first_units);
          take("tied_head", t.tied_head);
          take("layer_activations", t.layer_activations);
          take("layer_input", t.layer_input);
          take("layer_backward", t.layer_backward);
          take("first_activations", t.first_activations);
          take("last_activations", t.last_activations);
          take("last_backward", t.last_backward);
          take("layer_flops", t.layer_flops);
          take("last_flops", t.last_flops);
          take("layer_operators", t.layer_operators);
          take("last_operators", t.last_operators);
          model.traced = std::move(t);
        }
        return plan::estimate(model, layout);
      },
      py::arg("vocab"),
      py::arg("positions"),
      py::arg("hidden"),
      py::arg("heads"),
      py::arg("ffn"),
      py::arg("layers"),
      py::arg("experts"),
      py::arg("layout"),
      py::arg("traced") = py::none(),
      py::arg("top_k") = 2,
      "torch_mp::plan::estimate of a Layout, over a traced model's fields (plan::Traced)");
  m.def(
      "plan_gpt_operators",
      [](bool tp, bool sp, bool moe, bool ep) {
        const auto& o = plan::kGptOperators;
        py::dict d;
        d["layer"] = (moe ? o.moe_layer : o.layer).at(tp, sp, moe, ep);
        d["embeddings"] = o.embeddings.at(tp, sp, moe, ep);
        d["head_and_loss"] = o.head_and_loss.at(tp, sp, moe, ep);
        return d;
      },
      py::arg("tp"),
      py::arg("sp"),
      py::arg("moe"),
      py::arg("ep"),
      "What plan::kGptOperators counts for a GPT's layer, embeddings and head with the loss at "
      "tp > 1, sequence parallelism, MoE layers and ep > 1 (each true or false)");
  m.def(
      "plan_expert_load",
      [](int64_t top_k, const plan::Layout& layout) {
        plan::ModelShape model;
        model.top_k = top_k;
        return plan::detail::expert_load(model, layout);
      },
      py::arg("top_k"),
      py::arg("layout"),
      "The rows the busiest rank's experts receive over their balanced share "
      "(plan::Layout::expert_load, or its default)");
  m.def(
      "plan_step_time",
      [](const plan::Estimate& estimate, const plan::Layout& layout, const py::dict& machine) {
        plan::Machine figures;
        const auto take = setter(machine);
        take("flops", figures.flops);
        take("memory_bandwidth", figures.memory_bandwidth);
        take("links", figures.links);
        take("latency", figures.latency);
        take("op_overhead", figures.op_overhead);
        return plan::step_time(estimate, layout, figures);
      },
      py::arg("estimate"),
      py::arg("layout"),
      py::arg("machine"),
      "torch_mp::plan::step_time of a Layout, over a dict of the machine's fields (bytes/s)");
}

}  // namespace torch_mp::python
