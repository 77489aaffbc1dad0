// CUDA kernels of the ops that compute positions on the host from a few small tensors, whose output sizes or
// errors depend on their values: mrope_positions (walks runs of tokens and grids, once per batch) and
// zigzag_positions_varlen (sizes from cu_seqlens). Both run their CPU kernel on host copies of the tensor
// arguments and return the results on the inputs' device, so their values and errors are the CPU's, word for
// word. The copies read device data: these ops belong outside a model's per-layer path.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

namespace posenc::cuda {
namespace {

void on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& name = op.schema().name();
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  std::optional<at::Device> device;
  for (size_t i = 0; i < arguments.size(); ++i) {
    auto& value = (*stack)[first + i];
    if (!value.isTensor()) continue;
    const auto tensor = value.toTensor();
    if (!device) device = tensor.device();
    TORCH_CHECK(tensor.device() == *device, "posenc.", name.substr(name.find("::") + 2), ": ", arguments[i].name(),
                " is on ", tensor.device(), " but the other inputs are on ", *device);
    value = tensor.cpu();
  }
  op.callBoxed(stack);
  const size_t returns = op.schema().returns().size();
  for (size_t i = stack->size() - returns; i < stack->size(); ++i) {
    if ((*stack)[i].isTensor() && device) (*stack)[i] = (*stack)[i].toTensor().to(*device);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("mrope_positions", torch::CppFunction::makeFromBoxedFunction<&on_host>());
  m.impl("zigzag_positions_varlen", torch::CppFunction::makeFromBoxedFunction<&on_host>());
}

}  // namespace posenc::cuda
