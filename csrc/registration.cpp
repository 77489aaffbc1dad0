// TORCH_LIBRARY(posenc, m): the schemas of families.h, defined once. Kernels live in one file per op family and
// dispatch key (common/ op layers for CPU and CUDA, meta/, autograd/) and are attached there with
// TORCH_LIBRARY_IMPL; the ops that compute a configuration's constants have theirs in config/ops.cpp.
#include "families.h"

#include <torch/library.h>

#define POSENC_DEF(A, op, schema) m.def(#op schema);

TORCH_LIBRARY(posenc, m) { POSENC_ALL_OPS(POSENC_DEF, ) }
