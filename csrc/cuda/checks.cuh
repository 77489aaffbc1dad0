#pragma once
// Checks of index data on the GPU that never make the host wait (posenc/cuda.h says what a user sees).
//
// A check kernel keeps the first failing element of its call in a device word (DeviceCheck::word(), an atomic
// minimum). A one-thread report kernel queued after it copies that element's values into the device's failure
// record, unless an earlier failure holds the record. The record lives in pinned host memory mapped into the GPU's
// address space, so the host reads it with a plain load and no synchronization: at the start of every posenc CUDA
// op (CudaDevice::Guard) and in check_errors(). The host part of each call, kept under the call's number, turns the
// record into the CPU's error. Synchronous mode waits for each report and raises at the call.
//
// Reports run in stream order, so the record holds the first failure in the order the calls were made, and within
// a call the first element, as the CPU raises. Graph capture records the check and report kernels too: every replay
// checks its own data.
#include "cuda/utils.cuh"

#include <functional>

namespace posenc::cuda {

// What a failing element leaves for its error: its flat index (or a check's own key) and two values read there.
struct CheckFailure {
  int64_t index;
  int64_t value;
  int64_t other;
};

struct FailureValues {
  int64_t value = 0;
  int64_t other = 0;
};

// The host part of a call's check: raises the CPU's error of a failure.
using RaiseFailure = std::function<void(const CheckFailure&)>;

// A device's first failure (call: the failing call's number, 0 while there is none) and the device word that lets
// one report claim it.
struct FailureRecord {
  int64_t call;
  int64_t index;
  int64_t value;
  int64_t other;
};

struct FailureSlot {
  FailureRecord* record = nullptr;  // pinned host memory mapped into the device's address space
  int* claim = nullptr;             // device memory: 0 while the record is free
};

// The current device's slot, allocated on its first check; none (record null) when that first check is made while a
// graph is captured, which may not allocate: that call goes unchecked.
FailureSlot failure_slot();

// A number for a call whose check may fail, with its host part, kept for the last 4096 calls and for every call
// captured in a CUDA graph (replays report under the captured number).
int64_t register_call(RaiseFailure raise);

// Raises the current device's recorded failure, if any, and frees the record. Nothing while a graph is captured.
void raise_recorded_failure();

// In synchronous mode, waits for the current stream and raises its failure.
void finish_check();

constexpr unsigned long long kNoFailure = ~0ull;

template <typename Fetch>
__global__ void report_kernel(const unsigned long long* first, Fetch fetch, FailureSlot slot, int64_t call) {
  const unsigned long long index = *first;
  if (index == kNoFailure || atomicCAS(slot.claim, 0, 1) != 0) return;
  const FailureValues values = fetch(static_cast<int64_t>(index));
  volatile FailureRecord* record = slot.record;
  record->index = static_cast<int64_t>(index);
  record->value = values.value;
  record->other = values.other;
  __threadfence_system();  // the fields reach the host before the number that announces them
  record->call = call;
}

// One check of one call on the current stream. Its kernel atomicMin's a failing element into word(); report()
// queues the report, with `fetch` (a device functor: the failing index -> FailureValues, read from the checked data
// while the call's tensors are alive) and `raise` (the host part).
class DeviceCheck {
 public:
  explicit DeviceCheck(const at::Tensor& like);

  unsigned long long* word() const { return reinterpret_cast<unsigned long long*>(word_.mutable_data_ptr<int64_t>()); }

  template <typename Fetch>
  void report(Fetch fetch, RaiseFailure raise) const {
    const auto slot = failure_slot();
    if (slot.record == nullptr) return;
    report_kernel<<<1, 1, 0, current_stream()>>>(word(), fetch, slot, register_call(std::move(raise)));
    POSENC_CUDA_LAUNCH_CHECK();
    finish_check();
  }

 private:
  at::Tensor word_;
};

}  // namespace posenc::cuda
