// posenc::cuda's switches (posenc/cuda.h) and their ops, torch.ops.posenc_cuda.*, in every build: the CUDA
// kernels, when built in, install the function that reads the GPUs' failure records (cuda/checks.cu).
#include <posenc/cuda.h>

#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace posenc::cuda {
namespace {

std::atomic<bool>& sync_flag() {
  static std::atomic<bool> flag{[] {
    const char* value = std::getenv("POSENC_CUDA_SYNC_CHECKS");
    return value != nullptr && std::strcmp(value, "") != 0 && std::strcmp(value, "0") != 0;
  }()};
  return flag;
}

}  // namespace

// Set by cuda/checks.cu when the CUDA kernels are built in.
std::atomic<void (*)()> check_errors_on_devices{nullptr};

void check_errors() {
  if (const auto check = check_errors_on_devices.load()) check();
}

void set_sync_checks(bool enabled) { sync_flag().store(enabled); }

bool sync_checks() { return sync_flag().load(std::memory_order_relaxed); }

}  // namespace posenc::cuda

// Conservative alias analysis: calls without outputs that a TorchScript graph must keep (they act on state).
TORCH_LIBRARY(posenc_cuda, m) {
  const auto kept = c10::AliasAnalysisKind::CONSERVATIVE;
  m.def(torch::schema("check_errors() -> ()", kept), &posenc::cuda::check_errors);
  m.def(torch::schema("set_sync_checks(bool enabled) -> ()", kept), &posenc::cuda::set_sync_checks);
  m.def(torch::schema("sync_checks() -> bool", kept), &posenc::cuda::sync_checks);
}
