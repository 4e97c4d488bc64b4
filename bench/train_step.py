"""Training-step time and first-step compile time on CPU: fp8fx vs plain torch.compile vs
torchao's float8 emulate mode, each pair with the same inner compiler.

Run: python bench/train_step.py [--inner inductor|eager|both] [--layers 2 --dim 256 --seq 128 --batch 8]
Prints, per inner compiler, the first step (compile + run), the median of the next steps and the
time per step in Inductor's compiled kernels (profiled; FP8's elementwise work), and the ratios
the project targets: fp8fx's step overhead over plain at most torchao emulate's (an exact
emulation's fp32 GEMMs alone take a plain step's time), first step <= 1.15x plain.
--saved-outputs high keeps the GEMM outputs backward reads as they are, as torchao does: by default
fp8fx saves BF16 copies of them, which on this fp32 model are extra writes (on a BF16 model, none).
Needs the bench extra (torchao, transformers). Inductor's FX graph and AOTAutograd caches are off
so every first step compiles; its C++ kernel builds are not (they are reused from earlier runs and
from the other backends of this one), so the first-step ratio here is not a cold compile:
bench/compile_time.py measures those, a fresh process and cache directory per first step.

--warm: Inductor's caches on, each first step in its own process, twice per compiler over one
fresh cache directory: the cold first step, then a second process's (warm) one, and whether
fp8fx's report in the warm process equals the cold one. Target: fp8fx warm <= 1.2x plain warm.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
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


def time_steps(model: torch.nn.Module, compiled, tokens: torch.Tensor, steps: int, profile: bool = True) -> tuple[float, float, float]:
    """(first step s, median step s, ms per step in Inductor's compiled kernels, 0 without
    `profile`). The last is the compiled graphs' own CPU time over 5 profiled steps: the GEMMs and
    attention they call are ops of their own in the profile, so it is the elementwise and reduction
    work, FP8's casts included, and far less noisy than a step's wall time."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        loss = compiled(tokens).logits.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    if not profile:
        return times[0], statistics.median(times[1:]), 0.0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    kernels = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("## Call CompiledFxGraph"))
    return times[0], statistics.median(times[1:]), kernels / 5 / 1000


def warm_up(inner: str) -> None:
    """Pay one-time costs (Inductor's C++ toolchain probe, first kernels) before timing anything."""
    lin = torch.nn.Linear(16, 16)
    torch.compile(lin, backend=PLAIN_BACKEND[inner])(torch.randn(4, 16)).sum().backward()
    torch._dynamo.reset()


def run(
    inner: str, base: torch.nn.Module, tokens: torch.Tensor, steps: int, fuse: bool = True, saved_outputs: str = "bf16"
) -> dict[str, tuple[float, float, float]]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    results = {}
    warm_up(inner)
    plain = copy.deepcopy(base)
    torch._dynamo.reset()
    results["plain"] = time_steps(plain, torch.compile(plain, backend=PLAIN_BACKEND[inner]), tokens, steps)
    ours = copy.deepcopy(base)
    torch._dynamo.reset()
    backend = fp8fx.backend(inner=inner, fuse_epilogues=fuse, saved_outputs=saved_outputs)
    results["fp8fx"] = time_steps(ours, torch.compile(ours, backend=backend), tokens, steps)
    ao = copy.deepcopy(base)
    convert_to_float8_training(ao, config=Float8LinearConfig(emulate=True))
    torch._dynamo.reset()
    results["torchao"] = time_steps(ao, torch.compile(ao, backend=PLAIN_BACKEND[inner]), tokens, steps)
    return results


def first_step_child(args) -> None:
    """One process, caches on: the first step of `args.child` ("plain" | "fp8fx") as JSON."""
    base = build_model(args)
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    warm_up("inductor")
    backend = fp8fx.backend(inner="inductor") if args.child == "fp8fx" else "inductor"
    first, _, _ = time_steps(base, torch.compile(base, backend=backend), tokens, 1, profile=False)
    report = fp8fx.report(backend).to_dict() if args.child == "fp8fx" else None
    print(json.dumps({"first": first, "report": report}, default=str))


def warm(args) -> None:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        shape = ["--layers", str(args.layers), "--dim", str(args.dim), "--seq", str(args.seq), "--batch", str(args.batch)]
        runs = {}
        for name in ("plain", "fp8fx"):
            for when in ("cold", "warm"):
                out = subprocess.run([sys.executable, __file__, "--child", name, *shape], env=env, capture_output=True, text=True, check=True)
                runs[name, when] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"Llama {args.layers} layers, dim {args.dim}, batch {args.batch} x seq {args.seq}; inner=inductor, caches on, a process per first step")
    for name in ("plain", "fp8fx"):
        print(f"  {name:6s} first step: cold {runs[name, 'cold']['first']:6.2f} s   warm {runs[name, 'warm']['first']:6.2f} s")
    ratio = runs["fp8fx", "warm"]["first"] / runs["plain", "warm"]["first"]
    print(f"  fp8fx warm / plain warm first step = {ratio:.2f}   (target <= 1.2)")
    same = runs["fp8fx", "warm"]["report"] == runs["fp8fx", "cold"]["report"]
    print(f"  fp8fx report of the warm process equals the cold one's: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inner", default="both", choices=["inductor", "eager", "both"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-fusion", action="store_true", help="keep fp8fx's FP8 GEMMs unfused (fuse_epilogues=False)")
    ap.add_argument(
        "--saved-outputs",
        default="bf16",
        choices=["bf16", "high"],
        help="fp8fx.backend's saved_outputs: bf16 copies of the GEMM outputs backward reads (the default), or the outputs as they are",
    )
    ap.add_argument("--warm", action="store_true", help="cold vs warm (cached) first step, each in its own process")
    ap.add_argument("--child", choices=["plain", "fp8fx"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return first_step_child(args)
    if args.warm:
        return warm(args)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    base = build_model(args)
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    print(f"Llama {args.layers} layers, dim {args.dim}, batch {args.batch} x seq {args.seq}, fp32 params, {torch.get_num_threads()} threads")
    for inner in ("eager", "inductor") if args.inner == "both" else (args.inner,):
        r = run(inner, base, tokens, args.steps, fuse=not args.no_fusion, saved_outputs=args.saved_outputs)
        print(f"\ninner={inner} (plain and torchao use backend={PLAIN_BACKEND[inner]!r})")
        for name, (first, step, kernels) in r.items():
            print(f"  {name:8s} first step {first:7.2f} s   step {1000 * step:8.1f} ms   in compiled kernels {kernels:6.1f} ms")
        over = {name: r[name][1] - r["plain"][1] for name in ("fp8fx", "torchao")}
        print(f"  fp8fx step / torchao emulate step = {r['fp8fx'][1] / r['torchao'][1]:.2f}")
        print(f"  step overhead over plain: fp8fx {1000 * over['fp8fx']:.1f} ms, torchao {1000 * over['torchao']:.1f} ms, "
              f"ratio {over['fp8fx'] / over['torchao']:.2f}   (target <= 1)")
        if inner == "inductor":
            extra = {name: r[name][2] - r["plain"][2] for name in ("fp8fx", "torchao")}
            print(
                f"  compiled-kernel time over plain: fp8fx {extra['fp8fx']:.1f} ms, torchao {extra['torchao']:.1f} ms, "
                f"ratio {extra['fp8fx'] / extra['torchao']:.2f}   (target <= 1)"
            )
        print(f"  fp8fx first step / plain first step = {r['fp8fx'][0] / r['plain'][0]:.2f}   (not cold)")


if __name__ == "__main__":
    main()
