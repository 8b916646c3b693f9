// Bindings of torch_mp/checkpoint: the shard format that torch_mp.checkpoint.save / load drive,
// and the safetensors reader and writer.

#include <pybind11/stl.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/utils/pybind.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "python/common.h"
#include "torch_mp/checkpoint/checkpoint.h"
#include "torch_mp/checkpoint/checksum.h"
#include "torch_mp/checkpoint/safetensors.h"
#include "torch_mp/checkpoint/shards.h"

namespace py = pybind11;

namespace torch_mp::python {

namespace {

GroupPtr resolve_or_null(const std::optional<std::string>& group) {
  return group ? resolve(*group) : nullptr;
}

// A save's root files (name -> bytes from Python) as the core takes them.
std::map<std::string, std::string> contents_of(const std::map<std::string, py::bytes>& files) {
  std::map<std::string, std::string> contents;
  for (const auto& [name, bytes] : files) {
    contents[name] = bytes;
  }
  return contents;
}

}  // namespace

void bind_checkpoint(py::module_& parent) {
  namespace ckpt = torch_mp::checkpoint;
  auto m = parent.def_submodule("checkpoint", "Checkpoint files (torch_mp/checkpoint)");
  m.def("save_file",
        &ckpt::save_file,
        py::arg("tensors"),
        py::arg("path"),
        py::arg("metadata") = std::map<std::string, std::string>{});
  m.def(
      "load_file",
      [](const std::string& path) {
        std::map<std::string, std::string> metadata;
        auto tensors = ckpt::load_file(path, &metadata);
        return std::make_pair(tensors, metadata);
      },
      py::arg("path"));

  py::class_<ckpt::Shard>(m, "Shard", "One tensor of this rank's share of a model.")
      .def_readonly("name", &ckpt::Shard::name)
      .def_readonly("tensor", &ckpt::Shard::tensor)
      .def_readonly("dim", &ckpt::Shard::dim)
      .def_readonly("parts", &ckpt::Shard::parts)
      .def_readonly("dense_size", &ckpt::Shard::dense_size)
      .def_readonly("rank", &ckpt::Shard::rank)
      .def_readonly("ranks", &ckpt::Shard::ranks)
      .def("dense_shape", &ckpt::Shard::dense_shape);
  m.def(
      "shard_of",
      [](std::string name,
         const at::Tensor& tensor,
         const at::Tensor& parameter,
         const std::string& default_group) {
        return ckpt::shard_of(std::move(name), tensor, parameter, resolve(default_group));
      },
      py::arg("name"),
      py::arg("tensor"),
      py::arg("parameter"),
      py::arg("default_group"));
  m.def("shard_file", &ckpt::shard_file, py::arg("pp"), py::arg("tp"), py::arg("expert_place") = 0);
  py::class_<ckpt::SaveRequest>(m, "SaveRequest", "What a rank's save writes (shard_writer.h).")
      .def(py::init([](std::vector<ckpt::Shard> shards,
                       std::optional<std::string> file,
                       std::vector<std::string> files,
                       std::map<std::string, std::string> metadata,
                       const std::map<std::string, py::bytes>& root_files) {
             return ckpt::SaveRequest{.shards = std::move(shards),
                                      .file = std::move(file),
                                      .files = std::move(files),
                                      .metadata = std::move(metadata),
                                      .root_files = contents_of(root_files)};
           }),
           py::arg("shards"),
           py::arg("file"),
           py::arg("files"),
           py::arg("metadata"),
           py::arg("root_files"));
  m.def(
      "save",
      [](const std::string& path,
         const ckpt::SaveRequest& request,
         const std::optional<std::string>& group) {
        ckpt::save(path, request, resolve_or_null(group));
      },
      py::arg("path"),
      py::arg("request"),
      py::arg("group"),
      py::call_guard<py::gil_scoped_release>());
  py::class_<ckpt::AsyncSave, std::shared_ptr<ckpt::AsyncSave>>(
      m, "AsyncSave", "A save running in the background.")
      .def("wait", &ckpt::AsyncSave::wait, py::call_guard<py::gil_scoped_release>())
      .def("done", &ckpt::AsyncSave::done)
      .def_property_readonly("path", &ckpt::AsyncSave::path);
  m.def(
      "async_save",
      [](const std::string& path,
         const ckpt::SaveRequest& request,
         const std::string& world,
         const StorePtr& store) {
        const auto group = ckpt::background_group(resolve(world), store);
        return ckpt::async_save(path, request, group);
      },
      py::arg("path"),
      py::arg("request"),
      py::arg("world"),
      py::arg("store"),
      py::call_guard<py::gil_scoped_release>(),
      "Saves in the background over the world's group of background saves (made over `store` "
      "the first time: collective over the world).");
  m.def(
      "plan_save",
      [](const py::dict& mesh, const std::vector<bool>& over_experts) {
        ckpt::SaveLayout layout;
        const auto get = [&](const char* key) { return mesh[key].cast<int64_t>(); };
        layout.pp_size = get("pp_size"), layout.tp_size = get("tp_size");
        layout.ep_size = get("ep_size"), layout.cp_size = get("cp_size");
        layout.pp_rank = get("pp_rank"), layout.tp_rank = get("tp_rank");
        layout.dp_rank = get("dp_rank"), layout.cp_rank = get("cp_rank");
        const auto plan = ckpt::plan_save(layout, over_experts);
        return py::make_tuple(plan.file, plan.files, plan.kept);
      },
      py::arg("mesh"),
      py::arg("over_experts"),
      "For a rank at `mesh` ({pp,tp,ep,cp}_size, {pp,tp,dp,cp}_rank) whose shards lie, or not, "
      "over the expert group: (this rank's file or None, every file, the indices of the shards "
      "it writes).");
  m.def(
      "over_expert_group",
      [](const at::Tensor& parameter, const std::string& ep_group) {
        return ckpt::over_expert_group(parameter, group_named_or_none(ep_group));
      },
      py::arg("parameter"),
      py::arg("ep_group"));
  m.def("wait_for_pending_save",
        &ckpt::wait_for_pending_save,
        py::call_guard<py::gil_scoped_release>());

  m.def(
      "crc32c",
      [](const at::Tensor& tensor) {
        const auto bytes = tensor.detach().cpu().contiguous();
        py::gil_scoped_release release;
        return ckpt::crc32c(bytes.data_ptr(), bytes.nbytes());
      },
      py::arg("tensor"),
      "The CRC-32C of a CPU tensor's bytes, as checkpoints record it.");
  py::class_<ckpt::CorruptBlock>(m, "CorruptBlock", "A part of a checkpoint that fails its check.")
      .def_readonly("file", &ckpt::CorruptBlock::file)
      .def_readonly("key", &ckpt::CorruptBlock::key)
      .def_readonly("tensor", &ckpt::CorruptBlock::tensor)
      .def_readonly("message", &ckpt::CorruptBlock::message);
  py::class_<ckpt::VerifyReport>(m, "VerifyReport", "What verify found.")
      .def_readonly("corrupt", &ckpt::VerifyReport::corrupt)
      .def_readonly("unchecked", &ckpt::VerifyReport::unchecked)
      .def_readonly("files", &ckpt::VerifyReport::files)
      .def_readonly("blocks", &ckpt::VerifyReport::blocks)
      .def_readonly("bytes", &ckpt::VerifyReport::bytes);
  m.def("verify",
        &ckpt::verify,
        py::arg("path"),
        py::arg("threads") = 0,
        py::call_guard<py::gil_scoped_release>());

  py::class_<ckpt::Reader>(m, "Reader", "A checkpoint directory or dense file opened for reading.")
      .def(py::init([](const std::string& path,
                       const std::optional<std::string>& group,
                       const std::string& dense_prefix) {
             py::gil_scoped_release release;
             return ckpt::Reader(path, resolve_or_null(group), dense_prefix);
           }),
           py::arg("path"),
           py::arg("group"),
           py::arg("dense_prefix") = "model/")
      .def_property_readonly("path", &ckpt::Reader::path)
      .def_property_readonly("metadata", &ckpt::Reader::metadata)
      .def_property_readonly("unchecked_files", &ckpt::Reader::unchecked_files)
      .def(
          "root_file",
          [](const ckpt::Reader& reader, const std::string& name) -> std::optional<py::bytes> {
            std::optional<std::string> contents;
            {
              py::gil_scoped_release release;
              contents = reader.root_file(name);
            }
            if (!contents) {
              return std::nullopt;
            }
            return py::bytes(*contents);
          },
          py::arg("name"))
      .def_property_readonly("tensors",
                             [](const ckpt::Reader& reader) {
                               py::dict out;
                               for (const auto& [name, t] : reader.tensors()) {
                                 const auto dtype = py::reinterpret_borrow<py::object>(
                                     reinterpret_cast<PyObject*>(torch::getTHPDtype(t.dtype)));
                                 out[py::str(name)] = py::make_tuple(dtype, t.shape);
                               }
                               return out;
                             })
      .def(
          "load",
          [](const ckpt::Reader& reader,
             const std::vector<ckpt::Shard>& shards,
             const std::optional<std::string>& group) {
            py::gil_scoped_release release;
            reader.load(shards, resolve_or_null(group));
          },
          py::arg("shards"),
          py::arg("group"));
  m.def("consolidate",
        &ckpt::consolidate,
        py::arg("source"),
        py::arg("path"),
        py::arg("prefix") = "model/",
        py::arg("metadata") = std::map<std::string, std::string>{},
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace torch_mp::python
