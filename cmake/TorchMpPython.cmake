# The Python extension torch_mp._C: the core's objects plus the pybind11 bindings.
# It is compiled against the pybind11 that torch bundles in torch/include (a second pybind11 on
# the include path would break type sharing with torch at run time) and links torch_python,
# which TORCH_LIBRARIES lacks.
find_package(Python3 REQUIRED COMPONENTS Interpreter Development.Module)
find_library(TORCH_PYTHON_LIBRARY torch_python PATHS "${TORCH_INSTALL_PREFIX}/lib" REQUIRED)

Python3_add_library(_C MODULE WITH_SOABI
  csrc/python/bindings.cpp
  csrc/python/checkpoint_bindings.cpp
  csrc/python/data_parallel_bindings.cpp
  csrc/python/layer_bindings.cpp
  csrc/python/optim_bindings.cpp
  csrc/python/pipeline_bindings.cpp
  csrc/python/plan_bindings.cpp
  csrc/python/recompute_bindings.cpp
  csrc/python/context_parallel_bindings.cpp
  csrc/python/moe_bindings.cpp
  csrc/python/tensor_parallel_bindings.cpp
  $<TARGET_OBJECTS:torch_mp_core>)
torch_mp_unity_build(_C 7)
target_include_directories(_C PRIVATE ${PROJECT_SOURCE_DIR}/csrc)
target_link_libraries(_C PRIVATE ${TORCH_MP_TORCH_LIBRARIES} ${TORCH_PYTHON_LIBRARY})
target_compile_definitions(_C PRIVATE TORCH_EXTENSION_NAME=_C)
if(NOT TORCH_MP_PYTHON_OUTPUT_DIR)
  set(TORCH_MP_PYTHON_OUTPUT_DIR ${PROJECT_SOURCE_DIR}/torch_mp)
endif()
set_target_properties(_C PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${TORCH_MP_PYTHON_OUTPUT_DIR})
