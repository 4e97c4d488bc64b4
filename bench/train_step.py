"""Training-step time and first-step compile time on CPU: fp8fx vs plain torch.compile vs
torchao's float8 emulate mode, each pair with the same inner compiler.

Run: python bench/train_step.py [--inner inductor|eager|both] [--layers 2 --dim 256 --seq 128 --batch 8]
Prints, per inner compiler, the first step (compile + run) and the median of the next steps, and
the ratios the project targets: fp8fx step <= 0.8x torchao emulate, first step <= 1.15x plain.
Needs the bench extra (torchao, transformers). Compile caches are off so every first step compiles.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import fp8fx

# torch.compile backend of the non-fp8fx runs, by fp8fx inner compiler.
PLAIN_BACKEND = {"inductor": "inductor", "eager": "aot_eager"}


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=args.dim, intermediate_size=4 * args.dim, num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.dim // 64), vocab_size=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def time_steps(model: torch.nn.Module, compiled, tokens: torch.Tensor, steps: int) -> tuple[float, float]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        loss = compiled(tokens).logits.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:])


def warm_up(inner: str) -> None:
    """Pay one-time costs (Inductor's C++ toolchain probe, first kernels) before timing anything."""
    lin = torch.nn.Linear(16, 16)
    torch.compile(lin, backend=PLAIN_BACKEND[inner])(torch.randn(4, 16)).sum().backward()
    torch._dynamo.reset()


def run(inner: str, base: torch.nn.Module, tokens: torch.Tensor, steps: int, fuse: bool = True) -> dict[str, tuple[float, float]]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    results = {}
    warm_up(inner)
    plain = copy.deepcopy(base)
    torch._dynamo.reset()
    results["plain"] = time_steps(plain, torch.compile(plain, backend=PLAIN_BACKEND[inner]), tokens, steps)
    ours = copy.deepcopy(base)
    torch._dynamo.reset()
    backend = fp8fx.backend(inner=inner, fuse_epilogues=fuse)
    results["fp8fx"] = time_steps(ours, torch.compile(ours, backend=backend), tokens, steps)
    ao = copy.deepcopy(base)
    convert_to_float8_training(ao, config=Float8LinearConfig(emulate=True))
    torch._dynamo.reset()
    results["torchao"] = time_steps(ao, torch.compile(ao, backend=PLAIN_BACKEND[inner]), tokens, steps)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inner", default="both", choices=["inductor", "eager", "both"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-fusion", action="store_true", help="keep fp8fx's FP8 GEMMs unfused (fuse_epilogues=False)")
    args = ap.parse_args()
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    base = build_model(args)
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    print(f"Llama {args.layers} layers, dim {args.dim}, batch {args.batch} x seq {args.seq}, fp32 params, {torch.get_num_threads()} threads")
    for inner in ("eager", "inductor") if args.inner == "both" else (args.inner,):
        r = run(inner, base, tokens, args.steps, fuse=not args.no_fusion)
        print(f"\ninner={inner} (plain and torchao use backend={PLAIN_BACKEND[inner]!r})")
        for name, (first, step) in r.items():
            print(f"  {name:8s} first step {first:7.2f} s   step {1000 * step:8.1f} ms")
        print(f"  fp8fx step / torchao emulate step = {r['fp8fx'][1] / r['torchao'][1]:.2f}   (target <= 0.8)")
        print(f"  fp8fx first step / plain first step = {r['fp8fx'][0] / r['plain'][0]:.2f}   (target <= 1.15)")


if __name__ == "__main__":
    main()
