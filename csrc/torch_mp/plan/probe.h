#pragma once
// Measuring a machine's links on the ranks (torch_mp.plan.Machine.measure): what an all-reduce
// over a group takes, the way a training step sees it.

#include <cstdint>

#include "torch_mp/process_groups.h"

namespace torch_mp::plan {

/// The median over `repeats` runs (after one to warm up) of the seconds an all-reduce of
/// `elements` float32 elements over `group` takes, on the group's device, from its start on this
/// rank to its end (the median: a collective waits for the slower rank, as in a step). A
/// collective over the group.
double time_all_reduce(const GroupPtr& group, int64_t elements, int64_t repeats);

}  // namespace torch_mp::plan
