// The frequency formulas of every family, written once: the C++ API (posenc::frequencies), the ops
// registered in config/ops.cpp and, through those ops, Python's posenc.frequencies all compute here. Every
// value is scalar float64 arithmetic in a fixed order with posenc's own exp and log (portable/libm.h), so the same
// arguments give the same bits on every CPU, capability, thread count and device.
#include <posenc/frequencies.h>

#include "config/rope_scaling.h"
#include "portable/frequencies.h"
#include "portable/libm.h"

#include <ATen/ops/empty.h>
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
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * portable::libm::log(scale) + 1.0;
}

// A RopeScaling checked, with its type's defaults filled in: the numbers the formulas read.
struct Plan {
  std::string type;  // "ntk_alpha" and HunYuan's "dynamic" with an alpha are "ntk"
  int64_t rotary_dim = 0;
  double theta = 0.0;
  double factor = 1.0;   // linear, dynamic, yarn, llama3, longrope, proportional; ntk: alpha
  double context = 0.0;  // dynamic: max_position_embeddings; yarn, llama3, longrope: the original length
  double attention_scale = 1.0;
  double beta_fast = 32.0;  // yarn
  double beta_slow = 1.0;
  double low_freq_factor = 1.0;  // llama3
  double high_freq_factor = 4.0;
  int64_t rotated_pairs = 0;  // proportional: the pairs with a frequency, the others 0
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
      p.attention_scale = std::sqrt(1.0 + portable::libm::log(p.factor) / portable::libm::log(p.context));
    }
  } else if (type == "proportional") {
    // Gemma 4: the exponents of the whole head (rotary_dim is the head dim), a leading share of its pairs rotated,
    // int(partial_rotary_factor * rotary_dim // 2) of them as transformers counts, all divided by factor.
    p.factor = optional(type, "factor", s.factor, 1.0);
    const double partial = optional(type, "partial_rotary_factor", s.partial_rotary_factor, 1.0);
    TORCH_CHECK_VALUE(partial <= 1.0, kRope, ": proportional partial_rotary_factor must not exceed 1, got ",
                      repr(partial));
    p.rotated_pairs = static_cast<int64_t>(std::floor(partial * static_cast<double>(rotary_dim) / 2.0));
  } else {
    TORCH_CHECK_VALUE(false, kRope, ": unknown rope_type \"", s.rope_type,
                      "\"; expected default, linear, dynamic, ntk, yarn, llama3, longrope or proportional");
  }
  return p;
}

using portable::DoubleDouble;
namespace libm = portable::libm;

// base^(-2i / r) for the pairs i < r / 2, from ln(base), each correctly rounded.
std::vector<double> base_powers(DoubleDouble log_base, int64_t rotary_dim) {
  std::vector<double> inv_freq(rotary_dim / 2);
  for (const auto i : c10::irange(inv_freq.size())) {
    inv_freq[i] = portable::inverse_power(log_base, 2 * static_cast<int64_t>(i), rotary_dim);
  }
  return inv_freq;
}

std::vector<double> yarn(std::vector<double> inv_freq, const Plan& p, bool truncate) {
  // The pair index whose wavelength fits `rotations` times into the original context (Hugging Face's float64
  // steps, with a correctly rounded log: `truncate` floors and ceils it).
  const auto correction = [&](double rotations) {
    return p.rotary_dim * libm::log(p.context / (rotations * 2.0 * M_PI)) / (2.0 * libm::log(p.theta));
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
  for (const auto i : c10::irange(inv_freq.size())) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    inv_freq[i] = inv_freq[i] / p.factor * ramp + inv_freq[i] * (1.0 - ramp);
  }
  return inv_freq;
}

std::vector<double> llama3(std::vector<double> inv_freq, const Plan& p) {
  const double low = p.low_freq_factor;
  const double high = p.high_freq_factor;
  for (auto& w : inv_freq) {
    const double wavelength = 1.0 / w * (2.0 * M_PI);
    const double scaled = wavelength > p.context / low ? w / p.factor : w;
    if (wavelength >= p.context / high && wavelength <= p.context / low) {
      const double smooth = (1.0 / wavelength * p.context - low) / (high - low);
      w = scaled / p.factor * (1.0 - smooth) + scaled * smooth;
    } else {
      w = scaled;
    }
  }
  return inv_freq;
}

