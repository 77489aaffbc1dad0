// The failure records of the device checks and their host side (checks.cuh).
#include "cuda/checks.cuh"

#include <posenc/cuda.h>

#include <array>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace posenc::cuda {

extern std::atomic<void (*)()> check_errors_on_devices;  // api/cuda.cpp

namespace {

constexpr int kMaxDevices = 64;
std::array<std::atomic<FailureRecord*>, kMaxDevices> records{};
std::array<int*, kMaxDevices> claims{};
std::mutex allocation;

class Calls {
 public:
  int64_t add(RaiseFailure raise, bool captured) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const int64_t call = next_++;
    if (captured) {
      captured_.emplace(call, std::move(raise));
    } else {
      recent_[call % kRecent] = {call, std::move(raise)};
    }
    return call;
  }

  RaiseFailure find(int64_t call) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto found = captured_.find(call);
    if (found != captured_.end()) return found->second;
    const auto& [number, raise] = recent_[call % kRecent];
    return number == call ? raise : RaiseFailure();
  }

 private:
  static constexpr int64_t kRecent = 4096;
  std::mutex mutex_;
  int64_t next_ = 1;
  std::vector<std::pair<int64_t, RaiseFailure>> recent_ = std::vector<std::pair<int64_t, RaiseFailure>>(kRecent);
  std::unordered_map<int64_t, RaiseFailure> captured_;
};

Calls& calls() {
  static auto* calls = new Calls();  // never destroyed: reports may be read while the process exits
  return *calls;
}

int current_device() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  TORCH_CHECK(device < kMaxDevices, "posenc: CUDA device ", device, " is past the ", kMaxDevices, " posenc checks");
  return device;
}

// Every device that has a record: waits for its work, then raises its failure.
void check_every_device() {
  for (int device = 0; device < kMaxDevices; ++device) {
    if (records[device].load() == nullptr) continue;
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    raise_recorded_failure();
  }
}

[[maybe_unused]] const bool installed = (check_errors_on_devices.store(&check_every_device), true);

}  // namespace

FailureSlot failure_slot() {
  const int device = current_device();
  if (auto* record = records[device].load(std::memory_order_acquire)) return {record, claims[device]};
  if (capturing()) return {};
  const std::lock_guard<std::mutex> lock(allocation);
  if (records[device].load() == nullptr) {
    void* host = nullptr;
    C10_CUDA_CHECK(cudaHostAlloc(&host, sizeof(FailureRecord), cudaHostAllocMapped | cudaHostAllocPortable));
    void* mapped = nullptr;
    C10_CUDA_CHECK(cudaHostGetDevicePointer(&mapped, host, 0));
    // With unified addressing (every 64-bit platform CUDA supports) the two addresses are one.
    TORCH_INTERNAL_ASSERT(mapped == host, "posenc: mapped host memory has a device address of its own");
    *static_cast<FailureRecord*>(host) = {0, 0, 0, 0};
    C10_CUDA_CHECK(cudaMalloc(&claims[device], sizeof(int)));
    C10_CUDA_CHECK(cudaMemset(claims[device], 0, sizeof(int)));
    records[device].store(static_cast<FailureRecord*>(host), std::memory_order_release);
  }
  return {records[device].load(), claims[device]};
}

int64_t register_call(RaiseFailure raise) { return calls().add(std::move(raise), capturing()); }

void raise_recorded_failure() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  FailureRecord* record = device < kMaxDevices ? records[device].load(std::memory_order_acquire) : nullptr;
  if (record == nullptr) return;
  const int64_t call = static_cast<volatile FailureRecord*>(record)->call;
  if (call == 0 || capturing()) return;
  std::atomic_thread_fence(std::memory_order_acquire);
  const volatile FailureRecord* fields = record;
  const CheckFailure failure{fields->index, fields->value, fields->other};
  static_cast<volatile FailureRecord*>(record)->call = 0;
  C10_CUDA_CHECK(cudaMemsetAsync(claims[device], 0, sizeof(int), current_stream()));
  const auto raise = calls().find(call);
  TORCH_CHECK(raise, "posenc: a CUDA op found bad index data more than 4096 checked calls before this one, too "
              "long ago for its message to be kept; call posenc.cuda.check_errors() sooner, or set "
              "POSENC_CUDA_SYNC_CHECKS=1 to raise at the call");
  raise(failure);
  TORCH_INTERNAL_ASSERT(false, "posenc: a recorded CUDA check failure raised no error");
}

void finish_check() {
  if (!sync_checks() || capturing()) return;
  C10_CUDA_CHECK(cudaStreamSynchronize(current_stream()));
  raise_recorded_failure();
}

DeviceCheck::DeviceCheck(const at::Tensor& like) : word_(at::empty({1}, like.options().dtype(at::kLong))) {
  C10_CUDA_CHECK(cudaMemsetAsync(word_.mutable_data_ptr<int64_t>(), 0xFF, sizeof(int64_t), current_stream()));
}

}  // namespace posenc::cuda
