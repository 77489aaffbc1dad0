// The frequency formulas of every family, written once: the C++ API (posenc::frequencies), the ops
// registered in frequencies_ops.cpp and, through those ops, Python's posenc.frequencies all compute here.
#include <posenc/frequencies.h>

#include "common/rope_scaling.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <string>
#include <string_view>

namespace posenc {
namespace frequencies {

namespace {

constexpr const char* kRope = "posenc.frequencies.rope";

// A double as Python prints it (shortest round trip, "8.0" rather than "8"), so that an error quotes the value
// the user wrote.
std::string repr(double value) {
  char buffer[32];
  const auto end = std::to_chars(buffer, buffer + sizeof(buffer), value).ptr;
  std::string text(buffer, end);
  if (text.find_first_of(".ein") == std::string::npos) text += ".0";
  return text;
}

// The name of a scaling value in messages: "llama3 factor", "longrope short_factor[3]", "base". Built only when a
// check fails: these checks run on every call of a module whose frequencies follow the length.
std::string label(std::string_view type, std::string_view key, int64_t index = -1) {
  std::string text(type);
  if (!text.empty()) text += ' ';
  text += key;
  if (index >= 0) text += "[" + std::to_string(index) + "]";
  return text;
}

// A value the formulas read must be finite and positive.
double positive(const char* op, std::string_view type, std::string_view key, double value, int64_t index = -1) {
  TORCH_CHECK_VALUE(std::isfinite(value), op, ": ", label(type, key, index), " must be finite, got ", repr(value));
  TORCH_CHECK_VALUE(value > 0, op, ": ", label(type, key, index), " must be positive, got ", repr(value));
  return value;
}

// A key the scaling type cannot do without.
double required(const std::string& type, const char* key, const std::optional<double>& value) {
  TORCH_CHECK_VALUE(value.has_value(), kRope, ": rope_type \"", type, "\" needs ", key);
  return positive(kRope, type, key, *value);
}

// A key with a default: the default applies only where the key is absent, never to a zero or negative value.
double optional(const std::string& type, const char* key, const std::optional<double>& value, double fallback) {
  return value ? positive(kRope, type, key, *value) : fallback;
}

// YaRN's attention factor g(s, m) = 0.1 m ln s + 1 (1 for s <= 1).
double yarn_mscale(double scale, double mscale = 1.0) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// A RopeScaling checked, with its type's defaults filled in: the numbers the formulas read.
struct Plan {
  std::string type;  // "ntk_alpha" and HunYuan's "dynamic" with an alpha are "ntk"
  int64_t rotary_dim = 0;
  double theta = 0.0;
  double factor = 1.0;   // linear, dynamic, yarn, llama3, longrope; ntk: alpha
  double context = 0.0;  // dynamic: max_position_embeddings; yarn, llama3, longrope: the original length
  double attention_scale = 1.0;
  double beta_fast = 32.0;  // yarn
  double beta_slow = 1.0;
  double low_freq_factor = 1.0;  // llama3
  double high_freq_factor = 4.0;
};

// yarn and longrope: original_max_position_embeddings, else max_position_embeddings.
double original_length(const std::string& type, const RopeScaling& s) {
  TORCH_CHECK_VALUE(s.original_max_position_embeddings || s.max_position_embeddings, kRope, ": rope_type \"", type,
                    "\" needs original_max_position_embeddings");
  return s.original_max_position_embeddings
             ? positive(kRope, type, "original_max_position_embeddings", *s.original_max_position_embeddings)
             : positive(kRope, type, "max_position_embeddings", *s.max_position_embeddings);
}

// yarn and longrope `factor`: the given one, else max_position_embeddings / original.
double context_factor(const std::string& type, const RopeScaling& s, double original) {
  if (s.factor) return positive(kRope, type, "factor", *s.factor);
  TORCH_CHECK_VALUE(s.max_position_embeddings, kRope, ": rope_type \"", type,
                    "\" needs factor or max_position_embeddings");
  return positive(kRope, type, "max_position_embeddings", *s.max_position_embeddings) / original;
}

void check_extension_factors(const char* key, const std::vector<double>& factors, int64_t pairs) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(factors.size()) == pairs, kRope, ": rope_type \"longrope\" needs ", key,
                    " of rotary_dim / 2 = ", pairs, " values, got ", factors.size());
  for (const auto i : c10::irange(factors.size())) {
    positive(kRope, "longrope", key, factors[i], static_cast<int64_t>(i));
  }
}

Plan plan(int64_t rotary_dim, double base, const RopeScaling& s) {
  TORCH_CHECK_VALUE(rotary_dim >= 2 && rotary_dim % 2 == 0, kRope, ": rotary_dim must be even and at least 2, got ",
                    rotary_dim);
  Plan p;
  p.rotary_dim = rotary_dim;
  p.type = s.rope_type;
  if (p.type == "ntk_alpha" || (p.type == "dynamic" && s.alpha)) p.type = "ntk";  // HunYuan
  const std::string& type = p.type;
  p.theta = positive(kRope, "", s.rope_theta ? "rope_theta" : "base", s.rope_theta.value_or(base));
  // Dynamic and fixed NTK raise the base to the power r / (r - 2).
  const auto check_ntk_dim = [&] {
    TORCH_CHECK_VALUE(rotary_dim > 2, kRope, ": rope_type \"", type,
                      "\" rescales the base by a power r / (r - 2), undefined for rotary_dim 2");
  };

  if (type == "default") return p;
  if (type == "linear") {
    p.factor = required(type, "factor", s.factor);
  } else if (type == "dynamic") {
    check_ntk_dim();
    p.factor = required(type, "factor", s.factor);
    p.context = required(type, "max_position_embeddings", s.max_position_embeddings);
  } else if (type == "ntk") {
    check_ntk_dim();
    TORCH_CHECK_VALUE(s.alpha || s.factor, kRope, ": rope_type \"ntk\" needs alpha (or factor)");
    p.factor = s.alpha ? positive(kRope, type, "alpha", *s.alpha) : positive(kRope, type, "factor", *s.factor);
  } else if (type == "yarn") {
    p.context = original_length(type, s);
    p.factor = context_factor(type, s, p.context);
    p.beta_fast = optional(type, "beta_fast", s.beta_fast, 32.0);
    p.beta_slow = optional(type, "beta_slow", s.beta_slow, 1.0);
    TORCH_CHECK_VALUE(p.beta_fast >= p.beta_slow, kRope, ": yarn beta_fast ", repr(p.beta_fast),
                      " must not be below beta_slow ", repr(p.beta_slow));
    TORCH_CHECK_VALUE(p.theta > 1.0, kRope, ": yarn ", s.rope_theta ? "rope_theta" : "base",
                      " must exceed 1 (the ramp divides by its logarithm), got ", repr(p.theta));
    const auto mscale = s.mscale ? std::optional(positive(kRope, type, "mscale", *s.mscale)) : std::nullopt;
    const auto mscale_all_dim =
        s.mscale_all_dim ? std::optional(positive(kRope, type, "mscale_all_dim", *s.mscale_all_dim)) : std::nullopt;
    if (s.attention_factor) {
      p.attention_scale = positive(kRope, type, "attention_factor", *s.attention_factor);
    } else if (mscale && mscale_all_dim) {  // DeepSeek
      p.attention_scale = yarn_mscale(p.factor, *mscale) / yarn_mscale(p.factor, *mscale_all_dim);
    } else {
      p.attention_scale = yarn_mscale(p.factor);
    }
  } else if (type == "llama3") {
    p.factor = optional(type, "factor", s.factor, 8.0);
    p.low_freq_factor = optional(type, "low_freq_factor", s.low_freq_factor, 1.0);
    p.high_freq_factor = optional(type, "high_freq_factor", s.high_freq_factor, 4.0);
    TORCH_CHECK_VALUE(p.high_freq_factor > p.low_freq_factor, kRope, ": llama3 high_freq_factor ",
                      repr(p.high_freq_factor), " must exceed low_freq_factor ", repr(p.low_freq_factor));
    p.context = optional(type, "original_max_position_embeddings", s.original_max_position_embeddings, 8192.0);
  } else if (type == "longrope") {
    p.context = original_length(type, s);
    check_extension_factors("short_factor", s.short_factor, rotary_dim / 2);
    check_extension_factors("long_factor", s.long_factor, rotary_dim / 2);
    p.factor = context_factor(type, s, p.context);
    if (s.attention_factor) {
      p.attention_scale = positive(kRope, type, "attention_factor", *s.attention_factor);
    } else if (p.factor > 1.0) {
      TORCH_CHECK_VALUE(p.context > 1.0, kRope, ": longrope original_max_position_embeddings must exceed 1 to ",
                        "derive the attention factor sqrt(1 + ln(factor) / ln(original)), got ", repr(p.context));
      p.attention_scale = std::sqrt(1.0 + std::log(p.factor) / std::log(p.context));
    }
  } else {
    TORCH_CHECK_VALUE(false, kRope, ": unknown rope_type \"", s.rope_type,
                      "\"; expected default, linear, dynamic, ntk, yarn, llama3 or longrope");
  }
  return p;
}

// 2i / r for the pairs i < r / 2.
at::Tensor exponents(int64_t rotary_dim, at::TensorOptions options) {
  return at::arange(0, rotary_dim, 2, options).div_(rotary_dim);
}

at::Tensor theta_powers(int64_t rotary_dim, double theta, at::TensorOptions options) {
  return exponents(rotary_dim, options).mul_(-std::log(theta)).exp_();
}

at::Tensor yarn(const at::Tensor& inv_freq, const Plan& p, bool truncate) {
  // The pair index whose wavelength fits `rotations` times into the original context.
  const auto correction = [&](double rotations) {
    return p.rotary_dim * std::log(p.context / (rotations * 2.0 * M_PI)) / (2.0 * std::log(p.theta));
  };
  double low = correction(p.beta_fast);
  double high = correction(p.beta_slow);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(p.rotary_dim - 1));
  if (low == high) high += 0.001;  // as Hugging Face: avoids a zero-width ramp
  const auto ramp = at::arange(p.rotary_dim / 2, inv_freq.options()).sub(low).div(high - low).clamp(0.0, 1.0);
  const auto extrapolation = ramp.neg().add(1.0);
  return inv_freq.div(p.factor).mul(ramp).add(inv_freq.mul(extrapolation));
}

