#include <posenc/frequencies.h>

#include <ATen/ops/arange.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace posenc {
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

namespace {

constexpr const char* kRope = "posenc.frequencies.rope";

double require(const std::optional<double>& value, const char* key, const std::string& rope_type) {
  TORCH_CHECK(value.has_value(), kRope, ": rope_type \"", rope_type, "\" needs ", key);
  return *value;
}

// `factor` of yarn and longrope: the explicit one, else max_position_embeddings / original.
double context_factor(const RopeScaling& scaling, double original) {
  if (scaling.factor) return *scaling.factor;
  return require(scaling.max_position_embeddings, "factor or max_position_embeddings", scaling.rope_type) / original;
}

// YaRN's attention factor g(s, m) = 0.1 m ln s + 1 (1 for s <= 1).
double yarn_mscale(double scale, double mscale = 1.0) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

at::Tensor theta_powers(int64_t rotary_dim, double theta) {
  const auto exponent = at::arange(0, rotary_dim, 2, at::TensorOptions().dtype(at::kDouble)).div(rotary_dim);
  return exponent.mul(-std::log(theta)).exp();
}

at::Tensor yarn(const at::Tensor& inv_freq, int64_t rotary_dim, double base, const RopeScaling& scaling,
                double original, double factor) {
  const double beta_fast = scaling.beta_fast.value_or(0.0) != 0.0 ? *scaling.beta_fast : 32.0;
  const double beta_slow = scaling.beta_slow.value_or(0.0) != 0.0 ? *scaling.beta_slow : 1.0;
  // The pair index whose wavelength fits `rotations` times into the original context.
  const auto correction = [&](double rotations) {
    return rotary_dim * std::log(original / (rotations * 2.0 * M_PI)) / (2.0 * std::log(base));
  };
  double low = correction(beta_fast);
  double high = correction(beta_slow);
  if (scaling.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(rotary_dim - 1));
  if (low == high) high += 0.001;  // as Hugging Face: avoids a zero-width ramp
  const auto ramp = at::arange(rotary_dim / 2, inv_freq.options()).sub(low).div(high - low).clamp(0.0, 1.0);
  const auto extrapolation = ramp.neg().add(1.0);
  return inv_freq.div(factor).mul(ramp).add(inv_freq.mul(extrapolation));
}

at::Tensor llama3(const at::Tensor& inv_freq, const RopeScaling& scaling) {
  const double factor = scaling.factor.value_or(8.0);
  const double low = scaling.low_freq_factor.value_or(1.0);
  const double high = scaling.high_freq_factor.value_or(4.0);
  const double original = scaling.original_max_position_embeddings.value_or(8192.0);
  const auto wavelength = inv_freq.reciprocal().mul(2.0 * M_PI);
  const auto scaled = at::where(wavelength.gt(original / low), inv_freq.div(factor), inv_freq);
  const auto smooth = wavelength.reciprocal().mul(original).sub(low).div(high - low);
  const auto smoothed = scaled.div(factor).mul(smooth.neg().add(1.0)).add(scaled.mul(smooth));
  const auto medium = wavelength.ge(original / high).logical_and(wavelength.le(original / low));
  return at::where(medium, smoothed, scaled);
}

}  // namespace

RopeFrequencies rope(int64_t rotary_dim, double base, const RopeScaling& scaling, std::optional<int64_t> seq_len) {
  TORCH_CHECK(rotary_dim >= 2 && rotary_dim % 2 == 0, kRope, ": rotary_dim must be even and at least 2, got ",
              rotary_dim);
  const double theta = scaling.rope_theta.value_or(base);
  TORCH_CHECK(theta > 0, kRope, ": base (rope_theta) must be positive, got ", theta);
  auto type = scaling.rope_type;
  if (type == "ntk_alpha" || (type == "dynamic" && scaling.alpha.value_or(0.0) != 0.0)) type = "ntk";  // HunYuan
  const auto inv_freq = theta_powers(rotary_dim, theta);
  const int64_t pairs = rotary_dim / 2;
  const auto ntk_exponent = [&](const char* what) {
    TORCH_CHECK(rotary_dim > 2, kRope, ": rope_type \"", type, "\" rescales the base by ", what,
                "^(r / (r - 2)), undefined for rotary_dim 2");
    return static_cast<double>(rotary_dim) / static_cast<double>(rotary_dim - 2);
  };

  if (type == "default") return {inv_freq, 1.0};
  if (type == "linear") return {inv_freq.div(require(scaling.factor, "factor", type)), 1.0};
  if (type == "dynamic") {
    const double factor = require(scaling.factor, "factor", type);
    const double limit = require(scaling.max_position_embeddings, "max_position_embeddings", type);
    const double length = std::max(seq_len ? static_cast<double>(*seq_len) : limit, limit);
    const double scale = factor * length / limit - (factor - 1.0);
    return {theta_powers(rotary_dim, theta * std::pow(scale, ntk_exponent("the scale"))), 1.0};
  }
  if (type == "ntk") {
    const double alpha = scaling.alpha ? *scaling.alpha : require(scaling.factor, "alpha (or factor)", type);
    return {theta_powers(rotary_dim, theta * std::pow(alpha, ntk_exponent("alpha"))), 1.0};
  }
  if (type == "yarn") {
    const double original = require(
        scaling.original_max_position_embeddings ? scaling.original_max_position_embeddings
                                                 : scaling.max_position_embeddings,
        "original_max_position_embeddings", type);
    const double factor = context_factor(scaling, original);
    double attention = 0.0;
    if (scaling.attention_factor) {
      attention = *scaling.attention_factor;
    } else if (scaling.mscale.value_or(0.0) != 0.0 && scaling.mscale_all_dim.value_or(0.0) != 0.0) {
      attention = yarn_mscale(factor, *scaling.mscale) / yarn_mscale(factor, *scaling.mscale_all_dim);  // DeepSeek
    } else {
      attention = yarn_mscale(factor);
    }
    return {yarn(inv_freq, rotary_dim, theta, scaling, original, factor), attention};
  }
  if (type == "llama3") return {llama3(inv_freq, scaling), 1.0};
  if (type == "longrope") {
    const double original = require(
        scaling.original_max_position_embeddings ? scaling.original_max_position_embeddings
                                                 : scaling.max_position_embeddings,
        "original_max_position_embeddings", type);
    for (const auto* ext : {&scaling.short_factor, &scaling.long_factor}) {
      TORCH_CHECK(static_cast<int64_t>(ext->size()) == pairs, kRope, ": rope_type \"longrope\" needs ",
                  ext == &scaling.long_factor ? "long_factor" : "short_factor", " of rotary_dim / 2 = ", pairs,
                  " values, got ", ext->size());
    }
    const bool is_long = seq_len && static_cast<double>(*seq_len) > original;
    const auto& ext = is_long ? scaling.long_factor : scaling.short_factor;
    const double factor = context_factor(scaling, original);
    const double attention = scaling.attention_factor.value_or(
        factor <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(factor) / std::log(original)));
    const auto ext_factor = at::from_blob(const_cast<double*>(ext.data()), {pairs}, inv_freq.options()).clone();
    return {inv_freq.div(ext_factor), attention};
  }
  TORCH_CHECK(false, kRope, ": unknown rope_type \"", scaling.rope_type,
              "\"; expected default, linear, dynamic, ntk, yarn, llama3 or longrope");
}

}  // namespace frequencies
}  // namespace posenc
