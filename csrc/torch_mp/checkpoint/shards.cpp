#include "torch_mp/checkpoint/shards.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "torch_mp/checkpoint/json.h"
#include "torch_mp/collectives.h"
#include "torch_mp/layout.h"

namespace torch_mp::checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr const char* kFormat = "torch_mp checkpoint";
constexpr int64_t kVersion = 2;
constexpr const char* kIndex = "index.json";
constexpr size_t kProblemsShown = 8;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) {
      out += ',';
    }
    out += std::to_string(shape[i]);
  }
  return out;
}

std::vector<int64_t> parse_shape(const std::string& text, const std::string& where) {
  std::vector<int64_t> shape;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      shape.push_back(std::stoll(item));
    } catch (const std::exception&) {
      TORCH_CHECK(false, where, ": malformed dense shape '", text, "'");
    }
  }
  return shape;
}

/// "<name>@<dim>:<start>" for a block of a sharded tensor, "<name>" for a whole one.
std::string key_of(const std::string& name, std::optional<int64_t> dim, int64_t start) {
  return dim ? name + "@" + std::to_string(*dim) + ":" + std::to_string(start) : name;
}

std::string joined(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size() && i < kProblemsShown; ++i) {
    if (i) {
      out += "; ";
    }
    out += items[i];
  }
  if (items.size() > kProblemsShown) {
    out += "; and " + std::to_string(items.size() - kProblemsShown) + " more";
  }
  return out;
}

/// The failure text of the first rank of `group` with problems (this rank's own if it has
/// some), or nullopt when no rank has any.
std::optional<std::string> failure_anywhere(const std::vector<std::string>& problems,
                                            const std::string& what,
                                            const GroupPtr& group) {
  const int64_t rank = group ? group->getRank() : 0;
  const std::string mine = joined(problems);
  if (group && group->getSize() > 1) {
    // Every rank takes part in the same collectives, whether or not it has problems.
    const auto longest =
        comm::all_reduce(
            at::full({1}, static_cast<int64_t>(mine.size()), at::kLong), group, c10d::ReduceOp::MAX)
            .item<int64_t>();
    if (longest == 0) {
      return std::nullopt;
    }
    auto text = at::zeros({longest + 1}, at::kByte);
    std::copy(mine.begin(), mine.end(), text.data_ptr<uint8_t>());
    const auto all = comm::all_gather(text, 0, group).view({-1, longest + 1});
    if (!problems.empty()) {
      return what + " on rank " + std::to_string(rank) + ": " + mine;
    }
    for (int64_t r = 0; r < all.size(0); ++r) {
      const auto* bytes = all[r].data_ptr<uint8_t>();
      if (bytes[0] != 0) {
        return what + " on rank " + std::to_string(r) + ": " +
               std::string(reinterpret_cast<const char*>(bytes));
      }
    }
    return std::nullopt;
  }
  if (!problems.empty()) {
    return what + " on rank " + std::to_string(rank) + ": " + mine;
  }
  return std::nullopt;
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

/// Renames the finished `partial` to `path`, an earlier checkpoint there set aside first and
/// removed last: at every moment `path` or the one set aside is complete.
void move_into_place(const std::string& partial, const std::string& path, const std::string& tag) {
  std::string previous;
  if (fs::exists(path)) {
    previous = path + ".previous-" + tag;
    fs::rename(path, previous);
  }
  fs::rename(partial, path);
  fsync_path(fs::path(path).parent_path().string());
  if (!previous.empty()) {
    std::error_code ignored;
    fs::remove_all(previous, ignored);
  }
}

/// Removes what saves to `path` that died left behind: unfinished directories, and earlier
/// checkpoints set aside when `path` itself is complete.
void remove_leftovers(const std::string& path) {
  const fs::path p(path);
  const auto parent = p.parent_path();
  if (!fs::is_directory(parent)) {
    return;
  }
  const bool complete = fs::exists(p / kIndex);
  for (const auto& entry : fs::directory_iterator(parent)) {
    const auto name = entry.path().filename().string();
    const auto base = p.filename().string();
    if (name.rfind(base + ".partial-", 0) == 0 ||
        (complete && name.rfind(base + ".previous-", 0) == 0)) {
      std::error_code ignored;
      fs::remove_all(entry.path(), ignored);
    }
  }
}

/// `path`, or the earlier checkpoint set aside while a newer one was moved into place (a save
/// killed between its two renames).
std::string checkpoint_directory(const std::string& path) {
  if (fs::is_directory(path)) {
    return path;
  }
  const fs::path p(path);
  const auto parent = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  std::vector<std::string> aside;
  if (fs::is_directory(parent)) {
    for (const auto& entry : fs::directory_iterator(parent)) {
      const auto name = entry.path().filename().string();
      if (name.rfind(p.filename().string() + ".previous-", 0) == 0) {
        aside.push_back(entry.path().string());
      }
    }
  }
  TORCH_CHECK(!aside.empty(), "no checkpoint at ", path);
  std::sort(aside.begin(), aside.end());
  return aside.back();
}

/// A box in a dense tensor's coordinates: [lo[d], hi[d]) along every dim d.
struct Box {
  std::vector<int64_t> lo, hi;

  Box(const std::vector<int64_t>& shape, std::optional<int64_t> dim, int64_t start, int64_t length)
      : lo(shape.size(), 0), hi(shape) {
    if (dim) {
      lo[*dim] = start;
      hi[*dim] = start + length;
    }
  }
  int64_t volume() const {
    int64_t v = 1;
    for (size_t d = 0; d < lo.size(); ++d) {
      v *= std::max<int64_t>(0, hi[d] - lo[d]);
    }
    return v;
  }
  Box intersect(const Box& other) const {
    Box out = *this;
    for (size_t d = 0; d < lo.size(); ++d) {
      out.lo[d] = std::max(lo[d], other.lo[d]);
      out.hi[d] = std::min(hi[d], other.hi[d]);
    }
    return out;
  }
  /// `tensor`, holding this box from `origin` on, cut to `part`.
  at::Tensor cut(at::Tensor tensor, const Box& part, const std::vector<int64_t>& origin) const {
    for (size_t d = 0; d < lo.size(); ++d) {
      tensor = tensor.narrow(
          static_cast<int64_t>(d), part.lo[d] - lo[d] + origin[d], part.hi[d] - part.lo[d]);
    }
    return tensor;
  }
};

/// The boxes of the dense tensor that `shard` holds, with where each starts in its tensor.
std::vector<std::pair<Box, std::vector<int64_t>>> boxes_of(const Shard& shard) {
  const auto shape = shard.dense_shape();
  std::vector<std::pair<Box, std::vector<int64_t>>> out;
  for (const auto& block : shard.blocks()) {
    std::vector<int64_t> origin(shape.size(), 0);
    if (shard.dim) {
      origin[*shard.dim] = block.local_begin;
    }
    out.emplace_back(Box(shape, shard.dim, block.dense_begin, block.length), origin);
  }
  return out;
}

}  // namespace

