// The C++ half of the length-generalization study: loads the model that `python scripts/study.py` exported
// with TorchScript, measures its held-out bits per byte at the lengths Python measured, and continues a
// prompt greedily twice: recomputing the whole text at every step (forward), and reading the keys and values of
// the bytes before from caches that the model's decode_step fills (posenc::rope_qk_cache_), timing both.
//
//   posenc_study EXPORT_DIR
//
// EXPORT_DIR holds what the study wrote: model.pt, heldout.bin (the evaluation chunks, one byte per token),
// check.txt (chunk size, context, bytes to generate, and Python's "bpb LENGTH VALUE" lines), prompt.txt and
// generated_python.txt. Exits non-zero when a value differs from Python's by more than 1e-4 or a generated
// text differs from Python's.
#include <posenc/posenc.h>  // links libposenc, whose op registrations torch::jit::load needs

#include <torch/script.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr double kTolerance = 1e-4;
constexpr int64_t kVocab = 256;
constexpr int64_t kTokensPerBatch = 16384;  // as the Python evaluation: the same batches, the same sums

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("posenc_study: cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct Check {
  std::string encoding;
  int64_t chunk = 0, context = 0, generate = 0;
  std::map<int64_t, double> bits_per_byte;  // length -> Python's value
};

Check read_check(const std::string& path) {
  Check check;
  std::istringstream lines(read_file(path));
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::string key;
    words >> key;
    if (key == "encoding") words >> check.encoding;
    else if (key == "chunk") words >> check.chunk;
    else if (key == "context") words >> check.context;
    else if (key == "generate") words >> check.generate;
    else if (key == "bpb") {
      int64_t length = 0;
      double value = 0;
      words >> length >> value;
      check.bits_per_byte[length] = value;
    }
  }
  if (check.chunk < 2 || check.context < 1 || check.bits_per_byte.empty())
    throw std::runtime_error("posenc_study: " + path + " lacks chunk, context or bpb lines");
  return check;
}

torch::Tensor bytes_to_tokens(const std::string& bytes) {
  auto tokens = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kLong);
  auto* out = tokens.data_ptr<int64_t>();
  for (size_t i = 0; i < bytes.size(); ++i) out[i] = static_cast<unsigned char>(bytes[i]);
  return tokens;
}

