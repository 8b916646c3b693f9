// pybind11 bindings of the pipeline schedule IR and simulator (torch_mp._C.pipeline).

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <sstream>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "torch_mp/pipeline/executor.h"
#include "torch_mp/pipeline/partition.h"
#include "torch_mp/pipeline/pipeline.h"
#include "torch_mp/pipeline/schedule.h"
#include "torch_mp/pipeline/simulate.h"
#include "torch_mp/split_backward.h"

namespace py = pybind11;

namespace torch_mp::python {

void bind_pipeline(py::module_& parent) {
  using namespace torch_mp::pipeline;
  auto m = parent.def_submodule("pipeline", "Pipeline schedules and their simulator");

  py::class_<Action>(m, "Action", "One step of one rank: a kind on a (stage, micro-batch).")
      .def(py::init([](const std::string& kind, int64_t stage, int64_t microbatch) {
             auto action = Action::parse(kind + "(" + std::to_string(stage) + "," +
                                         std::to_string(microbatch) + ")");
             return action;
           }),
           py::arg("kind"),
           py::arg("stage"),
           py::arg("microbatch"))
      .def_property_readonly("kind", [](const Action& a) { return kind_name(a.kind); })
      .def_readonly("stage", &Action::stage)
      .def_readonly("microbatch", &Action::microbatch)
      .def_property_readonly("is_compute", [](const Action& a) { return is_compute(a.kind); })
      .def_static("parse", &Action::parse, py::arg("text"))
      .def("__eq__", &Action::operator==)
      .def("__hash__",
           [](const Action& a) {
             return py::hash(py::make_tuple(static_cast<int>(a.kind), a.stage, a.microbatch));
           })
      .def("__str__", &Action::to_string)
      .def("__repr__", [](const Action& a) { return "Action(" + a.to_string() + ")"; });

  py::class_<Schedule>(m, "Schedule", "Every pipeline rank's ordered actions.")
      .def(py::init<>())
      .def_readwrite("name", &Schedule::name)
      .def_readwrite("num_stages", &Schedule::num_stages)
      .def_readwrite("num_microbatches", &Schedule::num_microbatches)
      .def_readwrite("stages_per_rank", &Schedule::stages_per_rank)
      .def_readwrite("actions", &Schedule::actions)
      .def_property(
          "placement",
          [](const Schedule& s) { return placement_name(s.placement); },
          [](Schedule& s, const std::string& name) {
            TORCH_CHECK(name == "loop" || name == "v",
                        "torch_mp.pipeline: placement must be 'loop' or 'v', got '",
                        name,
                        "'");
            s.placement = name == "v" ? Placement::kV : Placement::kLoop;
          })
      .def_property_readonly("num_ranks", &Schedule::num_ranks)
      .def("rank_of_stage", &Schedule::rank_of_stage, py::arg("stage"))
      .def("stages_of_rank", &Schedule::stages_of_rank, py::arg("rank"))
      .def_static("parse", &Schedule::parse, py::arg("text"))
      .def("__str__", &Schedule::to_string)
      .def("__repr__", [](const Schedule& s) {
        return "Schedule(" + s.name + ", num_stages=" + std::to_string(s.num_stages) +
               ", num_microbatches=" + std::to_string(s.num_microbatches) +
               ", stages_per_rank=" + std::to_string(s.stages_per_rank) +
               (s.placement == Placement::kV ? ", placement=v" : "") + ")";
      });

  py::class_<TimedAction>(m, "TimedAction")
      .def_readonly("rank", &TimedAction::rank)
      .def_readonly("action", &TimedAction::action)
      .def_readonly("start", &TimedAction::start)
      .def_readonly("end", &TimedAction::end);

  py::class_<SimulationResult>(m, "SimulationResult")
      .def_readonly("makespan", &SimulationResult::makespan)
      .def_readonly("bubble_fraction", &SimulationResult::bubble_fraction)
      .def_readonly("busy", &SimulationResult::busy)
      .def_readonly("peak_live_microbatches", &SimulationResult::peak_live_microbatches)
      .def_readonly("timeline", &SimulationResult::timeline)
      .def("__repr__", [](const SimulationResult& r) {
        std::ostringstream out;
        out << "SimulationResult(makespan=" << r.makespan
            << ", bubble_fraction=" << r.bubble_fraction << ")";
        return out.str();
      });

  py::class_<Stage>(m, "Stage", "A stage's forward and the parameters its W differentiates.")
      .def(py::init([](std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> fn,
                       std::vector<at::Tensor> parameters,
                       std::optional<std::function<void()>> arm_gradient_sync) {
             return Stage{std::move(fn),
                          std::move(parameters),
                          arm_gradient_sync.value_or(std::function<void()>())};
           }),
           py::arg("forward"),
           py::arg("parameters"),
           py::arg("arm_gradient_sync") = py::none());

  py::class_<Pipeline>(m, "Pipeline", "Runs this rank's stages under a pipeline schedule.")
      .def(py::init([](std::vector<Stage> stages,
                       LossFn loss,
                       const std::string& schedule,
                       int64_t num_microbatches,
                       const std::string& group) {
             return std::make_unique<Pipeline>(std::move(stages),
                                               std::move(loss),
                                               PipelineOptions()
                                                   .schedule(schedule)
                                                   .num_microbatches(num_microbatches)
                                                   .group(c10d::resolve_process_group(group)));
           }),
           py::arg("stages"),
           py::arg("loss"),
           py::arg("schedule"),
           py::arg("num_microbatches"),
           py::arg("group"),
           py::call_guard<py::gil_scoped_release>())
      .def(py::init([](std::vector<Stage> stages,
                       LossFn loss,
                       Schedule schedule,
                       const std::string& group) {
             return std::make_unique<Pipeline>(std::move(stages),
                                               std::move(loss),
                                               std::move(schedule),
                                               c10d::resolve_process_group(group));
           }),
           py::arg("stages"),
           py::arg("loss"),
           py::arg("schedule"),
           py::arg("group"),
           py::call_guard<py::gil_scoped_release>())
      // Construction communicates and the autograd engine refuses to run under the GIL, so both
      // release it; the stage and loss callbacks take it back while they run Python.
      .def("step",
           &Pipeline::step,
           py::arg("inputs"),
           py::arg("targets"),
           py::call_guard<py::gil_scoped_release>())
      .def("eval_step",
           &Pipeline::eval_step,
           py::arg("inputs"),
           py::arg("targets"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "tie_parameters",
          [](Pipeline& pipe, std::vector<at::Tensor> parameters, const std::string& group) {
            pipe.tie_parameters(std::move(parameters),
                                group.empty() ? GroupPtr() : c10d::resolve_process_group(group));
          },
          py::arg("parameters"),
          py::arg("group"),
          py::call_guard<py::gil_scoped_release>())
      .def("reset",
           &Pipeline::reset,
           py::arg("store"),
           py::arg("key"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_check_finite", &Pipeline::set_check_finite, py::arg("on"))
      .def_property_readonly("trace", &Pipeline::trace)
      .def("gathered_trace", &Pipeline::gathered_trace, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("schedule", &Pipeline::schedule)
      .def_property_readonly("ordered", &Pipeline::ordered);

  py::class_<WeightWork>(m, "WeightWork", "What B kept for W (split_backward.h).");
  m.def(
      "backward_input",
      [](const std::vector<at::Tensor>& outputs,
         const std::vector<at::Tensor>& output_grads,
         const std::vector<at::Tensor>& inputs,
         const std::vector<at::Tensor>& parameters) {
        WeightWork work;
        auto grads = backward_input(outputs, output_grads, inputs, parameters, work);
        std::vector<std::optional<at::Tensor>> out;
        for (auto& g : grads) {
          out.push_back(g.defined() ? std::optional<at::Tensor>(std::move(g)) : std::nullopt);
        }
        return std::make_pair(out, std::move(work));
      },
      py::arg("outputs"),
      py::arg("output_grads"),
      py::arg("inputs"),
      py::arg("parameters"),
      py::call_guard<py::gil_scoped_release>());
  m.def("backward_weight",
        &backward_weight,
        py::arg("work"),
        py::call_guard<py::gil_scoped_release>());
  m.def("make_nccl_safe", &make_nccl_safe, py::arg("schedule"));
  m.def("balanced_partition", &balanced_partition, py::arg("costs"), py::arg("num_stages"));
  m.def("schedule_names", &schedule_names);
  m.def("default_stages_per_rank", &default_stages_per_rank, py::arg("name"));
  m.def("make_schedule",
        &make_schedule,
        py::arg("name"),
        py::arg("num_stages"),
        py::arg("num_microbatches"),
        py::arg("stages_per_rank") = 1);
  m.def(
      "simulate",
      [](const Schedule& schedule,
         double forward,
         double backward,
         std::optional<double> weight,
         double comm,
         const std::string& semantics) {
        const std::map<std::string, CommSemantics> kinds{
            {"gloo", CommSemantics::kGloo},
            {"nccl", CommSemantics::kNccl},
            {"nccl_ungrouped", CommSemantics::kNcclUngrouped}};
        const auto kind = kinds.find(semantics);
        TORCH_CHECK(kind != kinds.end(),
                    "torch_mp.pipeline.simulate: comm_semantics must be \"gloo\", \"nccl\" or "
                    "\"nccl_ungrouped\", got \"",
                    semantics,
                    "\"");
        return simulate(schedule, CostModel{forward, backward, weight, comm}, kind->second);
      },
      py::arg("schedule"),
      py::arg("forward"),
      py::arg("backward"),
      py::arg("weight"),
      py::arg("comm"),
      py::arg("comm_semantics"));
}

}  // namespace torch_mp::python