at::Tensor llama3(const at::Tensor& inv_freq, const Plan& p) {
  const double low = p.low_freq_factor;
  const double high = p.high_freq_factor;
  const auto wavelength = inv_freq.reciprocal().mul(2.0 * M_PI);
  const auto scaled = at::where(wavelength.gt(p.context / low), inv_freq.div(p.factor), inv_freq);
  const auto smooth = wavelength.reciprocal().mul(p.context).sub(low).div(high - low);
  const auto smoothed = scaled.div(p.factor).mul(smooth.neg().add(1.0)).add(scaled.mul(smooth));
  const auto medium = wavelength.ge(p.context / high).logical_and(wavelength.le(p.context / low));
  return at::where(medium, smoothed, scaled);
}

// The frequencies of a checked plan on the device of `options`. `length` (float64, 0-d) is the sequence
// length of dynamic NTK and LongRoPE, undefined where none is given.
at::Tensor inv_freq_of(const Plan& p, const RopeScaling& s, const at::Tensor& length, at::TensorOptions options) {
  const auto& type = p.type;
  const double ntk_exponent = static_cast<double>(p.rotary_dim) / static_cast<double>(p.rotary_dim - 2);
  if (type == "dynamic") {
    // Hugging Face's runtime rule: base * (factor L / max - (factor - 1))^(r / (r - 2)), L at least max.
    // In place on 0-d temporaries: this runs on every call of a module.
    auto theta = length.defined() ? length.clamp_min(p.context) : at::scalar_tensor(p.context, options);
    theta.mul_(p.factor).div_(p.context).sub_(p.factor - 1.0).pow_(ntk_exponent).mul_(p.theta).log_().neg_();
    return exponents(p.rotary_dim, options).mul_(theta).exp_();
  }
  if (type == "ntk") return theta_powers(p.rotary_dim, p.theta * std::pow(p.factor, ntk_exponent), options);
  const auto inv_freq = theta_powers(p.rotary_dim, p.theta, options);
  if (type == "linear") return inv_freq.div(p.factor);
  if (type == "yarn") return yarn(inv_freq, p, s.truncate);
  if (type == "llama3") return llama3(inv_freq, p);
  if (type == "longrope") {
    // The long factors apply beyond the original context.
    const auto short_factor = at::tensor(s.short_factor, options);
    if (!length.defined()) return inv_freq.div_(short_factor);
    return inv_freq.div_(at::where(length.gt(p.context), at::tensor(s.long_factor, options), short_factor));
  }
  return inv_freq;
}

