// CUDA kernel of rope_inv_freq_for_length: the frequencies for a length held on the GPU. The configuration ops
// without a tensor argument (rope_inv_freq, sinusoidal_inv_freq, alibi_slopes, and zigzag_positions, whose device
// argument picks where its arange runs) keep their CompositeExplicitAutograd kernels on every device, and
// zigzag_positions_varlen runs on the host (cuda/host.cu).
#include "config/rope_scaling.h"
#include "cuda/utils.cuh"
#include "portable/frequencies.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

namespace posenc::cuda {
namespace {

// Frequencies formed on the host travel to the GPU in the kernel's parameters: no copy and no synchronization,
// and a CUDA graph captures them with the launch. Two sets of 240 float64 fit the 4 KiB of parameters that
// every GPU takes; longer sets take several launches.
constexpr int64_t kParamValues = 240;

struct HostFrequencies {
  double within[kParamValues];  // those of every length up to the context
  double beyond[kParamValues];  // kStep: those of every length past it
};

// out[i] for the length on the device: within[i] up to the context, past it beyond[i] (kStep) or dynamic NTK's
// frequency of pair first + i at that length (kGrowing, where a NaN length is past it and gives NaN, as on the
// CPU); no length (kNone): within[i].
__global__ void select_frequencies_kernel(const __grid_constant__ HostFrequencies values, int64_t n,
                                          const double* length, double context, bool growing,
                                          portable::DynamicNtk ntk, int64_t first, double* out) {
  const int64_t i = threadIdx.x;
  if (i >= n) return;
  bool past = false;
  if (length != nullptr) past = growing ? !(*length <= context) : *length > context;
  if (!past) {
    out[i] = values.within[i];
  } else {
    out[i] = growing ? portable::dynamic_ntk_inv_freq(ntk, *length, first + i) : values.beyond[i];
  }
}

// The frequencies of the length in seq_len (a 0-d tensor on the GPU), as the CPU's rope_for_length gives them,
// without reading the length: whatever does not vary with it is the CPU's code run on the host (the frequencies
// of every length up to the context, and LongRoPE's long ones past it), and one kernel picks by the length. Past
// the context, dynamic NTK's frequencies are a function of the length, which the kernel evaluates with the CPU's
// formula and posenc's own exp and log (portable/frequencies.h): the CPU's bits.
at::Tensor rope_inv_freq_for_length_cuda(const at::Tensor& seq_len, int64_t rotary_dim, double base,
                                         c10::string_view rope_type POSENC_SCALING_PARAMETERS) {
  using frequencies::LengthDependence;
  const auto scaling = POSENC_SCALING(rope_type);
  frequencies::check_rope_for_length(rotary_dim, base, scaling, seq_len);  // the CPU's checks, in its order
  const auto dependence = frequencies::length_dependence(rotary_dim, base, scaling);
  const auto host_length = [](double length) {
    return at::scalar_tensor(length, at::TensorOptions().dtype(at::kDouble));
  };
  const auto within = frequencies::rope_for_length(rotary_dim, base, scaling, host_length(0.0)).contiguous();
  const auto beyond = dependence.kind == LengthDependence::kStep
                          ? frequencies::rope_for_length(rotary_dim, base, scaling,
                                                         host_length(std::numeric_limits<double>::infinity()))
                                .contiguous()
                          : within;

  const c10::cuda::CUDAGuard guard(seq_len.device());
  auto out = at::empty({within.numel()}, seq_len.options().dtype(at::kDouble));
  const auto length = dependence.kind == LengthDependence::kNone ? at::Tensor() : seq_len.to(at::kDouble);
  const bool growing = dependence.kind == LengthDependence::kGrowing;
  const double* within_values = within.const_data_ptr<double>();
  const double* beyond_values = beyond.const_data_ptr<double>();
  for (int64_t first = 0; first < within.numel(); first += kParamValues) {
    const int64_t n = std::min(kParamValues, within.numel() - first);
    HostFrequencies values{};
    std::copy(within_values + first, within_values + first + n, values.within);
    std::copy(beyond_values + first, beyond_values + first + n, values.beyond);
    select_frequencies_kernel<<<1, kThreads, 0, current_stream()>>>(
        values, n, length.defined() ? length.const_data_ptr<double>() : nullptr, dependence.context, growing,
        dependence.ntk, first, out.mutable_data_ptr<double>() + first);
    POSENC_CUDA_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("rope_inv_freq_for_length", TORCH_FN(rope_inv_freq_for_length_cuda));
}

}  // namespace posenc::cuda
