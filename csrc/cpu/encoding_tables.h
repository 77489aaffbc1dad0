#pragma once
// The encoding tables kept between calls (encoding_tables.cpp), read by the sinusoidal and rotary families.
#include "common/positions.h"
#include "portable/types.h"

#include <ATen/core/Tensor.h>

namespace posenc::cpu {

// A kept table of the encodings of positions [0, rows) in `layout` at freq's frequencies, in maths type `type`,
// holding every one of pos's positions, where they are one axis of whole numbers >= 0, enough (position, frequency)
// pairs to be worth a look-up and at most 4 rows per position of the call; else an undefined tensor. Its rows are
// the bits the sinusoidal kernel computes for those positions.
at::Tensor kept_encodings(at::ScalarType type, SinusoidalLayout layout, const Frequencies& freq,
                          const AxisPositions& pos);

// The kept "half_cos_first" table (row p: [cos | sin] of position p, a rotation's coefficients as they are) for a
// rotation's positions, as kept_encodings finds one, but only where it holds at most a quarter of the budget; else
// undefined.
at::Tensor kept_rotation_table(at::ScalarType type, const Frequencies& freq, const AxisPositions& pos);

}  // namespace posenc::cpu
