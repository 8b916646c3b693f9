#pragma once
// Runs the ranks of a process group as threads of the test process.
//
// Every rank is one std::thread; the ranks meet through one c10d::HashStore that only they share,
// so each call gets its own rendezvous and store prefixes never collide between tests. Nothing
// escapes a rank thread: its exception is caught, all threads are joined, and the failures are
// reported afterwards with the rank that raised them.

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "torch_mp/mesh.h"

namespace torch_mp::testing {

// The core's operators find groups by name in c10d's registry; ranks that are threads of one
// process each need a registry of their own, which c10d's thread-isolation mode gives (set
// before any group is made).
inline const bool kGroupRegistryPerThread = [] {
  c10d::set_thread_isolation_mode(true);
  return true;
}();

/// The message of an exception, without c10's backtrace.
inline std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

/// Runs `body(rank)` on `world_size` threads and joins them all. Returns, per rank, the message
/// of the exception that rank raised, or std::nullopt if it returned normally.
inline std::vector<std::optional<std::string>> run_ranks_collecting_errors(
    int world_size, const std::function<void(int rank)>& body) {
  std::vector<std::exception_ptr> errors(world_size);
  std::vector<std::thread> threads;
  threads.reserve(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  std::vector<std::optional<std::string>> messages(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    if (errors[rank]) {
      messages[rank] = message_of(errors[rank]);
    }
  }
  return messages;
}

/// Runs `body(rank)` on `world_size` threads; throws, naming every rank that failed and why.
inline void run_ranks(int world_size, const std::function<void(int rank)>& body) {
  const auto errors = run_ranks_collecting_errors(world_size, body);
  std::ostringstream report;
  for (int rank = 0; rank < world_size; ++rank) {
    if (errors[rank]) {
      report << "\n  rank " << rank << ": " << *errors[rank];
    }
  }
  if (!report.str().empty()) {
    throw std::runtime_error("ranks failed:" + report.str());
  }
}

/// Options for a test mesh: `tp` and `pp` as given, a 20 s timeout on every group.
inline InitOptions test_options(int64_t tp, int64_t pp = 1) {
  return InitOptions().tp(tp).pp(pp).timeout(std::chrono::seconds(20));
}

/// The body of a rank that works on its mesh.
using MeshBody = std::function<void(const Mesh& mesh)>;

/// Builds each rank's mesh over one fresh HashStore with `options_of(rank)`, then runs `body`.
/// Returns each rank's error message, as run_ranks_collecting_errors does.
inline std::vector<std::optional<std::string>> run_on_mesh_collecting_errors(
    int world_size, const std::function<InitOptions(int rank)>& options_of, const MeshBody& body) {
  const StorePtr store = c10::make_intrusive<c10d::HashStore>();
  return run_ranks_collecting_errors(world_size, [&](int rank) {
    const auto mesh = make_mesh(store, rank, world_size, options_of(rank));
    body(*mesh);
  });
}

/// Builds each rank's mesh with `options` over one fresh HashStore and runs `body` on every rank;
/// throws, naming every rank that failed and why.
inline void run_on_mesh(int world_size, const InitOptions& options, const MeshBody& body) {
  const StorePtr store = c10::make_intrusive<c10d::HashStore>();
  run_ranks(world_size, [&](int rank) {
    const auto mesh = make_mesh(store, rank, world_size, options);
    body(*mesh);
  });
}

/// Names a test instance parameterised by the world size "world<N>".
inline std::string world_size_name(const ::testing::TestParamInfo<int>& info) {
  return "world" + std::to_string(info.param);
}

}  // namespace torch_mp::testing
