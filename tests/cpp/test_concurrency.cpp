// Thread safety from C++ (the public API only): every op, forward, backward and autograd, called from 8
// std::threads at once on shared inputs gives the serial results bit for bit; posenc::nn modules shared by 8
// threads for inference do too. scripts/tsan.sh builds this test with ThreadSanitizer.
#include <posenc/posenc.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kThreads = 8;
constexpr int kRounds = 2;

using Results = std::vector<at::Tensor>;
using Calls = std::map<std::string, std::function<Results()>>;

// Bitwise equality, NaN payloads included.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || !a.sizes().equals(b.sizes())) return false;
  if (!a.is_floating_point()) return torch::equal(a, b);
  const auto as_int = a.element_size() == 2 ? at::kShort : a.element_size() == 4 ? at::kInt : at::kLong;
  return torch::equal(a.contiguous().view(as_int), b.contiguous().view(as_int));
}

Results grads(const at::Tensor& out, const std::vector<at::Tensor>& inputs, const at::Tensor& grad_out) {
  Results results = {out};
  for (const auto& g : torch::autograd::grad({out}, inputs, {grad_out})) results.push_back(g);
  return results;
}

// Inputs read by every thread, large enough that each kernel splits its work; never written.
struct Inputs {
  Inputs() {
    torch::manual_seed(0);
    x = torch::randn({4, 256, 128});
    x_grad = torch::randn({4, 256, 128}, torch::requires_grad());
    grad_x = torch::randn({4, 256, 128});
    positions = torch::randint(0, 5000, {4, 256});
    tokens = torch::randint(0, 500, {4, 256});
    table = torch::randn({500, 128}, torch::requires_grad());
    pos_table = torch::randn({300, 128}, torch::requires_grad());
    q = torch::randn({2, 128, 8, 64}).to(at::kBFloat16);
    k = torch::randn({2, 128, 2, 64}).to(at::kBFloat16);
    q_grad = torch::randn({2, 128, 8, 64}, torch::requires_grad());
    grad_bshd = torch::randn({2, 128, 8, 64});
    rope_positions = torch::randint(0, 100000, {2, 128});
    cos = torch::randn({128, 64});
    sin = torch::randn({128, 64});
    scores = torch::randn({2, 8, 64, 128});
    scores_grad = torch::randn({2, 8, 64, 128}, torch::requires_grad());
    grad_scores = torch::randn({2, 8, 64, 128});
    slopes = posenc::alibi_slopes(8).requires_grad_(true);
    t5_table = torch::randn({32, 8}, torch::requires_grad());
    relative = torch::randint(-1000, 1000, {64, 512});
    mask = torch::randint(0, 2, {8, 4096});
  }
  at::Tensor x, x_grad, grad_x, positions, tokens, table, pos_table, q, k, q_grad, grad_bshd, rope_positions, cos,
      sin, scores, scores_grad, grad_scores, slopes, t5_table, relative, mask;
  at::Tensor inv_freq = posenc::frequencies::sinusoidal(128);
  at::Tensor rope_freq = posenc::frequencies::rope(64).inv_freq;
  posenc::frequencies::AxisFrequencies mrope = posenc::frequencies::mrope(64, {8, 12, 12});
  at::Tensor mrope_positions = torch::randint(0, 100000, {3, 2, 128});  // [n_axes, B, S], as Qwen2-VL's
};

