// Data-dependent checks of the CUDA ops and the device arrays of positions (see positions.cuh).
#include "cuda/positions.cuh"
#include "cuda/utils.cuh"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <limits>
#include <mutex>
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

// A device word that records the smallest flat index that failed a check; all ones while none has.
at::Tensor new_flag(const at::Tensor& like) {
  auto flag = at::empty({1}, like.options().dtype(at::kLong));
  C10_CUDA_CHECK(cudaMemsetAsync(flag.mutable_data_ptr<int64_t>(), 0xFF, sizeof(int64_t), current_stream()));
  return flag;
}

unsigned long long* flag_word(const at::Tensor& flag) {
  return reinterpret_cast<unsigned long long*>(flag.mutable_data_ptr<int64_t>());
}

// Whether a check flagged an index: one read of 8 bytes, which waits for the stream. Under graph capture no
// read is possible and none is made.
bool flagged(const at::Tensor& flag) { return !capturing() && flag.item<int64_t>() != -1; }

// sum = value + offset in int64, marked bad if it overflows or leaves [lo, hi]; out (if any) gets the sum.
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

// Floating positions (diffusion timesteps): p + offset in float64, bad when finite and beyond `limit`.
__global__ void offset_floating_kernel(const double* in, int64_t n, double offset, double limit, bool finite,
                                       double* out, unsigned long long* first_bad) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const double sum = in[i] + offset;
    if (!(fabs(sum) <= limit) && (finite || isfinite(sum))) atomicMin(first_bad, static_cast<unsigned long long>(i));
    out[i] = sum;
  }
}

// Position of token t of a packed input: its index in its sequence (the last j with bounds[j] <= t) plus offset.
__global__ void sequence_positions_kernel(const int64_t* bounds, int64_t num_bounds, int64_t tokens, int64_t offset,
                                          double* out) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < tokens; t += int64_t{gridDim.x} * blockDim.x) {
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
    const auto index = static_cast<uint64_t>(t) - static_cast<uint64_t>(bounds[lo]);
    out[t] = static_cast<double>(static_cast<int64_t>(index + static_cast<uint64_t>(offset)));
  }
}

template <typename... Args, typename Kernel>
void launch_over(int64_t n, Kernel kernel, Args... args) {
  kernel<<<grid_size(n, kCheckThreads), kCheckThreads, 0, current_stream()>>>(args...);
  POSENC_CUDA_LAUNCH_CHECK();
}

// Raises the CPU's error about `positions` (a host copy of them is checked there) when the flag is set.
template <typename T>
void raise_if_flagged(const char* op, const at::Tensor& flag, const at::Tensor& positions, int64_t count,
                      int64_t offset, const PositionDomain& domain) {
  if (!flagged(flag)) return;
  read_positions<T>(op, positions.cpu(), count, offset, domain);
  TORCH_INTERNAL_ASSERT(false, "posenc.", op, ": positions failed a range check that the host check passed");
}

// Integer positions plus offset into `out` (int64 table rows or float64 angles), checked against `domain`.
template <typename T>
at::Tensor offset_integer_positions(const char* op, const at::Tensor& positions, int64_t count, int64_t offset,
                                    const PositionDomain& domain, at::ScalarType out_type) {
  const auto values = (positions.scalar_type() == at::kInt ? positions : positions.to(at::kLong)).contiguous();
  auto out = at::empty({values.numel()}, values.options().dtype(out_type));
  if (values.numel() == 0) return out;
  const auto flag = new_flag(values);
  AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "posenc_cuda_offset_positions", [&] {
    if (out_type == at::kDouble) {
      launch_over(values.numel(), offset_indices_kernel<index_t, double>, values.const_data_ptr<index_t>(),
                  values.numel(), offset, domain.lo, domain.hi, out.mutable_data_ptr<double>(), flag_word(flag));
    } else {
      launch_over(values.numel(), offset_indices_kernel<index_t, int64_t>, values.const_data_ptr<index_t>(),
                  values.numel(), offset, domain.lo, domain.hi, out.mutable_data_ptr<int64_t>(), flag_word(flag));
    }
  });
  raise_if_flagged<T>(op, flag, positions, count, offset, domain);
  return out;
}

}  // namespace