// The frequencies of a checked plan at sequence length `length` (none given: dynamic NTK keeps theta and LongRoPE
// its short factors). Scalar float64 in a fixed order, every power correctly rounded.
std::vector<double> inv_freq_of(const Plan& p, const RopeScaling& s, std::optional<double> length) {
  const auto& type = p.type;
  if (type == "dynamic") {
    const portable::DynamicNtk ntk{p.theta, p.factor, p.context, p.rotary_dim};
    return base_powers(portable::dynamic_ntk_log_base(ntk, length.value_or(p.context)), p.rotary_dim);
  }
  if (type == "ntk") {
    // theta alpha^(r / (r - 2)), raised to -2i / r: one logarithm of the product, carried in double-double.
    const double r = static_cast<double>(p.rotary_dim);
    return base_powers(libm::add(libm::log(DoubleDouble{p.theta, 0.0}),
                                 libm::mul(libm::log(DoubleDouble{p.factor, 0.0}),
                                           libm::div(DoubleDouble{r, 0.0}, r - 2.0))),
                       p.rotary_dim);
  }
  auto inv_freq = base_powers(libm::log(DoubleDouble{p.theta, 0.0}), p.rotary_dim);
  if (type == "linear") {
    for (auto& w : inv_freq) w /= p.factor;
  } else if (type == "yarn") {
    inv_freq = yarn(std::move(inv_freq), p, s.truncate);
  } else if (type == "llama3") {
    inv_freq = llama3(std::move(inv_freq), p);
  } else if (type == "longrope") {
    // The long factors apply beyond the original context (a NaN length is not beyond it).
    const auto& factors = length && *length > p.context ? s.long_factor : s.short_factor;
    for (const auto i : c10::irange(inv_freq.size())) inv_freq[i] /= factors[i];
  } else if (type == "proportional") {
    for (const auto i : c10::irange(inv_freq.size())) {
      inv_freq[i] = static_cast<int64_t>(i) < p.rotated_pairs ? inv_freq[i] / p.factor : 0.0;
    }
  }
  return inv_freq;
}

at::Tensor to_tensor(const std::vector<double>& values) {
  auto out = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(at::kDouble));
  std::copy(values.begin(), values.end(), out.mutable_data_ptr<double>());
  return out;
}

// The sequence length of rope_for_length: a 0-d integer or floating tensor (these checks read metadata only).
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
  const auto log_base = libm::log(DoubleDouble{base, 0.0});
  std::vector<double> inv_freq(pairs);
  for (const auto i : c10::irange(pairs)) inv_freq[i] = portable::inverse_power(log_base, i, pairs - shift);
  return to_tensor(inv_freq);
}

RopeFrequencies rope(int64_t rotary_dim, double base, const RopeScaling& scaling, std::optional<int64_t> seq_len) {
  const auto p = plan(rotary_dim, base, scaling);
  TORCH_CHECK_VALUE(seq_len.value_or(0) >= 0, kRope, ": seq_len must be non-negative, got ", seq_len.value_or(0));
  const auto length = seq_len ? std::optional(static_cast<double>(*seq_len)) : std::nullopt;
  return {to_tensor(inv_freq_of(p, scaling, length)), p.attention_scale};
}

at::Tensor rope_for_length(int64_t rotary_dim, double base, const RopeScaling& scaling, const at::Tensor& seq_len) {
  const auto p = plan(rotary_dim, base, scaling);
  check_length(seq_len);
  // Read on the CPU (the CUDA op evaluates the same formulas on the device, without reading it).
  const double length = seq_len.item<double>();
  return to_tensor(inv_freq_of(p, scaling, length)).to(seq_len.device());
}

void check_rope_for_length(int64_t rotary_dim, double base, const RopeScaling& scaling, const at::Tensor& seq_len) {
  plan(rotary_dim, base, scaling);
  check_length(seq_len);
}

LengthDependence length_dependence(int64_t rotary_dim, double base, const RopeScaling& scaling) {
  const auto p = plan(rotary_dim, base, scaling);
  const portable::DynamicNtk ntk{p.theta, p.factor, p.context, p.rotary_dim};
  if (p.type == "dynamic") return {LengthDependence::kGrowing, p.context, ntk};
  if (p.type == "longrope") return {LengthDependence::kStep, p.context, ntk};
  return {LengthDependence::kNone, p.context, ntk};
}

}  // namespace frequencies
}  // namespace posenc
