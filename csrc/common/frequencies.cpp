#include <posenc/frequencies.h>
#include <posenc/posenc.h>

#include <ATen/ops/arange.h>
#include <c10/util/Exception.h>

namespace posenc {

int64_t version() { return 100; }

namespace frequencies {

at::Tensor sinusoidal(int64_t dim, double base, int64_t shift) {
  TORCH_CHECK(dim >= 2, "posenc.frequencies.sinusoidal: dim must be at least 2, got ", dim);
  TORCH_CHECK(base > 0, "posenc.frequencies.sinusoidal: base must be positive, got ", base);
  TORCH_CHECK(shift == 0 || shift == 1, "posenc.frequencies.sinusoidal: shift must be 0 or 1, got ", shift);
  const int64_t pairs = dim / 2;
  TORCH_CHECK(pairs - shift > 0, "posenc.frequencies.sinusoidal: dim ", dim, " has ", pairs,
              " frequency pairs, too few for shift ", shift);
  const auto i = at::arange(pairs, at::TensorOptions().dtype(at::kDouble));
  return i.mul(-std::log(base) / static_cast<double>(pairs - shift)).exp();
}

}  // namespace frequencies
}  // namespace posenc