Calls op_calls(const Inputs& t) {
  Calls calls;
  calls["sinusoidal"] = [&] { return Results{posenc::sinusoidal(t.positions, t.inv_freq, "half", std::nullopt, 3)}; };
  calls["add_sinusoidal"] = [&] { return Results{posenc::add_sinusoidal(t.x, t.positions, t.inv_freq, 2.0)}; };
  calls["add_sinusoidal autograd"] = [&] {
    return grads(posenc::add_sinusoidal(t.x_grad, std::nullopt, t.inv_freq, 0.5), {t.x_grad}, t.grad_x);
  };
  calls["embed_sinusoidal autograd"] = [&] {
    return grads(posenc::embed_sinusoidal(t.tokens, t.table, std::nullopt, t.inv_freq, 1.5, 0), {t.table}, t.grad_x);
  };
  calls["embedding_backward"] = [&] { return Results{posenc::embedding_backward(t.grad_x, t.tokens, 500, 0.5, 3)}; };
  calls["learned autograd"] = [&] {
    return grads(posenc::learned(t.table, t.tokens), {t.table}, t.grad_x);
  };
  calls["add_learned autograd"] = [&] {
    return grads(posenc::add_learned(t.x_grad, t.pos_table, t.tokens.remainder(290), 3), {t.x_grad, t.pos_table},
                 t.grad_x);
  };
  calls["embed_learned autograd"] = [&] {
    return grads(posenc::embed_learned(t.tokens, t.table, t.pos_table, std::nullopt, 2.0, 1, 10, 0),
                 {t.table, t.pos_table}, t.grad_x);
  };
  calls["make_positions"] = [&] { return Results{posenc::make_positions(t.tokens.remainder(7), 1)}; };
  calls["positions_from_mask"] = [&] { return Results{posenc::positions_from_mask(t.mask, -1)}; };
  calls["rope"] = [&] {
    return Results{posenc::rope(t.q, t.rope_positions, t.rope_freq, 1.0, "gptj", "bshd", 5)};
  };
  calls["rope autograd"] = [&] {
    return grads(posenc::rope(t.q_grad.transpose(1, 2), std::nullopt, t.rope_freq, 1.0, "neox", "bhsd"), {t.q_grad},
                 t.grad_bshd.transpose(1, 2));
  };
  calls["rope_backward"] = [&] {
    return Results{posenc::rope_backward(t.grad_bshd, std::nullopt, t.rope_freq, 0.5, "neox", "bshd", 2)};
  };
  calls["rope_qk"] = [&] {
    auto [q, k] = posenc::rope_qk(t.q, t.k, std::nullopt, t.rope_freq, 1.0, "neox", "bshd", 11);
    return Results{q, k};
  };
  calls["rope_qk_backward"] = [&] {
    auto [q, k] = posenc::rope_qk_backward(t.q.to(at::kFloat), t.k.to(at::kFloat), t.rope_positions, t.rope_freq);
    return Results{q, k};
  };
  calls["rope_"] = [&] {  // in place on a private copy: writing a shared input would be a race by design
    auto x = t.q.clone();
    posenc::rope_(x, t.rope_positions, t.rope_freq, 1.0, "neox", "bshd", 1);
    return Results{x};
  };
  calls["rope_qk multiaxis"] = [&] {
    auto [q, k] = posenc::rope_qk(t.q, t.k, t.mrope_positions, t.mrope.inv_freq, 1.0, "neox", "bshd", 3, std::nullopt,
                                  t.mrope.pair_axis);
    return Results{q, k};
  };
  calls["rope_cos_sin"] = [&] { return Results{posenc::rope_cos_sin(t.q, t.cos, t.sin, "gptj")}; };
  calls["rope_cos_sin_backward"] = [&] { return Results{posenc::rope_cos_sin_backward(t.grad_bshd, t.cos, t.sin)}; };
  calls["alibi_bias"] = [&] { return Results{posenc::alibi_bias(t.slopes.detach(), 300, 500, "symmetric")}; };
  calls["add_alibi autograd"] = [&] {
    return grads(posenc::add_alibi(t.scores_grad, t.slopes, "symmetric"), {t.scores_grad, t.slopes}, t.grad_scores);
  };
  calls["add_alibi_"] = [&] {
    auto scores = t.scores.clone();
    posenc::add_alibi_(scores, t.slopes.detach(), "causal");
    return Results{scores};
  };
  calls["alibi_backward"] = [&] { return Results{posenc::alibi_backward(t.grad_scores, t.slopes.detach(), "causal")}; };
  calls["relative_position_bucket"] = [&] {
    return Results{posenc::relative_position_bucket(t.relative, false, 32, 128)};
  };
  calls["t5_bias autograd"] = [&] {
    return grads(posenc::t5_bias(t.t5_table, 64, 128, false, 32, 128, 3), {t.t5_table}, t.grad_scores.slice(0, 0, 1));
  };
  calls["t5_bias_backward"] = [&] {
    return Results{posenc::t5_bias_backward(t.grad_scores.slice(0, 0, 1), true, 32, 128, 7)};
  };
  return calls;
}

