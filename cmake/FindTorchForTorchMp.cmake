# Finds LibTorch for torch_mp and sets
#   TORCH_MP_TORCH_LIBRARIES  what libtorch_mp links against
#   TORCH_MP_WITH_CUDA        ON when torch was built with CUDA and a CUDA compiler is present
#   GLOO_INCLUDE_DIR          Gloo headers (the torch wheel does not ship them), if found
#   NCCL_INCLUDE_DIR          nccl.h (the CUDA wheel's nvidia-nccl package, or the system's), if
#                             found on a CUDA build: C++ can then create NCCL groups
#
# Torch's own CMake config insists on a CUDA toolkit when the wheel is a CUDA build, and on an
# architecture list when no GPU is present: we default CUDA_TOOLKIT_ROOT_DIR to /usr/local/cuda
# and TORCH_CUDA_ARCH_LIST to 9.0 when they are unset.
if(NOT Torch_FOUND)
  if(NOT DEFINED CUDA_TOOLKIT_ROOT_DIR AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CUDA_TOOLKIT_ROOT_DIR /usr/local/cuda)
  endif()
  if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT TORCH_CUDA_ARCH_LIST)
    set(TORCH_CUDA_ARCH_LIST "9.0")
  endif()
  find_package(Torch QUIET)
  if(NOT Torch_FOUND)
    # Not on the prefix path: ask the Python that has torch installed where its CMake files are.
    find_package(Python3 COMPONENTS Interpreter QUIET)
    if(Python3_FOUND)
      execute_process(
        COMMAND ${Python3_EXECUTABLE} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
        OUTPUT_VARIABLE _torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
      list(APPEND CMAKE_PREFIX_PATH "${_torch_prefix}")
    endif()
    find_package(Torch REQUIRED)
  endif()
endif()

# A CUDA wheel lists libraries (nvrtc) that a toolkit without them leaves NOTFOUND; torch loads
# those lazily, so linking does not need them.
set(TORCH_MP_TORCH_LIBRARIES ${TORCH_LIBRARIES})
list(FILTER TORCH_MP_TORCH_LIBRARIES EXCLUDE REGEX "NOTFOUND")

set(TORCH_MP_WITH_CUDA OFF)
if(TARGET torch_cuda OR TORCH_CUDA_LIBRARIES)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(TORCH_MP_WITH_CUDA ON)
  endif()
endif()

find_path(GLOO_INCLUDE_DIR gloo/algorithm.h)

if(TORCH_MP_WITH_CUDA)
  find_path(NCCL_INCLUDE_DIR nccl.h
    HINTS "${TORCH_INSTALL_PREFIX}/../nvidia/nccl/include" "${CUDA_TOOLKIT_ROOT_DIR}/include")
  # ProcessGroupNCCL.hpp reaches the CUDA libraries' headers (cusparse.h, ...), which a bare
  # toolkit may lack and the CUDA wheel's nvidia packages ship.
  file(GLOB TORCH_MP_NVIDIA_INCLUDE_DIRS "${TORCH_INSTALL_PREFIX}/../nvidia/*/include")
endif()