// Bits per byte over every chunk cut into windows of `length` inputs and their next-byte targets.
double bits_per_byte(torch::jit::Module& model, const torch::Tensor& chunks, int64_t length) {
  const auto inputs = chunks.slice(1, 0, -1).reshape({-1, length});
  const auto targets = chunks.slice(1, 1).reshape({-1, length});
  const int64_t per_batch = std::max<int64_t>(1, kTokensPerBatch / length);
  double nats = 0;
  for (int64_t i = 0; i < inputs.size(0); i += per_batch) {
    const auto logits = model.forward({inputs.slice(0, i, i + per_batch)}).toTensor();
    nats += torch::nn::functional::cross_entropy(
                logits.reshape({-1, kVocab}).to(torch::kDouble), targets.slice(0, i, i + per_batch).reshape(-1),
                torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                .item<double>();
  }
  return nats / static_cast<double>(targets.numel()) / std::log(2.0);
}

std::string generate(torch::jit::Module& model, const std::string& prompt, int64_t count, int64_t context) {
  std::vector<int64_t> tokens(prompt.begin(), prompt.end());
  for (auto& t : tokens) t &= 0xff;
  std::string text;
  for (int64_t i = 0; i < count; ++i) {
    const auto first = tokens.size() > static_cast<size_t>(context) ? tokens.end() - context : tokens.begin();
    const auto window = torch::tensor(std::vector<int64_t>(first, tokens.end())).unsqueeze(0);
    const auto next = model.forward({window}).toTensor()[0][-1].argmax().item<int64_t>();
    tokens.push_back(next);
    text.push_back(static_cast<char>(next));
  }
  return text;
}

// generate through the model's decode_step: the prompt in one call, then one byte per call, against caches of
// zeros [1, heads, prompt + count, head_dim] per layer (cache_shape() gives layers, heads, head_dim).
std::string generate_cached(torch::jit::Module& model, const std::string& prompt, int64_t count) {
  const auto shape = model.run_method("cache_shape").toIntVector();
  const int64_t slots = static_cast<int64_t>(prompt.size()) + count;
  std::vector<torch::Tensor> k_caches, v_caches;
  for (int64_t layer = 0; layer < shape.at(0); ++layer) {
    k_caches.push_back(torch::zeros({1, shape.at(1), slots, shape.at(2)}));
    v_caches.push_back(torch::zeros({1, shape.at(1), slots, shape.at(2)}));
  }
  auto tokens = bytes_to_tokens(prompt).unsqueeze(0);
  int64_t start = 0;
  std::string text;
  for (int64_t i = 0; i < count; ++i) {
    const auto logits = model.run_method("decode_step", tokens, start, k_caches, v_caches).toTensor();
    start += tokens.size(1);
    const auto next = logits[0][-1].argmax().item<int64_t>();
    tokens = torch::full({1, 1}, next, torch::kLong);
    text.push_back(static_cast<char>(next));
  }
  return text;
}

// Runs `generate(count)` and returns its result and its rate in bytes (tokens) per second, after an untimed run of
// a few bytes: TorchScript profiles a method's first calls before it optimizes it.
template <typename Generate>
std::pair<std::string, double> timed(Generate generate, int64_t count) {
  generate(std::min<int64_t>(count, 8));
  const auto begin = std::chrono::steady_clock::now();
  auto text = generate(count);
  const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - begin;
  return {std::move(text), static_cast<double>(count) / seconds.count()};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " EXPORT_DIR   (written by python scripts/study.py)\n";
    return 2;
  }
  const std::string dir = argv[1];
  const auto check = read_check(dir + "/check.txt");
  auto model = torch::jit::load(dir + "/model.pt");
  model.eval();
  torch::InferenceMode inference;

  const auto held_out = bytes_to_tokens(read_file(dir + "/heldout.bin"));
  if (held_out.numel() % check.chunk) throw std::runtime_error("posenc_study: heldout.bin is not whole chunks");
  const auto chunks = held_out.view({-1, check.chunk});

  std::printf("posenc %s | %s model from %s/model.pt | %lld held-out chunks of %lld predictions\n",
              posenc::version(), check.encoding.c_str(), dir.c_str(), static_cast<long long>(chunks.size(0)),
              static_cast<long long>(check.chunk - 1));
  std::printf("%8s %16s %16s %12s\n", "length", "C++ bpb", "Python bpb", "difference");
  bool agree = true;
  for (const auto& [length, expected] : check.bits_per_byte) {
    const double value = bits_per_byte(model, chunks, length);
    const double difference = std::abs(value - expected);
    agree = agree && difference <= kTolerance;
    std::printf("%8lld %16.10f %16.10f %12.2e\n", static_cast<long long>(length), value, expected, difference);
  }

  const auto prompt = read_file(dir + "/prompt.txt");
  const auto python_text = read_file(dir + "/generated_python.txt");
  const auto [text, rate] = timed([&](int64_t n) { return generate(model, prompt, n, check.context); },
                                  check.generate);
  const bool same_text = text == python_text;
  std::cout << "greedy continuation of \"" << prompt << "\" (" << check.generate << " bytes):\n"
            << prompt << text << "\n";

  // The cache keeps every byte, where generate reads the last `context` ones: the two agree while the text fits.
  // Dynamic NTK (the model's cached_decoding false) changes every cached key at every step.
  bool same_cached = true;
  const int threads = at::get_num_threads();
  std::printf("generation without cache: %.1f tokens/s (batch 1, %d thread%s)\n", rate, threads,
              threads == 1 ? "" : "s");
  if (!model.attr("cached_decoding").toBool()) {
    std::cout << "generation with cache: n/a (rotary frequencies that depend on the length)\n";
  } else if (static_cast<int64_t>(prompt.size()) + check.generate - 1 > check.context) {
    std::cout << "generation with cache: n/a (the text is longer than the context of " << check.context << ")\n";
  } else {
    const auto [cached, cached_rate] = timed([&](int64_t n) { return generate_cached(model, prompt, n); },
                                             check.generate);
    same_cached = cached == text && cached == python_text;
    std::printf("generation with cache: %.1f tokens/s (%.1fx); cached text %s\n", cached_rate, cached_rate / rate,
                same_cached ? "equals the uncached text" : "DIFFERS from the uncached text");
  }

  std::cout << (agree ? "bits per byte agree with Python's within 1e-4" : "bits per byte DIFFER from Python's")
            << "; generated text " << (same_text ? "equals Python's" : "DIFFERS from Python's") << '\n';
  return agree && same_text && same_cached ? 0 : 1;
}
