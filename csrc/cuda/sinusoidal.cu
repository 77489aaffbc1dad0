// CUDA ops of the sinusoidal family: the CPU op layer's checks and outputs, the shared angle engine, the
// additive kernel of cuda/additive.cuh.
#include "common/positions.h"
#include "common/sinusoidal.h"
#include "cuda/additive.cuh"
#include "cuda/positions.cuh"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

namespace posenc::cuda {
namespace {

// out = in * scale + PE(positions): `pos` ([P] float64, or undefined: offset + arange(P)) shared by the
// out.numel() / width / P leading indices.
template <typename scalar_t>
void encode(const scalar_t* in, const at::Tensor& ids, int64_t vocab, const at::Tensor& out, const at::Tensor& pos,
            int64_t num_positions, int64_t offset, const at::Tensor& inv_freq, SinusoidalLayout layout,
            double scale) {
  const int64_t width = out.size(-1);
  const int64_t rows = out.numel() / width;
  const auto freq = inv_freq.to(at::kDouble).contiguous();
  const SinusoidalEncoding<opmath_t<scalar_t>> encoding{pos.defined() ? pos.const_data_ptr<double>() : nullptr,
                                                         offset, freq.const_data_ptr<double>(), freq.numel(), layout};
  launch_additive<scalar_t>({in, ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr, vocab,
                             out.mutable_data_ptr<scalar_t>(), rows / num_positions, num_positions, width,
                             2 * freq.numel(), 0, 0},
                            scale, encoding, true);
}

at::Tensor sinusoidal_cuda(const at::Tensor& positions, const at::Tensor& inv_freq, c10::string_view layout,
                           std::optional<at::ScalarType> dtype, int64_t offset) {
  constexpr const char* op = "sinusoidal";
  const auto out_dtype = check_sinusoidal(positions, inv_freq, layout, dtype);
  auto sizes = positions.sizes().vec();
  sizes.push_back(2 * inv_freq.size(0));
  auto out = at::empty(sizes, positions.options().dtype(out_dtype));
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(positions.device());
  const auto pos = angle_positions(op, positions, 0, offset);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "posenc_sinusoidal_cuda", [&] {
    encode<scalar_t>(nullptr, {}, 0, out, pos, pos.numel(), offset, inv_freq, parse_sinusoidal_layout(op, layout),
                     1.0);
  });
  return out;
}

at::Tensor add_sinusoidal_cuda(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                               const at::Tensor& inv_freq, double x_scale, c10::string_view layout, int64_t offset) {
  constexpr const char* op = "add_sinusoidal";
  check_add_sinusoidal(x, positions, inv_freq, layout);
  const auto input = x.contiguous();
  auto out = at::empty_like(input, at::MemoryFormat::Contiguous);
  if (input.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t seq = input.size(-2);
  const auto pos = angle_positions(op, positions, seq, offset);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "posenc_add_sinusoidal_cuda", [&] {
    encode<scalar_t>(input.const_data_ptr<scalar_t>(), {}, 0, out, pos, pos.defined() ? pos.numel() : seq, offset,
                     inv_freq, parse_sinusoidal_layout(op, layout), x_scale);
  });
  return out;
}

at::Tensor embed_sinusoidal_cuda(const at::Tensor& tokens, const at::Tensor& token_weight,
                                 const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                                 double token_scale, std::optional<int64_t> padding_idx, c10::string_view layout,
                                 int64_t offset) {
  constexpr const char* op = "embed_sinusoidal";
  check_embed_sinusoidal(tokens, token_weight, positions, inv_freq, padding_idx, layout);
  const c10::cuda::CUDAGuard guard(tokens.device());
  check_indices_in_range(op, "tokens", tokens, token_weight.size(0), "the vocabulary of token_weight, size");
  auto sizes = tokens.sizes().vec();
  sizes.push_back(token_weight.size(1));
  auto out = at::empty(sizes, token_weight.options());
  if (out.numel() == 0) return out;
  const int64_t seq = tokens.size(-1);
  const auto pos = angle_positions(op, positions, seq, offset);
  const auto ids = tokens.to(at::kLong).contiguous();
  const auto weight = token_weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "posenc_embed_sinusoidal_cuda", [&] {
    encode<scalar_t>(weight.const_data_ptr<scalar_t>(), ids, weight.size(0), out, pos,
                     pos.defined() ? pos.numel() : seq, offset, inv_freq, parse_sinusoidal_layout(op, layout),
                     token_scale);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("sinusoidal", TORCH_FN(sinusoidal_cuda));
  m.impl("add_sinusoidal", TORCH_FN(add_sinusoidal_cuda));
  m.impl("embed_sinusoidal", TORCH_FN(embed_sinusoidal_cuda));
}

}  // namespace posenc::cuda
