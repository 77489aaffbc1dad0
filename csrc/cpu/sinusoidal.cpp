// CPU ops of the sinusoidal family: checks, positions, allocation, dtype dispatch; the loops are in
// cpu/kernels/additive.cpp.
#include "common/positions.h"
#include "common/sinusoidal.h"
#include "cpu/kernels/additive.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

namespace posenc {
namespace {

// out = in * scale + PE(positions): the encodings of `pos` ([P], shared by rows / P leading indices) added
// to `rows` rows of `width` channels.
template <typename scalar_t>
void encode(RowInput<scalar_t> in, const at::Tensor& out, const std::vector<double>& pos, const Frequencies& freq,
            SinusoidalLayout layout, double scale) {
  const int64_t width = out.size(-1);
  cpu::sinusoidal_stub<scalar_t>({in, out.mutable_data_ptr<scalar_t>(), out.numel() / width, width, pos.data(),
                                  static_cast<int64_t>(pos.size()), freq.data(), freq.size(), freq.max_abs(), layout,
                                  scale});
}

at::Tensor sinusoidal_cpu(const at::Tensor& positions, const at::Tensor& inv_freq, c10::string_view layout,
                          std::optional<at::ScalarType> dtype, int64_t offset) {
  constexpr const char* op = "sinusoidal";
  const auto out_dtype = check_sinusoidal(positions, inv_freq, layout, dtype);
  auto sizes = positions.sizes().vec();
  sizes.push_back(2 * inv_freq.size(0));
  auto out = at::empty(sizes, positions.options().dtype(out_dtype));
  if (out.numel() == 0) return out;
  const auto pos = read_positions<double>(op, positions, 0, offset, angle_domain());
  const Frequencies freq(inv_freq);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "posenc_sinusoidal", [&] {
    encode<scalar_t>({}, out, pos, freq, parse_sinusoidal_layout(op, layout), 1.0);
  });
  return out;
}

at::Tensor add_sinusoidal_cpu(const at::Tensor& x, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                              double x_scale, c10::string_view layout, int64_t offset) {
  constexpr const char* op = "add_sinusoidal";
  check_add_sinusoidal(x, positions, inv_freq, layout);
  const auto input = x.contiguous();
  auto out = at::empty_like(input, at::MemoryFormat::Contiguous);
  if (input.numel() == 0) return out;
  const auto pos = read_positions<double>(op, positions, input.size(-2), offset, angle_domain());
  const Frequencies freq(inv_freq);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "posenc_add_sinusoidal", [&] {
    encode<scalar_t>({input.const_data_ptr<scalar_t>()}, out, pos, freq, parse_sinusoidal_layout(op, layout), x_scale);
  });
  return out;
}

at::Tensor embed_sinusoidal_cpu(const at::Tensor& tokens, const at::Tensor& token_weight,
                                const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq, double token_scale,
                                std::optional<int64_t> padding_idx, c10::string_view layout, int64_t offset) {
  constexpr const char* op = "embed_sinusoidal";
  check_embed_sinusoidal(tokens, token_weight, positions, inv_freq, padding_idx, layout);
  check_indices_in_range(op, "tokens", tokens, token_weight.size(0), "the vocabulary of token_weight, size");
  auto sizes = tokens.sizes().vec();
  sizes.push_back(token_weight.size(1));
  auto out = at::empty(sizes, token_weight.options());
  if (out.numel() == 0) return out;
  const auto pos = read_positions<double>(op, positions, tokens.size(-1), offset, angle_domain());
  const auto ids = tokens.to(at::kLong).contiguous();
  const auto weight = token_weight.contiguous();
  const Frequencies freq(inv_freq);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "posenc_embed_sinusoidal", [&] {
    encode<scalar_t>({weight.const_data_ptr<scalar_t>(), ids.const_data_ptr<int64_t>()}, out, pos, freq,
                     parse_sinusoidal_layout(op, layout), token_scale);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("sinusoidal", TORCH_FN(sinusoidal_cpu));
  m.impl("add_sinusoidal", TORCH_FN(add_sinusoidal_cpu));
  m.impl("embed_sinusoidal", TORCH_FN(embed_sinusoidal_cpu));
}

}  // namespace posenc
