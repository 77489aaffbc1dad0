# posenc_find_torch_cpu([REQUIRED|QUIET]): find_package(Torch) for code that links LibTorch's CPU part only,
# the imported targets torch_cpu and c10. Used by posenc's build and by posencConfig.cmake.
#
# In a CUDA build of torch (the default torch wheel on Linux), TorchConfig.cmake looks for a complete CUDA
# toolkit (nvcc, cudart, nvrtc...) and stops the configure when it finds none ("Could NOT find CUDA") or part
# of one (CUDA_nvrtc_LIBRARY NOTFOUND), even for code that never touches CUDA. That lookup (Caffe2's
# public/cuda.cmake) returns at once when the target torch::cudart already exists, and only torch's CUDA
# targets use torch::cudart (c10_cuda, torch_cuda, and torch, which links torch_cuda). An empty stand-in for
# it lets the config load with no toolkit; code that finds torch this way links torch_cpu and c10, never
# torch or ${TORCH_LIBRARIES}. Where torch is already found (a program that needs torch's CUDA targets calls
# find_package(Torch) with its toolkit first) or torch::cudart exists, nothing is stood in.
#
# TorchConfig.cmake gives two things to the target torch only, which torch_cpu gets here too: the C++
# frontend's headers (<torch/nn/...>, <torch/script.h>) and the C++ standard torch's headers are written in
# (C++20 for torch 2.13 and 2.14; torch 2.14's headers do not compile as C++17).
macro(posenc_find_torch_cpu)
  if(NOT TARGET torch_cpu AND NOT TARGET torch::cudart)
    add_library(torch::cudart INTERFACE IMPORTED)
  endif()
  find_package(Torch ${ARGN})
  if(Torch_FOUND)
    set_property(TARGET torch_cpu APPEND PROPERTY INTERFACE_INCLUDE_DIRECTORIES ${TORCH_INCLUDE_DIRS})
    get_target_property(_posenc_torch_cxx_standard torch CXX_STANDARD)
    if(_posenc_torch_cxx_standard)
      set_property(TARGET torch_cpu APPEND PROPERTY INTERFACE_COMPILE_FEATURES cxx_std_${_posenc_torch_cxx_standard})
    endif()
  endif()
endmacro()