// Releases the threads at once, when all of them have arrived (std::barrier is C++20; we build as C++17).
class StartGate {
 public:
  explicit StartGate(int count) : waiting_(count) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (--waiting_ == 0) {
      open_.notify_all();
    } else {
      open_.wait(lock, [this] { return waiting_ == 0; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable open_;
  int waiting_;
};

// Every thread runs every call kRounds times in its own shuffled order, all released at once by a barrier;
// `guard` sets up each thread's grad mode (thread-local). Returns the problems found.
template <typename Guard>
std::vector<std::string> run_concurrently(const Calls& calls, const std::map<std::string, Results>& expected) {
  std::vector<std::string> problems;
  std::mutex problems_mutex;
  StartGate start(kThreads);
  std::vector<std::thread> threads;
  for (int index = 0; index < kThreads; ++index) {
    threads.emplace_back([&, index] {
      std::vector<std::string> order;
      for (const auto& entry : calls) {
        for (int round = 0; round < kRounds; ++round) order.push_back(entry.first);
      }
      std::shuffle(order.begin(), order.end(), std::mt19937(index));
      start.arrive_and_wait();
      Guard guard;
      for (const auto& name : order) {
        std::string problem;
        try {
          const auto got = calls.at(name)();
          const auto& want = expected.at(name);
          bool same = got.size() == want.size();
          for (size_t i = 0; same && i < got.size(); ++i) same = same_bits(got[i], want[i]);
          if (!same) problem = "thread " + std::to_string(index) + ": " + name + " differs from the serial result";
        } catch (const std::exception& e) {
          problem = "thread " + std::to_string(index) + ": " + name + " threw " + e.what();
        }
        if (!problem.empty()) {
          std::lock_guard<std::mutex> lock(problems_mutex);
          problems.push_back(problem);
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return problems;
}

struct GradMode {};  // autograd on: the threads build and run their own graphs

TEST(Concurrency, EveryOpFrom8ThreadsEqualsTheSerialResults) {
  const Inputs inputs;
  const auto calls = op_calls(inputs);
  std::map<std::string, Results> expected;
  for (const auto& [name, call] : calls) expected[name] = call();
  EXPECT_EQ(run_concurrently<GradMode>(calls, expected), std::vector<std::string>{});
}

TEST(Concurrency, ModulesSharedBy8ThreadsForInferenceEqualTheSerialResults) {
  const Inputs t;
  torch::manual_seed(1);
  posenc::nn::SinusoidalPositionalEncoding sinusoidal(128, 10000.0, 1, "half");
  posenc::nn::LearnedPositionalEmbedding learned(300, 128, std::nullopt, 2);
  posenc::nn::LearnedEmbedding embedding(500, 300, 128, 0);
  posenc::nn::RotaryEmbedding rotary(64);
  posenc::frequencies::RopeScaling dynamic_scaling;
  dynamic_scaling.rope_type = "dynamic";
  dynamic_scaling.factor = 2.0;
  dynamic_scaling.max_position_embeddings = 64;
  posenc::nn::RotaryEmbedding dynamic(64, std::nullopt, 10000.0, "neox", dynamic_scaling);
  posenc::nn::ALiBi alibi(8, "symmetric");
  posenc::nn::T5RelativeBias t5(8, 32, 128, false);
  for (auto* module : std::vector<torch::nn::Module*>{sinusoidal.get(), learned.get(), embedding.get(), rotary.get(),
                                                      dynamic.get(), alibi.get(), t5.get()}) {
    module->eval();
  }
  Calls calls;
  calls["SinusoidalPositionalEncoding"] = [&] { return Results{sinusoidal(t.x, std::nullopt, 4)}; };
  calls["LearnedPositionalEmbedding"] = [&] { return Results{learned(t.x, t.tokens.remainder(290))}; };
  calls["LearnedEmbedding"] = [&] { return Results{embedding(t.tokens, std::nullopt, 10)}; };
  for (const int64_t length : {16, 60, 128}) {  // dynamic NTK: frequencies differ per call length
    for (auto* module : {&rotary, &dynamic}) {
      const auto name = std::string(module == &rotary ? "RotaryEmbedding" : "RotaryEmbedding dynamic") +
                        " S=" + std::to_string(length);
      calls[name] = [&t, module, length] {
        auto [q, k] = (*module)(t.q.slice(1, 0, length), t.k.slice(1, 0, length), std::nullopt, 5);
        return Results{q, k};
      };
    }
  }
  calls["ALiBi"] = [&] { return Results{alibi(t.scores)}; };
  calls["ALiBi bias"] = [&] { return Results{alibi->bias(100, 300)}; };
  calls["T5RelativeBias"] = [&] { return Results{t5(64, 300, 17)}; };

  std::map<std::string, Results> expected;
  {
    torch::NoGradGuard no_grad;
    for (const auto& [name, call] : calls) expected[name] = call();
  }
  EXPECT_EQ(run_concurrently<torch::NoGradGuard>(calls, expected), std::vector<std::string>{});
  EXPECT_EQ(run_concurrently<c10::InferenceMode>(calls, expected), std::vector<std::string>{});
}

}  // namespace
