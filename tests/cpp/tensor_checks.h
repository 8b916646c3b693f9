#pragma once
// Small helpers shared by the tests: deterministic per-rank tensors and assertions with readable
// failure messages.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace torch_mp::testing {

/// A generator of its own, so that rank threads never draw from (and race on) the global one.
inline at::Generator seeded_generator(uint64_t seed) {
  return at::detail::createCPUGenerator(seed);
}

/// Standard-normal tensor that rank `rank` feeds in; any thread can recompute any rank's tensor.
inline at::Tensor rank_randn(at::IntArrayRef shape, uint64_t seed, int64_t rank) {
  return at::randn(shape, seeded_generator(seed + static_cast<uint64_t>(rank)));
}

/// Every rank's tensor from rank_randn, in rank order.
inline std::vector<at::Tensor> all_ranks_randn(at::IntArrayRef shape,
                                               uint64_t seed,
                                               int64_t world_size) {
  std::vector<at::Tensor> tensors;
  for (int64_t rank = 0; rank < world_size; ++rank) {
    tensors.push_back(rank_randn(shape, seed, rank));
  }
  return tensors;
}

/// Sum of `tensors`.
inline at::Tensor sum_of(const std::vector<at::Tensor>& tensors) {
  return at::stack(tensors).sum(0);
}

/// Success if `actual` and `expected` have one shape and |actual - expected| <= atol + rtol *
/// |expected| everywhere (torch.allclose); the failure names the largest difference.
inline ::testing::AssertionResult all_close(const at::Tensor& actual,
                                            const at::Tensor& expected,
                                            double rtol = 1e-5,
                                            double atol = 1e-6) {
  if (!actual.defined() || !expected.defined()) {
    return ::testing::AssertionFailure() << "a tensor is undefined (actual " << actual.defined()
                                         << ", expected " << expected.defined() << ")";
  }
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << "shape " << actual.sizes() << " differs from the expected " << expected.sizes();
  }
  if (at::allclose(actual, expected, rtol, atol)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "max |actual - expected| = " << (actual - expected).abs().max().item<double>()
         << " exceeds atol " << atol << " + rtol " << rtol << " * |expected|";
}

/// Success if `error` is set and contains `needle`.
inline ::testing::AssertionResult mentions(const std::optional<std::string>& error,
                                           const std::string& needle) {
  if (!error) {
    return ::testing::AssertionFailure() << "no exception was raised";
  }
  if (error->find(needle) == std::string::npos) {
    return ::testing::AssertionFailure()
           << "the message does not mention \"" << needle << "\": " << *error;
  }
  return ::testing::AssertionSuccess();
}

/// The message `call` raises, or std::nullopt if it returns normally.
inline std::optional<std::string> error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return std::nullopt;
}

/// Checks that every rank raised an error that mentions `needle`.
inline void expect_every_rank_raised(const std::vector<std::optional<std::string>>& errors,
                                     const std::string& needle) {
  for (size_t rank = 0; rank < errors.size(); ++rank) {
    EXPECT_TRUE(mentions(errors[rank], needle)) << "on rank " << rank;
  }
}

}  // namespace torch_mp::testing
