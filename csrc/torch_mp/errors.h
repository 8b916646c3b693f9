#pragma once
// The core's typed refusals, beside c10's (TORCH_CHECK_VALUE and the like): what an error is,
// not only what it says, so that both front ends can tell them apart without reading the text.
// torch_mp._C turns each into its Python type (python/bindings.cpp, the one translator).

#include <c10/util/Exception.h>

#include <string>

namespace torch_mp {

/// A layout the model cannot take: a size not divisible by a parallel degree (heads by tp,
/// experts by ep, a world by tp x pp x cp, micro-batches by the pipeline ranks), or a setting the
/// layout cannot run. Raised alike by the runtime (the layers, the mesh, the schedules) and by
/// plan::estimate, which calls the same checks, so the message is the same from both. A
/// c10::ValueError; in Python torch_mp.LayoutError, a ValueError (and a RuntimeError, what these
/// refusals were before they had a type).
class LayoutError : public c10::ValueError {
 public:
  LayoutError(c10::SourceLocation where, std::string message)
      : c10::ValueError(where, std::move(message)) {}
};

}  // namespace torch_mp

/// TORCH_CHECK for a layout: throws torch_mp::LayoutError with the arguments' text.
#define TORCH_MP_CHECK_LAYOUT(condition, ...)                                              \
  do {                                                                                     \
    if (C10_UNLIKELY_OR_CONST(!(condition))) {                                             \
      throw ::torch_mp::LayoutError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, \
                                    ::c10::str(__VA_ARGS__));                              \
    }                                                                                      \
  } while (false)