// The sequence length of rope_for_length: a 0-d integer or floating tensor (metadata only, never read here).
void check_length(const at::Tensor& seq_len) {
  TORCH_CHECK(seq_len.defined() && seq_len.dim() == 0, kRope, ": seq_len must be a 0-d tensor, got shape ",
              seq_len.defined() ? seq_len.sizes() : at::IntArrayRef{});
  const auto dtype = seq_len.scalar_type();
  TORCH_CHECK(at::isIntegralType(dtype, /*includeBool=*/false) || at::isFloatingType(dtype), kRope,
              ": seq_len must be an integer or floating tensor, got ", dtype);
}

}  // namespace

at::Tensor sinusoidal(int64_t dim, double base, int64_t shift) {
  constexpr const char* op = "posenc.frequencies.sinusoidal";
  TORCH_CHECK_VALUE(dim >= 2, op, ": dim must be at least 2, got ", dim);
  positive(op, "", "base", base);
  TORCH_CHECK_VALUE(shift == 0 || shift == 1, op, ": shift must be 0 or 1, got ", shift);
  const int64_t pairs = dim / 2;
  TORCH_CHECK_VALUE(pairs - shift > 0, op, ": dim ", dim, " has ", pairs, " frequency pairs, too few for shift ",
                    shift);
  const auto i = at::arange(pairs, at::TensorOptions().dtype(at::kDouble));
  return i.mul(-std::log(base) / static_cast<double>(pairs - shift)).exp();
}

