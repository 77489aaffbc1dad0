// Data-dependent checks of the CUDA ops and the device arrays of positions (see positions.cuh).
#include "cuda/positions.cuh"
#include "cuda/checks.cuh"

#include <c10/util/bit_cast.h>

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

namespace posenc::cuda {

int multiprocessors() {
  static std::mutex mutex;
  static std::vector<int> counts;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  if (counts.size() <= static_cast<size_t>(device)) counts.resize(device + 1, 0);
  if (counts[device] == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device));
  }
  return counts[device];
}

namespace {

constexpr int kCheckThreads = 256;

// sum = value + offset in int64, a failure if it overflows or leaves [lo, hi]; out (if any) gets the sum.
template <typename in_t, typename out_t>
__global__ void offset_indices_kernel(const in_t* in, int64_t n, int64_t offset, int64_t lo, int64_t hi, out_t* out,
                                      unsigned long long* first_bad) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const auto value = static_cast<int64_t>(in[i]);
    const auto sum = static_cast<int64_t>(static_cast<uint64_t>(value) + static_cast<uint64_t>(offset));
    const bool overflow = ((value ^ sum) & (offset ^ sum)) < 0;
    if (overflow || sum < lo || sum > hi) atomicMin(first_bad, static_cast<unsigned long long>(i));
    if (out != nullptr) out[i] = static_cast<out_t>(sum);
  }
}

// Floating positions (diffusion timesteps, image coordinates): p + offset in float64, a failure when beyond `limit`
// (NaN and infinities too where `finite`).
__global__ void offset_floating_kernel(const double* in, int64_t n, double offset, double limit, bool finite,
                                       double* out, unsigned long long* first_bad) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const double sum = in[i] + offset;
    if (!(fabs(sum) <= limit) && (finite || isfinite(sum))) atomicMin(first_bad, static_cast<unsigned long long>(i));
    out[i] = sum;
  }
}

// The index of token t of a packed input in its sequence: t - bounds[j] for the last j with bounds[j] <= t.
__device__ int64_t index_in_sequence(const int64_t* bounds, int64_t num_bounds, int64_t t) {
  int64_t lo = 0;
  int64_t hi = num_bounds >= 2 ? num_bounds - 2 : 0;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (bounds[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return static_cast<int64_t>(static_cast<uint64_t>(t) - static_cast<uint64_t>(bounds[lo]));
}

// Position of token t of a packed input: its index in its sequence plus offset, a failure if that overflows or
// leaves [lo, hi]. Bounds that fail their own check still give indices inside the packed tokens.
template <typename out_t>
__global__ void sequence_positions_kernel(const int64_t* bounds, int64_t num_bounds, int64_t tokens, int64_t offset,
                                          int64_t lo, int64_t hi, out_t* out, unsigned long long* first_bad) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < tokens; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t index = index_in_sequence(bounds, num_bounds, t);
    const auto sum = static_cast<int64_t>(static_cast<uint64_t>(index) + static_cast<uint64_t>(offset));
    const bool overflow = ((index ^ sum) & (offset ^ sum)) < 0;
    if (overflow || sum < lo || sum > hi) atomicMin(first_bad, static_cast<unsigned long long>(t));
    out[t] = static_cast<out_t>(sum);
  }
}

// cu_seqlens' failures keyed as cu_seqlens_error keys them (0: its start, j: a decrease at j, n: its end); the
// smallest key is the CPU's first.
__global__ void cu_seqlens_kernel(const int64_t* bounds, int64_t n, int64_t tokens, unsigned long long* first_bad) {
  for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < n; j += int64_t{gridDim.x} * blockDim.x) {
    if (j == 0 && bounds[0] != 0) atomicMin(first_bad, 0ull);
    if (j > 0 && bounds[j] < bounds[j - 1]) atomicMin(first_bad, static_cast<unsigned long long>(j));
    if (j == n - 1 && bounds[j] != tokens) atomicMin(first_bad, static_cast<unsigned long long>(n));
  }
}