at::Tensor angle_positions(const char* op, const std::optional<at::Tensor>& positions, int64_t count, int64_t offset,
                           const std::optional<at::Tensor>& cu_seqlens, const PositionDomain& domain) {
  std::optional<at::Tensor> host_cu;
  int64_t longest = count;  // the longest run of offset + arange
  if (cu_seqlens && !capturing()) {
    host_cu = cu_seqlens->to(at::kCPU).to(at::kLong).contiguous();
    check_cu_seqlens_values(op, host_cu, count);
    const int64_t* bounds = host_cu->const_data_ptr<int64_t>();
    longest = 0;
    for (int64_t j = 0; j + 1 < host_cu->numel(); ++j) longest = std::max(longest, bounds[j + 1] - bounds[j]);
  }
  if (positions) {
    if (at::isFloatingType(positions->scalar_type())) {
      const auto values = positions->to(at::kDouble).contiguous();
      if (std::abs(offset) > kMaxExactPosition) {
        read_positions<double>(op, positions->cpu(), count, offset, domain);  // raises about the offset
      }
      auto out = at::empty({values.numel()}, values.options());
      if (values.numel() == 0) return out;
      const auto flag = new_flag(values);
      launch_over(values.numel(), offset_floating_kernel, values.const_data_ptr<double>(), values.numel(),
                  static_cast<double>(offset), static_cast<double>(kMaxExactPosition), domain.finite,
                  out.mutable_data_ptr<double>(), flag_word(flag));
      raise_if_flagged<double>(op, flag, *positions, count, offset, domain);
      return out;
    }
    return offset_integer_positions<double>(op, *positions, count, offset, domain, at::kDouble);
  }
  if (!cu_seqlens) {
    check_arange<double>(op, count, count, offset, domain, std::nullopt);
    return {};
  }
  if (host_cu) check_arange<double>(op, count, longest, offset, domain, host_cu);  // none under graph capture
  const auto bounds = cu_seqlens->to(at::kLong).contiguous();
  auto out = at::empty({count}, bounds.options().dtype(at::kDouble));
  if (count > 0) {
    launch_over(count, sequence_positions_kernel, bounds.const_data_ptr<int64_t>(), bounds.numel(), count, offset,
                out.mutable_data_ptr<double>());
  }
  return out;
}

at::Tensor table_rows(const char* op, const std::optional<at::Tensor>& positions, int64_t count, int64_t offset,
                      const PositionDomain& domain) {
  if (!positions) {
    check_arange<int64_t>(op, count, count, offset, domain, std::nullopt);
    return {};
  }
  return offset_integer_positions<int64_t>(op, *positions, count, offset, domain, at::kLong);
}

void check_device_indices_in_range(const char* op, const char* arg, const at::Tensor& indices, int64_t limit,
                                   const char* limit_name) {
  if (indices.numel() == 0 || capturing()) return;
  const auto values = indices.contiguous();
  const auto flag = new_flag(values);
  AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "posenc_cuda_check_indices", [&] {
    launch_over(values.numel(), offset_indices_kernel<index_t, int64_t>, values.const_data_ptr<index_t>(),
                values.numel(), int64_t{0}, int64_t{0}, limit - 1, static_cast<int64_t*>(nullptr), flag_word(flag));
  });
  if (!flagged(flag)) return;
  posenc::check_indices_in_range(op, arg, indices.cpu(), limit, limit_name);
  TORCH_INTERNAL_ASSERT(false, "posenc.", op, ": ", arg, " failed a range check that the host check passed");
}

}  // namespace posenc::cuda
