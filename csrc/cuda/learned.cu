// The learned family on the GPU: how table rows are read and the kernels launched under the op layer of
// common/learned.h; table rows added by the additive kernel of cuda/additive.cuh, make_positions and
// positions_from_mask as ATen scans.
#include "common/learned.h"
#include "cuda/additive.cuh"
#include "cuda/positions.cuh"

#include <ATen/ops/add.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/where.h>
#include <torch/library.h>

namespace posenc::cuda {
namespace {

struct CudaLearned : CudaDevice {

  static DevicePositions read_table_rows(const char* op, const std::optional<at::Tensor>& positions, int64_t count,
                                         int64_t offset, const PositionDomain& domain) {
    return {table_rows(op, positions, count, offset, domain), count, offset};
  }

  static constexpr auto check_indices = &check_device_indices_in_range;

  // out = in * scale + table[rows[p] (or offset + p)]: the rows read by P positions, shared by the
  // out.numel() / width / P leading indices.
  template <typename scalar_t>
  static void add_rows(const at::Tensor& in, const at::Tensor& ids, const at::Tensor& out, const at::Tensor& table,
                       const DevicePositions& rows, double scale) {
    const int64_t width = out.size(-1);
    const scalar_t* table_data = table.const_data_ptr<scalar_t>();
    const TableEncoding<scalar_t> encoding{table_data,
                                           rows.values.defined() ? rows.values.const_data_ptr<int64_t>() : nullptr,
                                           rows.offset, table.size(0), width};
    launch_additive(additive_rows<scalar_t>(in, ids, out, rows.count, width), scale, encoding, aligned(table_data));
  }

  // Each row of a [..., S] mask is scanned along S (the CPU's count, as an ATen scan).
  static at::Tensor count_positions(const at::Tensor& is_real, int64_t first, int64_t pad) {
    // first + (real entries up to and including this one) - 1
    const auto numbered = at::add(at::cumsum(is_real, -1, at::kLong), first - 1);
    return at::where(is_real, numbered, pad).contiguous();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  LearnedOps<CudaLearned>::register_kernels(m);
}

}  // namespace posenc::cuda
