// Runs an AOTInductor package from plain C++: no Python, no compiler at run time.
//
//   posenc_aoti_run PACKAGE.pt2 INPUTS.pt OUTPUTS.pt
//
// INPUTS.pt holds the model's positional inputs as a list or tuple of tensors, written in Python with
// torch.save; OUTPUTS.pt receives the outputs as a tuple of tensors, readable in Python with torch.load.
#include <posenc/posenc.h>  // links libposenc: the package calls posenc ops through the dispatcher by name

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/serialize.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

namespace {

std::vector<char> read_file(const char* path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "posenc_aoti_run: cannot read ", path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<at::Tensor> tensors_of(const c10::IValue& value) {
  std::vector<at::Tensor> tensors;
  if (value.isTensor()) {
    tensors.push_back(value.toTensor());
  } else if (value.isTuple()) {
    for (const auto& element : value.toTupleRef().elements()) tensors.push_back(element.toTensor());
  } else {
    TORCH_CHECK(value.isList(), "posenc_aoti_run: INPUTS.pt must hold a tensor, a list or a tuple of tensors");
    for (const auto& element : value.toListRef()) tensors.push_back(element.toTensor());
  }
  return tensors;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: " << argv[0] << " PACKAGE.pt2 INPUTS.pt OUTPUTS.pt\n";
    return 2;
  }
  torch::inductor::AOTIModelPackageLoader loader(argv[1]);
  const auto inputs = tensors_of(torch::pickle_load(read_file(argv[2])));
  const auto outputs = loader.run(inputs);

  // A tuple, which torch.load reads with its default weights_only=True (a tensor list would need an allowlist).
  const std::vector<c10::IValue> elements(outputs.begin(), outputs.end());
  const auto bytes = torch::pickle_save(c10::ivalue::Tuple::create(elements));
  std::ofstream(argv[3], std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  std::cout << "posenc " << posenc::version() << " | " << argv[1] << ": " << inputs.size() << " inputs -> "
            << outputs.size() << " outputs";
  for (const auto& output : outputs) std::cout << ' ' << output.sizes();
  std::cout << '\n';
  return 0;
}