std::vector<Shard::Block> Shard::blocks() const {
  if (!dim) {
    return {Block{0, 0, tensor.dim() ? tensor.size(0) : 1}};
  }
  const int64_t local = tensor.size(*dim) / parts;
  const int64_t dense = dense_size.value_or(local * ranks * parts) / parts;
  std::vector<Block> out;
  for (int64_t k = 0; k < parts; ++k) {
    const int64_t begin = rank * local;
    const int64_t length = std::min(local, dense - begin);
    if (length > 0) {
      out.push_back(Block{k * local, k * dense + begin, length});
    }
  }
  return out;
}

std::vector<int64_t> Shard::dense_shape() const {
  auto shape = tensor.sizes().vec();
  if (dim) {
    shape[*dim] = dense_size.value_or(shape[*dim] * ranks);
  }
  return shape;
}

Shard shard_of(std::string name,
               const at::Tensor& tensor,
               const at::Tensor& parameter,
               const GroupPtr& default_group) {
  Shard shard{std::move(name), tensor};
  const auto layout = layout_of(parameter);
  const GroupPtr group = layout && layout->group ? layout->group : default_group;
  if (group) {
    shard.rank = group->getRank();
    shard.ranks = group->getSize();
  }
  if (layout && layout->shard_dim) {
    shard.dim = layout->shard_dim;
    shard.parts = layout->parts;
    shard.dense_size = layout->dense_size;
  }
  return shard;
}

std::string shard_file(int64_t pp, int64_t tp) {
  return "shard-" + std::to_string(pp) + "-" + std::to_string(tp) + ".safetensors";
}