RopeFrequencies rope(int64_t rotary_dim, double base, const RopeScaling& scaling, std::optional<int64_t> seq_len) {
  const auto p = plan(rotary_dim, base, scaling);
  TORCH_CHECK_VALUE(!seq_len || *seq_len >= 0, kRope, ": seq_len must be non-negative, got ", *seq_len);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  // The length goes through the same tensor maths as rope_for_length's, so both give the same bits.
  const auto length = seq_len ? at::scalar_tensor(static_cast<double>(*seq_len), options) : at::Tensor();
  return {inv_freq_of(p, scaling, length, options), p.attention_scale};
}

at::Tensor rope_for_length(int64_t rotary_dim, double base, const RopeScaling& scaling, const at::Tensor& seq_len) {
  const auto p = plan(rotary_dim, base, scaling);
  check_length(seq_len);
  return inv_freq_of(p, scaling, seq_len.to(at::kDouble), seq_len.options().dtype(at::kDouble));
}

void check_rope_for_length(int64_t rotary_dim, double base, const RopeScaling& scaling, const at::Tensor& seq_len) {
  plan(rotary_dim, base, scaling);
  check_length(seq_len);
}

LengthDependence length_dependence(int64_t rotary_dim, double base, const RopeScaling& scaling) {
  const auto p = plan(rotary_dim, base, scaling);
  if (p.type == "dynamic") return {LengthDependence::kGrowing, p.context};
  if (p.type == "longrope") return {LengthDependence::kStep, p.context};
  return {LengthDependence::kNone, p.context};
}

}  // namespace frequencies
}  // namespace posenc
