"""The main job: train a tiny transformer with posenc's fused sinusoidal embedding, export it with
TorchScript, and leave a sample for the C++ example (scripts/cpp_example) to check against.

The task, reversing a sequence of random tokens, cannot be solved without positions: attention alone is
permutation-equivariant, so the encoding is what makes it learnable.

Usage: python scripts/train_tiny.py [--steps 300] [--out build/demo]
"""
import argparse
import time
from pathlib import Path

import torch

import posenc

VOCAB, SEQ, DIM = 16, 12, 64


class TinyReverser(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = posenc.nn.SinusoidalEmbedding(VOCAB, DIM)
        layer = torch.nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def batch(size: int):
    tokens = torch.randint(0, VOCAB, (size, SEQ))
    return tokens, tokens.flip(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="build/demo")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyReverser()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens, target = batch(64)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    model.eval()
    tokens, target = batch(256)
    with torch.no_grad():
        accuracy = (model(tokens).argmax(-1) == target).float().mean().item()
    print(f"trained {args.steps} steps in {time.perf_counter() - start:.1f} s; reversal accuracy {accuracy:.3f}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.jit.script(model).save(str(out / "model.pt"))
    sample = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        prediction = model(sample[None]).argmax(-1)[0]
    (out / "sample.txt").write_text(" ".join(map(str, sample.tolist())) + "\n" +
                                    " ".join(map(str, prediction.tolist())) + "\n")
    print(f"saved {out / 'model.pt'}; sample {sample.tolist()} -> {prediction.tolist()}")


if __name__ == "__main__":
    main()
