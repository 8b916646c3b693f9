// An estimate as a table (plan/estimate.h, Estimate::to_string).

#include <iomanip>
#include <sstream>

#include "torch_mp/plan/estimate.h"

namespace torch_mp::plan {

std::string Estimate::to_string() const {
  std::ostringstream out;
  const auto mib = [](int64_t bytes) {
    std::ostringstream s;
    s << std::fixed << std::setprecision(2) << bytes / 1048576.0;
    return s.str();
  };
  out << std::left << std::setw(16) << "ranks" << std::right << std::setw(11) << "params"
      << std::setw(11) << "grads" << std::setw(11) << "optimizer" << std::setw(11) << "buffers"
      << std::setw(11) << "act/mb" << std::setw(9) << "in flt" << std::setw(11) << "activ."
      << std::setw(11) << "peak" << "   (MiB)\n";
  for (const auto& row : ranks) {
    out << std::left << std::setw(16) << row.kind << std::right << std::setw(11)
        << mib(row.parameters) << std::setw(11) << mib(row.gradients) << std::setw(11)
        << mib(row.optimizer_state) << std::setw(11) << mib(row.communication_buffers)
        << std::setw(11) << mib(row.activations_per_microbatch) << std::setw(9)
        << row.microbatches_in_flight << std::setw(11) << mib(row.activations) << std::setw(11)
        << mib(row.peak) << "\n";
  }
  out << std::scientific << std::setprecision(3) << "per rank and step: " << flops_per_rank
      << " FLOPs; sent";
  for (const auto& [dimension, bytes] : bytes_sent) {
    out << " " << dimension << " " << bytes << " B";
  }
  return out.str();
}

}  // namespace torch_mp::plan