// The values of a failing element, read on the device for its report (checks.cuh).
template <typename T>
struct ValueAt {
  const T* data;
  __device__ FailureValues operator()(int64_t i) const { return {static_cast<int64_t>(data[i])}; }
};

struct DoubleBitsAt {
  const double* data;
  __device__ FailureValues operator()(int64_t i) const { return {__double_as_longlong(data[i])}; }
};

struct IndexInSequence {
  const int64_t* bounds;
  int64_t num_bounds;
  __device__ FailureValues operator()(int64_t t) const { return {index_in_sequence(bounds, num_bounds, t)}; }
};

struct CuSeqlensAt {
  const int64_t* bounds;
  int64_t n;
  __device__ FailureValues operator()(int64_t key) const {
    if (key == 0) return {bounds[0]};
    if (key == n) return {bounds[n - 1]};
    return {bounds[key], bounds[key - 1]};
  }
};

template <typename... Args, typename Kernel>
void launch_over(int64_t n, Kernel kernel, Args... args) {
  kernel<<<grid_size(n, kCheckThreads), kCheckThreads, 0, current_stream()>>>(args...);
  POSENC_CUDA_LAUNCH_CHECK();
}

}  // namespace

at::Tensor checked_indices(const at::Tensor& indices, int64_t offset, int64_t lo, int64_t hi, at::ScalarType out_type,
                           std::function<void(int64_t n, int64_t value)> error) {
  const auto values = (indices.scalar_type() == at::kInt ? indices : indices.to(at::kLong)).contiguous();
  auto out = at::empty({values.numel()}, values.options().dtype(out_type));
  if (values.numel() == 0) return out;
  const DeviceCheck check(values);
  AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "posenc_cuda_checked_indices", [&] {
    const auto in = values.const_data_ptr<index_t>();
    const auto launch = [&](auto* sums) {
      using out_t = std::remove_pointer_t<decltype(sums)>;
      launch_over(values.numel(), offset_indices_kernel<index_t, out_t>, in, values.numel(), offset, lo, hi, sums,
                  check.word());
    };
    if (out_type == at::kDouble) {
      launch(out.mutable_data_ptr<double>());
    } else if (out_type == at::kInt) {
      launch(out.mutable_data_ptr<int32_t>());
    } else {
      launch(out.mutable_data_ptr<int64_t>());
    }
    check.report(ValueAt<index_t>{in}, [error](const CheckFailure& f) { error(f.index, f.value); });
  });
  return out;
}

void check_device_cu_seqlens(const char* op, const at::Tensor& cu_seqlens, int64_t tokens) {
  const auto bounds = cu_seqlens.to(at::kLong).contiguous();
  const int64_t n = bounds.numel();
  const DeviceCheck check(bounds);
  launch_over(n, cu_seqlens_kernel, bounds.const_data_ptr<int64_t>(), n, tokens, check.word());
  check.report(CuSeqlensAt{bounds.const_data_ptr<int64_t>(), n}, [name = std::string(op), n, tokens](const CheckFailure& f) {
    cu_seqlens_error(name.c_str(), f.index, n, f.other, f.value, tokens);
  });
}

at::Tensor packed_positions(const char* op, const at::Tensor& cu_seqlens, int64_t count, int64_t offset,
                            const PositionDomain& domain, at::ScalarType out_type) {
  const auto bounds = cu_seqlens.to(at::kLong).contiguous();
  auto out = at::empty({count}, bounds.options().dtype(out_type));
  if (count == 0) return out;
  const DeviceCheck check(bounds);
  const auto b = bounds.const_data_ptr<int64_t>();
  if (out_type == at::kDouble) {
    launch_over(count, sequence_positions_kernel<double>, b, bounds.numel(), count, offset, domain.lo, domain.hi,
                out.mutable_data_ptr<double>(), check.word());
  } else {
    launch_over(count, sequence_positions_kernel<int64_t>, b, bounds.numel(), count, offset, domain.lo, domain.hi,
                out.mutable_data_ptr<int64_t>(), check.word());
  }
  check.report(IndexInSequence{b, bounds.numel()}, [name = std::string(op), offset, domain](const CheckFailure& f) {
    integer_position_error(name.c_str(), PositionSource::Packed, f.index, f.value, offset, domain);
  });
  return out;
}

