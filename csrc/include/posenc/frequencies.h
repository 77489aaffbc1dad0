#pragma once
// Frequencies (inv_freq, float64) of every family; twins of Python's posenc.frequencies.
#include <ATen/core/Tensor.h>

namespace posenc::frequencies {

// omega_i = base^(-i / (dim/2 - shift)), i < dim/2. shift 0: "Attention Is All You Need";
// shift 1: fairseq / tensor2tensor / Whisper / diffusers.
at::Tensor sinusoidal(int64_t dim, double base = 10000.0, int64_t shift = 0);

}  // namespace posenc::frequencies
