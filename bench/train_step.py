"""Training-step time and first-step compile time on CPU: fp8fx vs plain torch.compile vs
torchao's float8 emulate mode, each pair with the same inner compiler.

Run: python bench/train_step.py [--inner inductor|eager|both] [--layers 2 --dim 256 --seq 128 --batch 8]
Prints, per inner compiler, the first step (compile + run), the median step (the three variants'
steps interleaved, one of each per round, so the machine's slow spells fall on all of them), the
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


class Variant:
    """One model, its compiled forward and its optimizer: a training step to time."""

    def __init__(self, model: torch.nn.Module, compiled, tokens: torch.Tensor):
        self.compiled, self.tokens = compiled, tokens
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(self) -> float:
        start = time.perf_counter()
        loss = self.compiled(self.tokens).logits.float().pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - start

    def kernel_ms(self, steps: int = 5) -> float:
        """ms per step in Inductor's compiled kernels: the compiled graphs' own CPU time (the GEMMs
        and attention they call are ops of their own in the profile), so the elementwise and
        reduction work, FP8's casts included, and far less noisy than a step's wall time."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                self.step()
        own = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("## Call CompiledFxGraph"))
        return own / steps / 1000


def time_interleaved(variants: dict[str, Variant], rounds: int) -> dict[str, list[float]]:
    """Step times, one step of each variant per round: a slow spell of the machine falls on all of
    them alike, so per-round differences between variants hold where separate runs drift."""
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, variant in variants.items():
            times[name].append(variant.step())
    return times


def warm_up(inner: str) -> None:
    """Pay one-time costs (Inductor's C++ toolchain probe, first kernels) before timing anything."""
    lin = torch.nn.Linear(16, 16)
    torch.compile(lin, backend=PLAIN_BACKEND[inner])(torch.randn(4, 16)).sum().backward()
    torch._dynamo.reset()


def run(inner: str, base: torch.nn.Module, tokens: torch.Tensor, rounds: int, fuse: bool = True, saved_outputs: str = "bf16") -> dict:
    """Per variant (plain, fp8fx, torchao emulate): its first step (compile + run), its step times
    (interleaved with the others') and its ms per step in compiled kernels."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    warm_up(inner)
    plain, ours, ao = (copy.deepcopy(base) for _ in range(3))
    convert_to_float8_training(ao, config=Float8LinearConfig(emulate=True))
    backends = {"plain": (plain, PLAIN_BACKEND[inner]), "fp8fx": (ours, fp8fx.backend(inner=inner, fuse_epilogues=fuse, saved_outputs=saved_outputs)),
                "torchao": (ao, PLAIN_BACKEND[inner])}  # fmt: skip
    variants, first = {}, {}
    for name, (model, backend) in backends.items():
        variants[name] = Variant(model, torch.compile(model, backend=backend), tokens)
        first[name] = variants[name].step()
    times = time_interleaved(variants, rounds)
    kernels = {name: variant.kernel_ms() if inner == "inductor" else 0.0 for name, variant in variants.items()}
    return {"first": first, "times": times, "kernels": kernels}


def overhead(times: dict[str, list[float]], name: str) -> float:
    """Median over rounds of `name`'s step minus plain's step of the same round, in s."""
    return statistics.median(t - p for t, p in zip(times[name], times["plain"]))


def first_step_child(args) -> None:
    """One process, caches on: the first step of `args.child` ("plain" | "fp8fx") as JSON."""
    base = build_model(args)
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    warm_up("inductor")
    backend = fp8fx.backend(inner="inductor") if args.child == "fp8fx" else "inductor"
    first = Variant(base, torch.compile(base, backend=backend), tokens).step()
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
    ap.add_argument("--steps", type=int, default=15, help="timed steps per variant, interleaved: one of each per round")
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
        first, times, kernels = r["first"], r["times"], r["kernels"]
        print(f"\ninner={inner} (plain and torchao use backend={PLAIN_BACKEND[inner]!r}); {args.steps} steps each, interleaved")
        for name in times:
            print(f"  {name:8s} first step {first[name]:7.2f} s   median step {1000 * statistics.median(times[name]):8.1f} ms"
                  f"   in compiled kernels {kernels[name]:6.1f} ms")  # fmt: skip
        over = {name: overhead(times, name) for name in ("fp8fx", "torchao")}
        print(f"  fp8fx step / torchao emulate step = {statistics.median(times['fp8fx']) / statistics.median(times['torchao']):.2f}")
        print(f"  step overhead over plain (median of per-round differences): fp8fx {1000 * over['fp8fx']:.1f} ms, "
              f"torchao {1000 * over['torchao']:.1f} ms, ratio {over['fp8fx'] / over['torchao']:.2f}   (target <= 1)")
        if inner == "inductor":
            extra = {name: kernels[name] - kernels["plain"] for name in ("fp8fx", "torchao")}
            print(
                f"  compiled-kernel time over plain: fp8fx {extra['fp8fx']:.1f} ms, torchao {extra['torchao']:.1f} ms, "
                f"ratio {extra['fp8fx'] / extra['torchao']:.2f}   (target <= 1)"
            )
        print(f"  fp8fx first step / plain first step = {first['fp8fx'] / first['plain']:.2f}   (not cold)")

if __name__ == "__main__":
    main()