at::Tensor angle_positions(const char* op, const std::optional<at::Tensor>& positions, int64_t count, int64_t offset,
                           const std::optional<at::Tensor>& cu_seqlens, const PositionDomain& domain) {
  if (cu_seqlens) check_device_cu_seqlens(op, *cu_seqlens, count);
  if (positions) {
    if (at::isFloatingType(positions->scalar_type())) {
      if (std::abs(offset) > kMaxExactPosition) floating_offset_error(op, offset, domain);
      const auto values = positions->to(at::kDouble).contiguous();
      auto out = at::empty({values.numel()}, values.options());
      if (values.numel() == 0) return out;
      const DeviceCheck check(values);
      const auto in = values.const_data_ptr<double>();
      launch_over(values.numel(), offset_floating_kernel, in, values.numel(), static_cast<double>(offset),
                  static_cast<double>(kMaxExactPosition), domain.finite, out.mutable_data_ptr<double>(), check.word());
      check.report(DoubleBitsAt{in}, [name = std::string(op), offset, domain](const CheckFailure& f) {
        floating_position_error(name.c_str(), f.index, c10::bit_cast<double>(f.value), offset, domain);
      });
      return out;
    }
    return checked_indices(*positions, offset, domain.lo, domain.hi, at::kDouble,
                           [name = std::string(op), offset, domain](int64_t n, int64_t value) {
                             integer_position_error(name.c_str(), PositionSource::Given, n, value, offset, domain);
                           });
  }
  if (!cu_seqlens) {
    check_arange<double>(op, count, count, offset, domain, std::nullopt);
    return {};
  }
  return packed_positions(op, *cu_seqlens, count, offset, domain, at::kDouble);
}

DeviceAxisPositions axis_positions(const char* op, const std::optional<at::Tensor>& positions, int64_t count,
                                   int64_t offset, const PositionDomain& domain,
                                   const std::optional<at::Tensor>& pair_axis,
                                   const std::optional<at::Tensor>& cu_seqlens) {
  if (!pair_axis) return {angle_positions(op, positions, count, offset, cu_seqlens, domain)};
  // Multi-axis positions are given: cu_seqlens is only checked, before pair_axis as the CPU checks it.
  if (cu_seqlens) check_device_cu_seqlens(op, *cu_seqlens, count);
  const int64_t n_axes = positions->size(0);
  auto axes = device_pair_axis(op, *pair_axis, n_axes);
  auto values = angle_positions(op, positions, count, offset, std::nullopt, domain);
  if (n_axes > 1) values = values.view({n_axes, -1}).t().contiguous();
  return {values, n_axes, axes};
}

at::Tensor table_rows(const char* op, const std::optional<at::Tensor>& positions, int64_t count, int64_t offset,
                      const PositionDomain& domain) {
  if (!positions) {
    check_arange<int64_t>(op, count, count, offset, domain, std::nullopt);
    return {};
  }
  return checked_indices(*positions, offset, domain.lo, domain.hi, at::kLong,
                         [name = std::string(op), offset, domain](int64_t n, int64_t value) {
                           integer_position_error(name.c_str(), PositionSource::Given, n, value, offset, domain);
                         });
}

void check_device_indices_in_range(const char* op, const char* arg, const at::Tensor& indices, int64_t limit,
                                   const char* limit_name) {
  if (indices.numel() == 0) return;
  checked_indices(indices, 0, 0, limit - 1, at::kLong, [name = std::string(op), arg = std::string(arg), limit, limit_name = std::string(limit_name)](int64_t n, int64_t value) {
    index_error(name.c_str(), arg.c_str(), n, value, limit, limit_name.c_str());
  });
}

at::Tensor device_pair_axis(const char* op, const at::Tensor& pair_axis, int64_t n_axes) {
  return checked_indices(pair_axis, 0, 0, n_axes - 1, at::kInt, [name = std::string(op), n_axes](int64_t i, int64_t value) {
    pair_axis_error(name.c_str(), i, value, n_axes);
  });
}

}  // namespace posenc::cuda
