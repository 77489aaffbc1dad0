#pragma once
// What the CUDA ops do with bad index data (positions outside their domain, token ids outside the vocabulary,
// cu_seqlens, pair_axis, cache slots). The CPU reads index tensors before any kernel runs and raises at the call.
// On the GPU the values live in device memory, and reading them on the host would make every call wait for the
// GPU, so by default the checks run on the device: a bad index makes no read or write out of bounds (its rows are
// NaN, or not stored), and the first failure is recorded there. It is raised, with the CPU's message word for word,
// by check_errors(), or by the next posenc CUDA op called after the failing kernel has run.
//
// Python: posenc.cuda.check_errors(), posenc.cuda.set_sync_checks(), posenc.cuda.sync_checks(); the ops
// torch.ops.posenc_cuda.check_errors(), set_sync_checks(bool), sync_checks(). On a build without CUDA kernels
// check_errors() returns at once.

namespace posenc::cuda {

// Waits for the work queued on each GPU that has run a posenc check, then raises (c10::Error, RuntimeError in
// Python) the first failure recorded since the last one raised, if any.
void check_errors();

// Synchronous checks: each op waits for its own checks and raises at the call, as the CPU does (one wait per op
// that is given index data). Off by default; the environment variable POSENC_CUDA_SYNC_CHECKS=1 turns it on when
// the library loads.
void set_sync_checks(bool enabled);
bool sync_checks();

}  // namespace posenc::cuda
