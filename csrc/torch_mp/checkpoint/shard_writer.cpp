// Writing a checkpoint: shard files, root files and the index, published at once
// (shard_writer.h).

#include "torch_mp/checkpoint/shard_writer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <filesystem>

#include "torch_mp/agreement.h"
#include "torch_mp/checkpoint/async_save.h"
#include "torch_mp/checkpoint/atomic_files.h"
#include "torch_mp/checkpoint/checksum.h"
#include "torch_mp/checkpoint/index.h"
#include "torch_mp/checkpoint/safetensors.h"

namespace torch_mp::checkpoint {
namespace {

namespace fs = std::filesystem;

// Adds every block of `shard` to `tensors`, each under its key.
void add_blocks(const Shard& shard, TensorMap& tensors) {
  for (const auto& block : shard.blocks()) {
    const auto key = block_key(shard.name, shard.dim, block.dense_begin);
    const auto part =
        shard.dim ? shard.tensor.narrow(*shard.dim, block.local_begin, block.length) : shard.tensor;
    const auto known = tensors.find(key);
    if (known == tensors.end()) {
      tensors.emplace(key, part);
      continue;
    }
    // The same name twice on this rank: a tied copy (equal), or a rename that is missing.
    TORCH_CHECK(known->second.sizes() == part.sizes() && known->second.equal(part),
                "two different tensors of this rank are both named ",
                shard.name,
                " (does a stage's rename to the dense model's names miss them?)");
  }
}

// Writes this rank's `shards` into the shard file `path`: its blocks, and every name's dense
// shape in the metadata. A whole tensor is written by rank 0 of the group it is replicated over.
void write_shard_file(const std::vector<Shard>& shards, const std::string& path) {
  TensorMap tensors;
  std::map<std::string, std::string> shapes{{"format", std::string(kFormat) + " shard"}};
  for (const auto& shard : shards) {
    if (!writes(shard)) {
      continue;  // a whole tensor: one rank of its group writes it
    }
    TORCH_CHECK(shard.name.find('@') == std::string::npos,
                "tensor names may not contain '@' (",
                shard.name,
                ")");
    shapes.emplace(shard.name, shape_text(shard.dense_shape()));
    add_blocks(shard, tensors);
  }
  save_file(tensors, path, shapes);
}

// Rank 0, once every rank wrote its shard file into `partial`: the root files, then the index
// (which must list only files written, and records the root files' checksums), then `partial`
// moved into place as `path`.
void publish(const std::string& partial,
             const std::string& path,
             const std::string& tag,
             Index index,
             const std::map<std::string, std::string>& root_files) {
  for (const auto& [name, contents] : root_files) {
    write_durably((fs::path(partial) / name).string(), contents);
    index.checksums[name] = crc32c(contents.data(), contents.size());
  }
  for (const auto& file : index.files) {
    const auto written = fs::path(partial) / file;
    TORCH_CHECK(fs::exists(written), "no rank wrote ", file);
    index.header_checksums[file] = header_checksum(written.string());
  }
  write_durably((fs::path(partial) / kIndex).string(), index_text(index));
  fsync_path(partial);
  move_into_place(partial, path, tag);
}

}  // namespace

SavePlan plan_save(const SaveLayout& layout, const std::vector<bool>& over_experts) {
  SavePlan plan;
  for (int64_t pp = 0; pp < layout.pp_size; ++pp) {
    for (int64_t t = 0; t < layout.tp_size; ++t) {
      for (int64_t e = 0; e < layout.ep_size; ++e) {
        plan.files.push_back(shard_file(pp, t, e));
      }
    }
  }
  const int64_t place = layout.place();
  if (place >= layout.ep_size) {  // a replica of place (place mod ep)
    return plan;
  }
  plan.file = shard_file(layout.pp_rank, layout.tp_rank, place);
  for (size_t i = 0; i < over_experts.size(); ++i) {
    if (place == 0 || over_experts[i]) {  // beyond place 0: its experts only
      plan.kept.push_back(i);
    }
  }
  return plan;
}

std::string shard_file(int64_t pp, int64_t tp, int64_t expert_place) {
  return "shard-" + std::to_string(pp) + "-" + std::to_string(tp) +
         (expert_place > 0 ? "-e" + std::to_string(expert_place) : "") + ".safetensors";
}

void save(const std::string& path, const SaveRequest& request, const GroupPtr& group) {
  wait_for_pending_save();
  write_checkpoint(path, request, group);
}

void write_checkpoint(const std::string& path_in,
                      const SaveRequest& request,
                      const GroupPtr& group) {
  const std::string what = "torch_mp::checkpoint::save of " + path_in + " failed";
  const std::string path = fs::absolute(path_in).lexically_normal().string();
  const bool root = !group || group->getRank() == 0;
  const std::string tag = save_tag(group);
  const std::string partial = partial_path(path, tag);
  std::vector<std::string> problems;
  if (root) {
    collect_problems(problems, [&] {
      remove_leftovers(path, kIndex);
      fs::create_directories(partial);
    });
  }
  raise_anywhere(problems, what, group);

  if (request.file) {
    collect_problems(problems, [&] {
      write_shard_file(request.shards, (fs::path(partial) / *request.file).string());
    });
  }
  auto failure = failure_anywhere(problems, what, group);
  if (!failure) {
    if (root) {
      collect_problems(problems, [&] {
        const Index index{.files = request.files, .metadata = request.metadata};
        publish(partial, path, tag, index, request.root_files);
      });
    }
    failure = failure_anywhere(problems, what, group);
  }
  if (failure) {
    if (root) {
      std::error_code ignored;
      fs::remove_all(partial, ignored);
    }
    TORCH_CHECK(false, *failure);
  }
}

}  // namespace torch_mp::checkpoint
