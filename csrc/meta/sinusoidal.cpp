// Meta kernels of the sinusoidal family: the same checks and output metadata as CPU, no data read.
#include "common/sinusoidal.h"
#include "families.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace posenc {
namespace {

at::Tensor sinusoidal_meta(const at::Tensor& positions, const at::Tensor& inv_freq, c10::string_view layout,
                           std::optional<at::ScalarType> dtype, int64_t offset,
                           const std::optional<at::Tensor>& pair_axis) {
  const auto out_dtype = check_sinusoidal(positions, inv_freq, layout, dtype, pair_axis);
  auto sizes = positions.sym_sizes().slice(pair_axis ? 1 : 0).vec();
  sizes.push_back(inv_freq.sym_size(0) * 2);
  return at::empty_symint(sizes, positions.options().dtype(out_dtype));
}

at::Tensor add_sinusoidal_meta(const at::Tensor& x, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                               double x_scale, c10::string_view layout, int64_t offset,
                               const std::optional<at::Tensor>& pair_axis, int64_t num_prefix_tokens) {
  check_add_sinusoidal(x, positions, inv_freq, layout, pair_axis, num_prefix_tokens);
  return at::empty_symint(x.sym_sizes(), x.options());
}

at::Tensor embed_sinusoidal_meta(const at::Tensor& tokens, const at::Tensor& token_weight,
                                 const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                                 double token_scale, std::optional<int64_t> padding_idx, c10::string_view layout,
                                 int64_t offset) {
  check_embed_sinusoidal(tokens, token_weight, positions, inv_freq, padding_idx, layout);
  auto sizes = tokens.sym_sizes().vec();
  sizes.push_back(token_weight.sym_size(1));
  return at::empty_symint(sizes, token_weight.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) { POSENC_SINUSOIDAL_OPS(POSENC_IMPL_SUFFIXED, _meta) }

}  // namespace posenc
