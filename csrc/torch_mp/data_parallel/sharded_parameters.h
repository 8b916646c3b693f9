#pragma once
// The parameters of DataParallel(shard_parameters=True) (ZeRO-3): between uses each rank holds
// only its range of every flat bucket of shard_layout.h, and a unit's buckets are all-gathered
// just before the unit computes and freed just after (docs/memory.md, "ZeRO-3").
//
//   construction      each parameter's elements move into its bucket; this rank keeps its
//                     range (`shard`), and the parameter's data becomes an empty tensor
//   before a forward  the unit's buckets are all-gathered into their full tensors and its
//                     parameters made views of them (the unit that came next last time is
//                     prefetched: its all-gather runs while this one computes)
//   after a forward   the full tensors' storage is freed (resized to nothing) and the
//                     parameters emptied; what autograd saved of them are views of that
//                     storage, which the gather for backward fills again
//   before a backward the same gather (and prefetch, in backward order)
//   gradients         once every parameter of a gathered unit has its gradient, the unit is
//                     freed
//   after a step      (the optimizer has written the shards) every unit is freed, so the next
//                     use gathers the new values
//
// A unit is a set of parameters: those of the modules it covers, outside any unit nested in it.
// Every bucket holds one unit's parameters only. Not thread-safe: ShardedState locks.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "torch_mp/data_parallel/shard_layout.h"
#include "torch_mp/process_groups.h"

namespace c10d {
class Work;
}  // namespace c10d

namespace torch_mp::data_parallel {

class ShardedParameters {
 public:
  /// Shards `parameters` (laid out by `layout`, whose buckets each hold one unit's), of which
  /// `unit_of[i]` is parameter i's unit, over `group`; each parameter's data becomes empty.
  ShardedParameters(std::vector<at::Tensor> parameters,
                    const ShardLayout& layout,
                    std::vector<size_t> unit_of,
                    GroupPtr group);
  ~ShardedParameters();
  ShardedParameters(const ShardedParameters&) = delete;
  ShardedParameters& operator=(const ShardedParameters&) = delete;

  /// Gathers the unit (and prefetches the one that followed it in the last forward).
  void before_forward(size_t unit);
  /// Frees the unit.
  void after_forward(size_t unit);
  /// Gathers the unit (and prefetches the one that followed it in the last backward).
  void before_backward(size_t unit);
  /// Parameter i got its gradient: frees its unit once all of the unit's have.
  void on_gradient(size_t parameter);
  /// Frees every unit (waiting for any gather still running).
  void free_all();
  /// Gathers every unit, for code that reads or writes whole parameters (checkpoints).
  void gather_all();
  /// Copies this rank's range of every gathered bucket back into its shard (after whole
  /// parameters were written), then frees every unit.
  void write_back_and_free();

  /// Each parameter's shape (its data is empty while its unit is not gathered).
  const std::vector<int64_t>& shape(size_t parameter) const { return shapes_[parameter]; }
  /// This rank's range of bucket b: what the optimizer steps, piece by piece.
  const at::Tensor& shard(size_t bucket) const { return shards_[bucket]; }
  size_t num_units() const { return units_.size(); }

 private:
  enum class State { kFree, kGathering, kGathered };
  struct Unit {
    std::vector<size_t> buckets;
    size_t parameters = 0;  // how many
    State state = State::kFree;
    size_t gradients = 0;                              // of its parameters, since it was gathered
    std::vector<c10::intrusive_ptr<c10d::Work>> work;  // its buckets' all-gathers
  };
  void start_gather(size_t unit);
  void finish_gather(size_t unit);
  void free(size_t unit);
  // Records `unit` as following the last one gathered in this phase, gathers it, and starts
  // the gather of the one that followed it last time.
  void gather_in_order(size_t unit, std::vector<size_t>& next, size_t& last);

  std::vector<at::Tensor> parameters_;
  ShardLayout layout_;
  std::vector<size_t> unit_of_;
  GroupPtr group_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<at::Tensor> empty_;   // each parameter's data while its unit is free
  std::vector<at::Tensor> shards_;  // per bucket: this rank's range
  std::vector<at::Tensor> full_;    // per bucket: every rank's (storage freed while free)
  std::vector<Unit> units_;
  static constexpr size_t kNone = static_cast<size_t>(-1);
  std::vector<size_t> next_forward_, next_backward_;  // the order last seen
  size_t last_forward_ = kNone, last_backward_ = kNone;
};

}  // namespace torch_mp::data_parallel
