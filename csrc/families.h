#pragma once
// The ops of each family, as lists that every layer expands to register its kernels: a family's CPU and CUDA op
// layer, its Meta and Autograd kernels and the autocast policy all come from the same list, so an op added to
// its family's list (and its schema to registration.cpp) fails to compile until every layer has its kernel. The
// schemas themselves stay in registration.cpp, the one table of signatures.
//
// Each list takes a macro X and an argument A and expands to X(A, op) for every op of the family.

// The scatter-add backward shared by the sinusoidal and learned families.
#define POSENC_EMBEDDING_OPS(X, A) X(A, embedding_backward)
#define POSENC_SINUSOIDAL_OPS(X, A) X(A, sinusoidal) X(A, add_sinusoidal) X(A, embed_sinusoidal)
#define POSENC_LEARNED_OPS(X, A) \
  X(A, learned) X(A, add_learned) X(A, embed_learned) X(A, make_positions) X(A, positions_from_mask)
#define POSENC_ROPE_OPS(X, A)                                                                               \
  X(A, rope) X(A, rope_backward) X(A, rope_qk) X(A, rope_qk_backward) X(A, rope_) X(A, rope_cos_sin) \
      X(A, rope_cos_sin_backward)
#define POSENC_ALIBI_OPS(X, A) X(A, alibi_bias) X(A, add_alibi) X(A, add_alibi_) X(A, alibi_backward)
#define POSENC_T5_OPS(X, A) X(A, relative_position_bucket) X(A, t5_bias) X(A, t5_bias_backward)
// Qwen2-VL's M-RoPE positions of text, image and video tokens.
#define POSENC_MULTIAXIS_OPS(X, A) X(A, mrope_positions)
// Configuration constants (frequencies, slopes, position grids), computed on the CPU by config/ops.cpp's kernels at
// CompositeExplicitAutograd, which the ops without a tensor argument reach whatever the device.
#define POSENC_CONFIG_OPS(X, A)                                                                                  \
  X(A, sinusoidal_inv_freq) X(A, rope_inv_freq) X(A, rope_inv_freq_for_length) X(A, zigzag_positions)           \
      X(A, zigzag_positions_varlen) X(A, multiaxis_inv_freq) X(A, axial_inv_freq) X(A, mrope_pair_axis)          \
          X(A, mrope_inv_freq) X(A, image_positions) X(A, video_positions) X(A, alibi_slopes)

// Every op of the schema table.
#define POSENC_ALL_OPS(X, A)                                                                                    \
  X(A, cpu_capability) POSENC_EMBEDDING_OPS(X, A) POSENC_SINUSOIDAL_OPS(X, A) POSENC_LEARNED_OPS(X, A)          \
      POSENC_ROPE_OPS(X, A) POSENC_ALIBI_OPS(X, A) POSENC_T5_OPS(X, A) POSENC_MULTIAXIS_OPS(X, A)               \
          POSENC_CONFIG_OPS(X, A)

// X macros for the lists: m.impl of each op with the kernel Kernels::op (a family's op layer) or op<suffix>
// (learned_meta, add_learned_autograd), into the torch::Library named m.
#define POSENC_IMPL_MEMBER(Kernels, op) m.impl(#op, TORCH_FN(Kernels::op));
#define POSENC_IMPL_SUFFIXED(suffix, op) m.impl(#op, TORCH_FN(op##suffix));
