// Runs a TorchScript model that uses posenc ops from plain C++: forward, then one backward pass.
//
//   posenc_run_model MODEL.pt SAMPLE.txt
//
// SAMPLE.txt (written by scripts/train_tiny.py): line 1 the input tokens, line 2 Python's predictions.
// Exits non-zero if C++ predicts differently from Python.
#include <posenc/posenc.h>  // links libposenc, whose op registrations torch::jit::load needs

#include <torch/script.h>
#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>

namespace {

std::vector<int64_t> read_line(std::istream& in) {
  std::string line;
  std::getline(in, line);
  std::istringstream words(line);
  std::vector<int64_t> values;
  for (int64_t v; words >> v;) values.push_back(v);
  return values;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " MODEL.pt SAMPLE.txt\n";
    return 2;
  }
  auto model = torch::jit::load(argv[1]);
  std::ifstream sample(argv[2]);
  const auto tokens = read_line(sample);
  const auto expected = read_line(sample);
  const auto input = torch::tensor(tokens).unsqueeze(0);

  model.eval();
  const auto logits = model.forward({input}).toTensor();
  const auto predicted = logits.argmax(-1).squeeze(0);
  std::cout << "posenc " << posenc::version() << " | tokens    ";
  for (auto t : tokens) std::cout << t << ' ';
  std::cout << "\n             | predicted ";
  for (int64_t i = 0; i < predicted.size(0); ++i) std::cout << predicted[i].item<int64_t>() << ' ';
  std::cout << '\n';

  // One training step's backward from C++: gradients flow through posenc's embedding op.
  model.train();
  const auto target = input.flip({-1});
  const auto loss = torch::nn::functional::cross_entropy(model.forward({input}).toTensor().flatten(0, 1),
                                                         target.flatten());
  loss.backward();
  for (const auto& p : model.named_parameters()) {
    if (p.name == "embed.weight") std::cout << "loss " << loss.item<double>() << ", |d loss / d embed.weight| "
                                            << p.value.grad().norm().item<double>() << '\n';
  }

  const auto matches = torch::equal(predicted, torch::tensor(expected));
  std::cout << (matches ? "C++ predictions match Python's\n" : "C++ predictions DIFFER from Python's\n");
  return matches ? 0 : 1;
}
