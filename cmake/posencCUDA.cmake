# posenc_add_cuda_kernels(TARGET): the CUDA kernels (csrc/cuda/*.cu) in TARGET, when POSENC_CUDA says so.
#
# POSENC_CUDA=AUTO (the default) builds them when torch is a CUDA build (its package defines the target c10_cuda)
# and CMake finds nvcc; ON requires both; OFF never builds them. With a CPU build of torch, AUTO looks for no CUDA
# at all. Called after find_package(Torch) (which sets TORCH_LIBRARIES) and after TARGET exists; a macro, because enable_language(CUDA) must
# run in the directory's scope.
#
# The kernels use c10's CUDA part only (c10_cuda: streams, guards, errors) and the CUDA runtime: no cuBLAS or
# other libraries of the toolkit. Where torch was found without a CUDA toolkit (its target torch::cudart then
# stands empty), the runtime found here fills it. nvcc compiles with --fmad=false, as the C++ code compiles with
# -ffp-contract=off: no product is fused into a sum unless the code says so, so the GPU rounds every shared
# formula as the CPU does. CMAKE_CUDA_ARCHITECTURES (or the environment variable CUDAARCHS) picks the GPUs; the
# default is 80-real;90 (A100: machine code; H100/H200: machine code and PTX for newer GPUs).
macro(posenc_add_cuda_kernels target)
  set(POSENC_CUDA AUTO CACHE STRING "Build the CUDA kernels: AUTO (with a CUDA build of torch and nvcc), ON or OFF")
  set_property(CACHE POSENC_CUDA PROPERTY STRINGS AUTO ON OFF)
  set(POSENC_WITH_CUDA OFF)
  if(NOT POSENC_CUDA STREQUAL "OFF")
    if(NOT TARGET c10_cuda)
      if(POSENC_CUDA STREQUAL "ON")
        message(FATAL_ERROR "posenc: POSENC_CUDA=ON needs a CUDA build of torch; the torch found is a CPU build")
      endif()
    else()
      if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
        set(CMAKE_CUDA_ARCHITECTURES 80-real 90)
      endif()
      include(CheckLanguage)
      check_language(CUDA)
      if(CMAKE_CUDA_COMPILER)
        set(POSENC_WITH_CUDA ON)
      elseif(POSENC_CUDA STREQUAL "ON")
        message(FATAL_ERROR "posenc: POSENC_CUDA=ON but no CUDA compiler was found (put nvcc on PATH or set CUDACXX)")
      else()
        message(STATUS "posenc: torch is a CUDA build but no CUDA compiler was found: CPU kernels only")
      endif()
    endif()
  endif()

  if(POSENC_WITH_CUDA)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    message(STATUS "posenc: CUDA kernels for architectures ${CMAKE_CUDA_ARCHITECTURES} (nvcc ${CMAKE_CUDA_COMPILER_VERSION})")
    if(CCACHE_PROGRAM AND NOT CMAKE_CUDA_COMPILER_LAUNCHER)
      set(CMAKE_CUDA_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
    endif()
    get_target_property(_posenc_cudart torch::cudart INTERFACE_LINK_LIBRARIES)
    if(NOT _posenc_cudart)  # torch was found without a toolkit: its runtime target stands empty
      set_property(TARGET torch::cudart APPEND PROPERTY INTERFACE_LINK_LIBRARIES CUDA::cudart)
    endif()
    # The .cu files compile into an object library of their own, with nvcc's options only, and join TARGET.
    get_target_property(_posenc_cuda_standard torch CXX_STANDARD)  # the standard torch's headers are written in
    if(NOT _posenc_cuda_standard)
      set(_posenc_cuda_standard ${CMAKE_CXX_STANDARD})
    endif()
    file(GLOB POSENC_CUDA_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/*.cu)
    add_library(posenc_cuda OBJECT ${POSENC_CUDA_SOURCES})
    # CMake before 3.27 knows no flag for nvcc's C++20 (nvcc has it since CUDA 12): name it.
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION -std=c++20)
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION -std=c++20)
    endif()
    set_target_properties(posenc_cuda PROPERTIES POSITION_INDEPENDENT_CODE ON CUDA_STANDARD ${_posenc_cuda_standard}
                                                 CUDA_STANDARD_REQUIRED ON)
    # torch_cpu's headers and definitions, not the target itself, whose C++ standard feature CMake would also
    # ask of nvcc (and refuse).
    target_include_directories(posenc_cuda PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/csrc ${CMAKE_CURRENT_SOURCE_DIR}/csrc/include
                                                   ${TORCH_INCLUDE_DIRS})
    target_compile_definitions(posenc_cuda PRIVATE $<TARGET_PROPERTY:torch_cpu,INTERFACE_COMPILE_DEFINITIONS>)
    target_link_libraries(posenc_cuda PRIVATE c10_cuda CUDA::cudart)
    target_compile_options(posenc_cuda PRIVATE -O3 --fmad=false --expt-relaxed-constexpr -Xcompiler=-Wall)
    target_sources(${target} PRIVATE $<TARGET_OBJECTS:posenc_cuda>)
    target_link_libraries(${target} PRIVATE c10_cuda CUDA::cudart)
    set_target_properties(${target} PROPERTIES CUDA_RUNTIME_LIBRARY Shared)
  endif()
endmacro()
