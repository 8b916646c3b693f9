#pragma once
// How long a layout's step takes (docs/plan.md, "Time"): the estimate's work per stage costed on
// a machine's figures, the pipeline's bubbles from replaying the schedule with those costs
// (pipeline::simulate), and the data-parallel traffic where the backward does not hide it.

#include <map>
#include <string>

#include "torch_mp/plan/estimate.h"

namespace torch_mp::plan {

/// One device and its links (torch_mp.plan.Machine resolves a machine file to these figures).
struct Machine {
  double flops = 0;             ///< FLOP/s one device achieves at the layout's dtype
  double memory_bandwidth = 0;  ///< bytes/s of one device's memory
  /// Bytes/s each rank sends within a dimension's group ("tp", "pp", "dp", "cp", "ep"); needed
  /// for every dimension of size > 1.
  std::map<std::string, double> links;
  double latency = 0;  ///< seconds of one message (each step of a ring)
  /// Seconds each operator costs beyond its work (dispatch, autograd, a kernel's launch): what
  /// makes many small micro-batches slower than a few large ones.
  double op_overhead = 0;
};

/// A step's time, in seconds.
struct StepTime {
  double seconds = 0;            ///< one optimizer step
  double forward = 0;            ///< one micro-batch through the busiest stage
  double backward = 0;           ///< its backward, recomputation included
  double pipeline = 0;           ///< the schedule's makespan with those costs
  double bubble_fraction = 0;    ///< of the pipeline's ranks x makespan, idle
  double data_parallel = 0;      ///< the data-parallel traffic the backward does not hide
  double optimizer = 0;          ///< the optimizer step (memory-bound)
  double tokens_per_second = 0;  ///< of the whole job (every data rank's micro-batches)
  /// Seconds each dimension's traffic takes per step, before any overlap.
  std::map<std::string, double> communication;
};

/// The step time of `layout` from its estimate. Raises, naming the dimension, if `machine` lacks
/// a link that the layout uses, or has no flops or memory bandwidth.
StepTime step_time(const Estimate& estimate, const Layout& layout, const Machine& machine);

}  // namespace torch_mp::plan
