#pragma once
// Conversions between storage and maths precision. c10's Half/BFloat16 conversions branch (NaN, denormals),
// which stops the compiler vectorizing a loop; these compute the same bits (IEEE round to nearest even,
// c10's NaN encodings) with selects and bit operations only, so loops built on them vectorize.
#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace posenc {

inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

template <typename scalar_t>
inline at::opmath_type<scalar_t> to_opmath(scalar_t value) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return bits_to_float(uint32_t(value.x) << 16);
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    // c10::detail::fp16_ieee_to_fp32_value with its branch turned into a mask.
    const uint32_t w = uint32_t(value.x) << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t is_denormal = 0u - uint32_t(two_w < (1u << 27));
    const uint32_t magnitude = (float_to_bits(denormalized) & is_denormal) | (float_to_bits(normalized) & ~is_denormal);
    return bits_to_float(sign | magnitude);
  } else {
    return value;
  }
}

template <typename scalar_t>
inline scalar_t from_opmath(at::opmath_type<scalar_t> value) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const uint32_t bits = float_to_bits(value);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t is_nan = 0u - uint32_t(value != value);
    return c10::BFloat16(uint16_t((0x7FC0u & is_nan) | (rounded & ~is_nan)), c10::BFloat16::from_bits());
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    // c10::detail::fp16_ieee_from_fp32_value with its branches turned into max and a mask.
    const uint32_t w = float_to_bits(value);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t bias = std::max(shl1_w & 0xFF000000u, 0x71000000u);
    const float base = bits_to_float((bias >> 1) + 0x07800000u) +
                       bits_to_float(w & 0x7FFFFFFFu) * 0x1.0p+112f * 0x1.0p-110f;
    const uint32_t bits = float_to_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    const uint32_t is_nan = 0u - uint32_t(shl1_w > 0xFF000000u);
    return c10::Half(uint16_t((sign >> 16) | (0x7E00u & is_nan) | (nonsign & ~is_nan)), c10::Half::from_bits());
  } else {
    return value;
  }
}

}  // namespace posenc
