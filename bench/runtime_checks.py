"""Cost of the runtime monitor and of shadow high-precision checks: training-step time of a small
`transformers` Llama with fp8fx, both off vs each on (every 100, 10 and 1 calls), eager inner
compiler, same run.

Run: python bench/runtime_checks.py [--layers 2 --dim 256 --seq 128 --batch 8 --steps 20]
Prints the median step time of each and its ratio to both off.
"""

from __future__ import annotations

import argparse
import copy

import torch
from train_step import build_model, time_steps

import fp8fx
from fp8fx.core.policy import Shadow


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    base = build_model(args)
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    variants = {"off": {}}
    for every in (100, 10, 1):
        variants[f"monitor every {every}"] = {"monitor_every": every}
        # a tolerance no GEMM misses: the checks run, nothing is switched
        variants[f"shadow every {every}"] = {"policy": fp8fx.Policy(shadow=Shadow(every=every, tolerance_db=-1e9, patience=1))}
    medians = {}
    for name, options in variants.items():
        model = copy.deepcopy(base)
        compiled = torch.compile(model, backend=fp8fx.backend(inner="eager", **options))
        medians[name] = time_steps(model, compiled, tokens, args.steps, profile=False)[1]
        torch._dynamo.reset()
    for name, median in medians.items():
        print(f"{name:18s} step {1000 * median:7.1f} ms   x{median / medians['off']:.2f} of off")


if __name__ == "__main__":
    main()
