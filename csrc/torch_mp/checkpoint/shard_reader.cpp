// Reading a checkpoint into any cut of the model (shard_reader.h).

#include "torch_mp/checkpoint/shard_reader.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "torch_mp/agreement.h"
#include "torch_mp/checkpoint/async_save.h"
#include "torch_mp/checkpoint/atomic_files.h"
#include "torch_mp/checkpoint/checksum.h"
#include "torch_mp/checkpoint/index.h"

namespace torch_mp::checkpoint {
namespace {

namespace fs = std::filesystem;

// The parts of a block's key, "<name>@<dim>:<start>" (block_key).
struct BlockKey {
  std::string name;
  int64_t dim = 0;
  int64_t start = 0;
};

// The parts of `key`, a key of `file`; nullopt for a whole tensor's key (without '@'). Raises,
// naming the file, on a malformed key.
std::optional<BlockKey> parse_block_key(const std::string& key, const std::string& file) {
  const auto at = key.rfind('@');
  if (at == std::string::npos) {
    return std::nullopt;
  }
  const auto colon = key.find(':', at);
  const auto number = [&](const std::string& text) {
    TORCH_CHECK(!text.empty() && text.find_first_not_of("0123456789") == std::string::npos,
                file,
                ": malformed tensor key ",
                key,
                " (expected <name>@<dim>:<start>)");
    return std::stoll(text);
  };
  TORCH_CHECK(colon != std::string::npos, file, ": malformed tensor key ", key);
  BlockKey block{key.substr(0, at)};
  block.dim = number(key.substr(at + 1, colon - at - 1));
  block.start = number(key.substr(colon + 1));
  return block;
}

// Zeroes every shard's tensor that has padding rows (no block covers them, so nothing is read
// into them).
void zero_padding(const std::vector<Shard>& shards) {
  for (const auto& shard : shards) {
    int64_t held = 0;
    for (const auto& block : shard.blocks()) {
      held += block.length;
    }
    if (shard.dim && held < shard.tensor.size(*shard.dim)) {
      at::NoGradGuard no_grad;
      shard.tensor.zero_();
    }
  }
}

}  // namespace

Reader::Reader(const std::string& path, const GroupPtr& group, const std::string& dense_prefix) {
  wait_for_pending_save();  // (what this rank saves in the background may be what it reads)
  std::vector<std::string> problems;
  collect_problems(problems, [&] {
    const bool dense = fs::is_regular_file(path);
    if (dense) {
      path_ = path;
      files_.emplace_back(path, read_header(path));
    } else {
      open_directory(path);
    }
    const auto prefix = dense ? std::optional<std::string>(dense_prefix) : std::nullopt;
    for (size_t f = 0; f < files_.size(); ++f) {
      for (const auto& [key, entry] : files_[f].second.tensors) {
        add_piece(f, key, entry, prefix);
      }
    }
    for (auto& [name, pieces] : pieces_) {
      keep_one_copy(name, pieces);
    }
  });
  raise_anywhere(problems, "torch_mp::checkpoint: cannot read " + path, group);
}

void Reader::open_directory(const std::string& path) {
  path_ = checkpoint_directory(path);
  index_ = read_index(path_);
  metadata_ = index_.metadata;
  std::vector<std::string> missing;
  for (const auto& name : index_.files) {
    const auto file = (fs::path(path_) / name).string();
    if (!fs::exists(file)) {
      missing.push_back(name);
      continue;
    }
    if (const auto problem = header_problem(index_, path_, name)) {
      TORCH_CHECK(false, *problem);
    }
    files_.emplace_back(file, read_header(file));
  }
  TORCH_CHECK(missing.empty(), path_, " lacks ", summary_of(missing));
}

std::vector<std::string> Reader::unchecked_files() const {
  std::vector<std::string> unchecked;
  if (index_.version < 3) {  // (its own checksum and its files' are optional)
    unchecked.push_back((fs::path(path_) / kIndex).string() + " (format version " +
                        std::to_string(index_.version) + ")");
  }
  for (const auto& [file, header] : files_) {
    if (!header.checksummed()) {
      unchecked.push_back(file);
    }
  }
  return unchecked;
}

std::optional<std::string> Reader::root_file(const std::string& name) const {
  if (fs::is_regular_file(path_)) {
    return std::nullopt;
  }
  const auto file = fs::path(path_) / name;
  const auto status = fs::symlink_status(file);
  if (!fs::exists(status)) {
    TORCH_CHECK(!index_.checksums.count(name), path_, " lacks ", name, ", which it was saved with");
    return std::nullopt;
  }
  // (checked before a byte is read: a link or a device could be anything)
  TORCH_CHECK(fs::is_regular_file(status),
              file.string(),
              " is not read: it is not a regular file (a link, a device or a directory)");
  TORCH_CHECK(index_.checksums.count(name) || index_.version < 3,
              file.string(),
              " is not read: ",
              kIndex,
              " records no checksum of it (a file that was not saved with the checkpoint)");
  std::ifstream in(file, std::ios::binary);
  std::string contents{std::istreambuf_iterator<char>(in), {}};
  TORCH_CHECK(in.good() || in.eof(), "reading ", file.string(), " failed");
  if (const auto problem = root_file_problem(index_, path_, name, contents)) {
    TORCH_CHECK(false, *problem);
  }
  return contents;
}

void Reader::add_piece(size_t f,
                       const std::string& key,
                       const TensorEntry& entry,
                       const std::optional<std::string>& dense_prefix) {
  const auto& [file, header] = files_[f];
  Piece piece{f, key, std::nullopt, 0, 0};
  std::string name = dense_prefix ? *dense_prefix + key : key;
  std::vector<int64_t> shape = entry.shape;
  const auto block = dense_prefix ? std::optional<BlockKey>() : parse_block_key(key, file);
  if (block) {
    name = block->name;
    piece.dim = block->dim;
    piece.start = block->start;
    TORCH_CHECK(*piece.dim < static_cast<int64_t>(shape.size()),
                file,
                ": tensor key ",
                key,
                " names a dim its tensor lacks");
    piece.length = shape[*piece.dim];
    const auto dense_shape = header.metadata.find(name);
    TORCH_CHECK(dense_shape != header.metadata.end(), file, " gives no shape for ", name);
    shape = parse_shape(dense_shape->second, file);
  }
  const auto known = tensors_.find(name);
  if (known == tensors_.end()) {
    tensors_.emplace(name, Tensor{entry.dtype, shape});
  } else {
    TORCH_CHECK(known->second.shape == shape,
                name,
                " has shape [",
                shape_text(shape),
                "] in ",
                file,
                " and [",
                shape_text(known->second.shape),
                "] in another file");
  }
  pieces_[name].push_back(std::move(piece));
}

void Reader::keep_one_copy(const std::string& name, std::vector<Piece>& pieces) const {
  // Several stages may save one tensor (a head tied to the embedding): the same blocks under
  // the same keys, or the whole tensor where the original is sharded. One copy is kept; the
  // others must be equal to it, or two different tensors were saved under one name.
  const auto whole =
      std::find_if(pieces.begin(), pieces.end(), [](const Piece& p) { return !p.dim.has_value(); });
  std::vector<Piece> kept;
  if (whole != pieces.end()) {
    kept.push_back(*whole);
  }
  const auto read = [&](const Piece& p) {
    const auto& [file, header] = files_[p.file];
    return load_tensors(file, header, {p.key}).begin()->second;
  };
  for (const auto& piece : pieces) {
    const auto same = std::find_if(
        kept.begin(), kept.end(), [&](const Piece& k) { return !k.dim || k.key == piece.key; });
    if (same == kept.end()) {
      kept.push_back(piece);
      continue;
    }
    if (same->file == piece.file && same->key == piece.key) {
      continue;
    }
    auto reference = read(*same);
    if (!same->dim && piece.dim) {
      reference = reference.narrow(*piece.dim, piece.start, piece.length);
    }
    TORCH_CHECK(reference.equal(read(piece)),
                name,
                " differs between ",
                fs::path(files_[same->file].first).filename().string(),
                " and ",
                fs::path(files_[piece.file].first).filename().string(),
                ": two different tensors were saved under one name (does a stage's rename to the "
                "dense model's names miss them?)");
  }
  pieces = std::move(kept);
}

std::vector<std::string> Reader::problems(const Shard& shard) const {
  const auto known = tensors_.find(shard.name);
  if (known == tensors_.end()) {
    return {shard.name + " is missing"};
  }
  const auto shape = shard.dense_shape();
  if (known->second.shape != shape) {
    return {shard.name + " has shape [" + shape_text(known->second.shape) +
            "] in the checkpoint; this rank's needs [" + shape_text(shape) + "]"};
  }
  const auto& pieces = pieces_.at(shard.name);
  for (const auto& [box, origin] : boxes_of(shard)) {
    int64_t covered = 0;
    for (const auto& piece : pieces) {
      covered += box.intersect(Box(shape, piece.dim, piece.start, piece.length)).volume();
    }
    if (covered != box.volume()) {
      return {shard.name + ": the checkpoint's blocks of it cover " + std::to_string(covered) +
              " of the " + std::to_string(box.volume()) + " elements this rank needs"};
    }
  }
  return {};
}

void Reader::load(const std::vector<Shard>& shards, const GroupPtr& group) const {
  std::vector<std::string> problems;
  for (const auto& shard : shards) {
    const auto found = this->problems(shard);
    problems.insert(problems.end(), found.begin(), found.end());
  }
  const std::string what = "torch_mp::checkpoint: cannot load " + path_;
  raise_anywhere(problems, what, group);
  collect_problems(problems, [&] {
    zero_padding(shards);
    std::map<std::pair<size_t, std::string>, at::Tensor> buffers;
    for (const auto& overlap : overlaps_of(shards)) {
      fill(overlap, buffers);
    }
  });
  raise_anywhere(problems, what, group);
}

std::vector<Reader::Overlap> Reader::overlaps_of(const std::vector<Shard>& shards) const {
  std::vector<Overlap> overlaps;
  for (const auto& shard : shards) {
    const auto shape = shard.dense_shape();
    for (const auto& [box, origin] : boxes_of(shard)) {
      for (const auto& piece : pieces_.at(shard.name)) {
        const Box from(shape, piece.dim, piece.start, piece.length);
        const Box part = box.intersect(from);
        if (part.volume() > 0) {
          overlaps.push_back({&shard, box.cut(shard.tensor, part, origin), &piece, from, part});
        }
      }
    }
  }
  return overlaps;
}

void Reader::fill(const Overlap& overlap,
                  std::map<std::pair<size_t, std::string>, at::Tensor>& buffers) const {
  // One that is the whole saved block, into a contiguous part of the shard of the same dtype
  // (the common case: a layout reading what it or a like one wrote), is read straight into
  // place; the rest through a buffer.
  const auto& [file, header] = files_[overlap.piece->file];
  const auto& key = overlap.piece->key;
  const auto& destination = overlap.destination;
  const bool whole = overlap.part.volume() == overlap.from.volume();
  if (whole && destination.is_contiguous() && destination.is_cpu() &&
      destination.scalar_type() == header.tensors.at(key).dtype) {
    load_into(file, header, key, destination);
    return;
  }
  auto& buffer = buffers[{overlap.piece->file, key}];
  if (!buffer.defined()) {
    buffer = load_tensors(file, header, {key}).begin()->second;
  }
  at::NoGradGuard no_grad;
  const auto shape = overlap.shard->dense_shape();
  destination.copy_(overlap.from.cut(buffer, overlap.part, std::vector<int64_t>(shape.size(), 0)));
}

void consolidate(const std::string& source,
                 const std::string& path,
                 const std::string& prefix,
                 const std::map<std::string, std::string>& metadata) {
  const Reader reader(source, nullptr);
  std::vector<Shard> shards;
  TensorMap dense;
  for (const auto& [name, tensor] : reader.tensors()) {
    if (name.rfind(prefix, 0) != 0) {
      continue;
    }
    auto whole = at::empty(tensor.shape, at::TensorOptions(tensor.dtype));
    shards.push_back(Shard{name, whole});
    dense[name.substr(prefix.size())] = whole;
  }
  reader.load(shards, nullptr);
  auto header = metadata;
  header["format"] = "torch_mp dense";
  save_file(dense, path, header);
}

}  // namespace torch_mp::checkpoint
