"""CPU training-step time of the 2-block transformer under every named recipe, relative to fp32
eager and to torchao's float8 emulate mode, all measured in this run.

Run: python bench/recipes.py [--dim 256 --seq 128 --batch 8 --steps 5]
fp8fx runs with inner="eager" and torchao eagerly, so both pay for FP8 emulation op by op.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F

import fp8fx
from fp8fx.core.recipes import RECIPES
from fp8fx.tools.demo import TinyTransformer

TORCHAO_RECIPE = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}


def step_time(model: torch.nn.Module, run, tokens: torch.Tensor, steps: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for _ in range(steps + 1):  # the first step compiles
        start = time.perf_counter()
        loss = F.cross_entropy(run(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    base = TinyTransformer(dim=args.dim, heads=args.dim // 64, layers=2, max_seq=args.seq)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1))
    fp32 = step_time(base, base, tokens, args.steps)
    print(f"2-block transformer, dim {args.dim}, batch {args.batch} x seq {args.seq}, {torch.get_num_threads()} threads")
    print(f"{'run':34s} {'step ms':>8s} {'/ fp32':>7s} {'/ torchao':>9s}")
    print(f"{'fp32 eager':34s} {1000 * fp32:8.1f} {1.0:7.2f}")
    torchao_times = {}
    for recipe, ao_name in TORCHAO_RECIPE.items():
        model = copy.deepcopy(base)
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(ao_name), emulate=True)
        convert_to_float8_training(model, config=config)
        torchao_times[recipe] = t = step_time(model, model, tokens, args.steps)
        print(f"{'torchao emulate ' + ao_name:34s} {1000 * t:8.1f} {t / fp32:7.2f}")
    for recipe in RECIPES:
        torch._dynamo.reset()
        model = fp8fx.prepare(copy.deepcopy(base))
        compiled = torch.compile(model, backend=fp8fx.backend(fp8fx.Policy.from_recipe(recipe), inner="eager"))
        t = step_time(model, compiled, tokens, args.steps)
        ao = torchao_times.get(recipe)
        vs_ao = f"{t / ao:9.2f}" if ao else f"{'-':>9s}"
        print(f"{'fp8fx ' + recipe:34s} {1000 * t:8.1f} {t / fp32:7.2f} {vs_ao}")


if __name__ == "__main__":
    main()