void raise_anywhere(const std::vector<std::string>& problems,
                    const std::string& what,
                    const GroupPtr& group) {
  if (const auto failure = failure_anywhere(problems, what, group)) {
    TORCH_CHECK(false, *failure);
  }
}

void save(const std::string& path_in,
          const std::vector<Shard>& shards,
          const std::optional<std::string>& file,
          const std::vector<std::string>& files,
          const std::map<std::string, std::string>& metadata,
          const std::map<std::string, std::string>& root_files,
          const GroupPtr& group) {
  const std::string what = "torch_mp::checkpoint::save of " + path_in + " failed";
  const std::string path = fs::absolute(path_in).lexically_normal().string();
  const bool root = !group || group->getRank() == 0;
  // One name for this save's directory, rank 0's clock in ns (so that of earlier checkpoints
  // set aside, the newest sorts last), zero-padded.
  auto token = at::zeros({1}, at::kLong);
  if (root) {
    token[0] = static_cast<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
  }
  if (group && group->getSize() > 1) {
    token = comm::all_reduce(token, group, c10d::ReduceOp::SUM);
  }
  std::string tag = std::to_string(token.item<int64_t>());
  tag.insert(0, 20 - std::min<size_t>(20, tag.size()), '0');
  const std::string partial = path + ".partial-" + tag;
  std::vector<std::string> problems;
  const auto attempt = [&problems](const auto& body) { collect_problems(problems, body); };
  if (root) {
    attempt([&] {
      remove_leftovers(path);
      fs::create_directories(partial);
    });
  }
  raise_anywhere(problems, what, group);

  if (file) {
    attempt([&] {
      TensorMap tensors;
      std::map<std::string, std::string> shapes{{"format", std::string(kFormat) + " shard"}};
      for (const auto& shard : shards) {
        if (!shard.dim && shard.rank != 0) {
          continue;  // a whole tensor: one rank of its group writes it
        }
        TORCH_CHECK(shard.name.find('@') == std::string::npos,
                    "tensor names may not contain '@' (",
                    shard.name,
                    ")");
        shapes.emplace(shard.name, shape_text(shard.dense_shape()));
        for (const auto& block : shard.blocks()) {
          const auto key = key_of(shard.name, shard.dim, block.dense_begin);
          const auto part = shard.dim
                                ? shard.tensor.narrow(*shard.dim, block.local_begin, block.length)
                                : shard.tensor;
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
      save_file(tensors, (fs::path(partial) / *file).string(), shapes);
    });
  }
  auto failure = failure_anywhere(problems, what, group);
  if (!failure) {
    attempt([&] {
      if (!root) {
        return;
      }
      for (const auto& [name, contents] : root_files) {
        const auto file = (fs::path(partial) / name).string();
        std::ofstream out(file, std::ios::binary | std::ios::trunc);
        out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
        out.flush();
        TORCH_CHECK(out, "writing ", file, " failed");
        out.close();
        fsync_path(file);
      }
      std::ostringstream index;
      index << "{\n \"format\": " << quoted(kFormat) << ",\n \"version\": " << kVersion
            << ",\n \"files\": [";
      for (size_t i = 0; i < files.size(); ++i) {
        index << (i ? ", " : "") << quoted(files[i]);
        TORCH_CHECK(fs::exists(fs::path(partial) / files[i]), "no rank wrote ", files[i]);
      }
      index << "],\n \"metadata\": {";
      for (auto it = metadata.begin(); it != metadata.end(); ++it) {
        index << (it == metadata.begin() ? "\n  " : ",\n  ") << quoted(it->first) << ": "
              << quoted(it->second);
      }
      index << "\n }\n}\n";
      const auto index_path = (fs::path(partial) / kIndex).string();
      {
        std::ofstream out(index_path, std::ios::trunc);
        out << index.str();
        out.flush();
        TORCH_CHECK(out, "writing ", index_path, " failed");
      }
      fsync_path(index_path);
      fsync_path(partial);
      move_into_place(partial, path, tag);
    });
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

Reader::Reader(const std::string& path, const GroupPtr& group, const std::string& dense_prefix) {
  std::vector<std::string> problems;
  collect_problems(problems, [&] {
    if (fs::is_regular_file(path)) {
      path_ = path;
      files_.emplace_back(path, read_header(path));
    } else {
      path_ = checkpoint_directory(path);
      const auto index_path = (fs::path(path_) / kIndex).string();
      TORCH_CHECK(fs::exists(index_path),
                  path_,
                  " has no ",
                  kIndex,
                  ": the save that wrote it did not finish");
      std::ifstream in(index_path);
      const std::string text{std::istreambuf_iterator<char>(in), {}};
      const auto index = parse_json(text, index_path + ": not a checkpoint index");
      const auto& fields = index.object;
      TORCH_CHECK(fields.count("format") && fields.at("format").string == kFormat,
                  index_path,
                  " is not a ",
                  kFormat,
                  " index");
      TORCH_CHECK(fields.count("version") && fields.at("version").number == kVersion,
                  index_path,
                  " is of version ",
                  fields.count("version") ? fields.at("version").number : 0,
                  "; this torch_mp reads version ",
                  kVersion);
      if (fields.count("metadata")) {
        for (const auto& [key, value] : fields.at("metadata").object) {
          metadata_[key] = value.string;
        }
      }
      TORCH_CHECK(fields.count("files"), index_path, " lists no files");
      std::vector<std::string> missing;
      for (const auto& name : fields.at("files").array) {
        const auto file = (fs::path(path_) / name.string).string();
        if (!fs::exists(file)) {
          missing.push_back(name.string);
          continue;
        }
        files_.emplace_back(file, read_header(file));
      }
      TORCH_CHECK(missing.empty(), path_, " lacks ", joined(missing));
    }
    const bool dense = fs::is_regular_file(path);
    for (size_t f = 0; f < files_.size(); ++f) {
      const auto& [file, header] = files_[f];
      for (const auto& [key, entry] : header.tensors) {
        Piece piece{f, key, std::nullopt, 0, 0};
        std::string name = dense ? dense_prefix + key : key;
        std::vector<int64_t> shape = entry.shape;
        const auto at = key.rfind('@');
        if (!dense && at != std::string::npos) {
          name = key.substr(0, at);
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
          piece.dim = number(key.substr(at + 1, colon - at - 1));
          piece.start = number(key.substr(colon + 1));
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
    }
    for (auto& [name, pieces] : pieces_) {
      keep_one_copy(name, pieces);
    }
  });
  raise_anywhere(problems, "torch_mp::checkpoint: cannot read " + path, group);
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
    // Every overlap of a shard's block with a saved block. One that is the whole saved block,
    // into a contiguous part of the shard of the same dtype (the common case: a layout reading
    // what it or a like one wrote), is read straight into place; the rest through a buffer.
    struct Overlap {
      const Shard* shard;
      at::Tensor destination;
      const Piece* piece;
      Box from, part;
    };
    std::vector<Overlap> overlaps;
    for (const auto& shard : shards) {
      const auto shape = shard.dense_shape();
      int64_t held = 0;
      for (const auto& block : shard.blocks()) {
        held += block.length;
      }
      if (shard.dim && held < shard.tensor.size(*shard.dim)) {
        at::NoGradGuard no_grad;
        shard.tensor.zero_();  // padding rows
      }
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
    std::map<std::pair<size_t, std::string>, at::Tensor> buffers;
    for (auto& o : overlaps) {
      const auto& [file, header] = files_[o.piece->file];
      const bool whole = o.part.volume() == o.from.volume();
      if (whole && o.destination.is_contiguous() && o.destination.is_cpu() &&
          o.destination.scalar_type() == header.tensors.at(o.piece->key).dtype) {
        load_into(file, header, o.piece->key, o.destination);
        continue;
      }
      auto& buffer = buffers[{o.piece->file, o.piece->key}];
      if (!buffer.defined()) {
        buffer = load_tensors(file, header, {o.piece->key}).begin()->second;
      }
      at::NoGradGuard no_grad;
      const auto shape = o.shard->dense_shape();
      o.destination.copy_(o.from.cut(buffer, o.part, std::vector<int64_t>(shape.size(), 0)));
    }
  });
  raise_anywhere(problems, what, group);
}

void consolidate(const std::string& source, const std::string& path, const std::string& prefix) {
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
  save_file(dense, path, {{"format", "torch_mp dense"}});
}

}  // namespace torch_mp::checkpoint
