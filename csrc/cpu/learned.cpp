// The learned family on the CPU: how table rows are read and the kernels called under the op layer of
// common/learned.h; the loops are in cpu/kernels/additive.cpp (table rows added) and cpu/kernels/resample.cpp
// (tables resampled to a new grid, and added to an input's rows as they are resampled).
#include "common/learned.h"
#include "common/positions.h"
#include "cpu/device.h"
#include "cpu/kernels/additive.h"
#include "cpu/kernels/resample.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

namespace posenc {
namespace {

struct CpuLearned : CpuDevice {

  static HostPositions<int64_t> read_table_rows(const char* op, const std::optional<at::Tensor>& positions,
                                                int64_t count, int64_t offset, const PositionDomain& domain) {
    return read_host_positions<int64_t>(op, positions, count, offset, domain);
  }

  static constexpr auto check_indices = &check_indices_in_range;

  // out = in * scale + table[table_rows[p]]: the rows read by P positions (shared by out's rows / P leading
  // indices) added to out's rows.
  template <typename scalar_t>
  static void add_rows(const at::Tensor& in, const at::Tensor& ids, const at::Tensor& out, const at::Tensor& table,
                       const HostPositions<int64_t>& table_rows, double scale) {
    const int64_t width = out.size(-1);
    const RowInput<scalar_t> rows{in.defined() ? in.const_data_ptr<scalar_t>() : nullptr,
                                  ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr};
    cpu::learned_stub<scalar_t>({rows, out.mutable_data_ptr<scalar_t>(), out.numel() / width, width,
                                 table.const_data_ptr<scalar_t>(), table_rows.data(), table_rows.first,
                                 table_rows.count, scale});
  }

  template <typename scalar_t>
  static void resample(const at::Tensor& table, const at::Tensor& out, const ResampleGrid& grid) {
    cpu::resample_stub<scalar_t>(
        {table.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), out.size(1), grid});
  }

  template <typename scalar_t>
  static void add_resampled(const at::Tensor& in, const at::Tensor& out, const at::Tensor& table,
                            const ResampleGrid& grid) {
    cpu::add_resampled_stub<scalar_t>({in.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
                                       out.numel() / out.size(-1), table.const_data_ptr<scalar_t>(), table.size(1),
                                       grid});
  }

  template <typename scalar_t>
  static void resample_adjoint(const at::Tensor& grad, const at::Tensor& out, const ResampleGrid& grid) {
    const int64_t width = grad.size(-1);
    cpu::resample_adjoint_stub<scalar_t>({grad.const_data_ptr<scalar_t>(), grad.numel() / (width * grad.size(-2)),
                                          out.mutable_data_ptr<scalar_t>(), width, grid});
  }

  // Each row of a [..., S] mask is scanned along S.
  static at::Tensor count_positions(const at::Tensor& is_real, int64_t first, int64_t pad) {
    const auto real = is_real.contiguous();
    auto out = at::empty(real.sizes(), real.options().dtype(at::kLong));
    if (out.numel() == 0) return out;
    const int64_t seq_len = real.size(-1);
    cpu::count_positions_stub(
        {real.const_data_ptr<bool>(), out.mutable_data_ptr<int64_t>(), real.numel() / seq_len, seq_len, first, pad});
    return out;
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  LearnedOps<CpuLearned>::register_kernels(m);
}

}  // namespace posenc
