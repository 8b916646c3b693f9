// Bindings of the estimate and the step time (csrc/torch_mp/plan/estimate.h, time.h):
// torch_mp._C.plan_estimate and plan_step_time, which torch_mp.plan calls with plain sizes and
// dicts. Argument conversion only.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "torch_mp/plan/estimate.h"
#include "torch_mp/plan/probe.h"
#include "torch_mp/plan/sizes.h"
#include "torch_mp/plan/time.h"

namespace py = pybind11;

namespace torch_mp::python {

namespace {

// Sets `field` from `fields[key]` where the dict has it.
auto setter(const py::dict& fields) {
  return [&fields](const char* key, auto& field) {
    if (fields.contains(key)) {
      field = fields[key].cast<std::decay_t<decltype(field)>>();
    }
  };
}

plan::Layout layout_of(const py::dict& layout) {
  plan::Layout l;
  const auto get = setter(layout);
  get("tp", l.tp);
  get("pp", l.pp);
  get("dp", l.dp);
  get("cp", l.cp);
  get("ep", l.ep);
  get("zero", l.zero);
  get("sequence_parallel", l.sequence_parallel);
  get("dtype_bytes", l.dtype_bytes);
  get("master_bytes", l.master_bytes);
  get("micro_batch", l.micro_batch);
  get("seq_len", l.seq_len);
  get("num_microbatches", l.num_microbatches);
  get("schedule", l.schedule);
  get("optimizer", l.optimizer);
  get("bucket_cap_mb", l.bucket_cap_mb);
  get("expert_load", l.expert_load);
  std::string recompute = "none";
  get("recompute", recompute);
  if (recompute == "full") {
    l.recompute = plan::Recompute::kFull;
  } else if (recompute == "selective") {
    l.recompute = plan::Recompute::kSelective;
  } else {
    TORCH_CHECK(recompute == "none",
                "plan.estimate: recompute must be None, \"selective\" or \"full\", got \"",
                recompute,
                "\"");
  }
  return l;
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
         const py::dict& layout,
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
        return plan::estimate(model, layout_of(layout));
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
      "torch_mp::plan::estimate over dicts of the layout's fields and a traced model's "
      "(plan::Traced)");
  m.def(
      "plan_expert_load",
      [](int64_t top_k, const py::dict& layout) {
        plan::ModelShape model;
        model.top_k = top_k;
        return plan::detail::expert_load(model, layout_of(layout));
      },
      py::arg("top_k"),
      py::arg("layout"),
      "The rows the busiest rank's experts receive over their balanced share "
      "(plan::Layout::expert_load, or its default)");
  m.def(
      "plan_step_time",
      [](const plan::Estimate& estimate, const py::dict& layout, const py::dict& machine) {
        plan::Machine figures;
        const auto take = setter(machine);
        take("flops", figures.flops);
        take("memory_bandwidth", figures.memory_bandwidth);
        take("links", figures.links);
        take("latency", figures.latency);
        take("op_overhead", figures.op_overhead);
        return plan::step_time(estimate, layout_of(layout), figures);
      },
      py::arg("estimate"),
      py::arg("layout"),
      py::arg("machine"),
      "torch_mp::plan::step_time over dicts of the layout's and the machine's fields (bytes/s)");
}

}  // namespace torch_mp::python
