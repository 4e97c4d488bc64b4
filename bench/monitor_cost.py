"""Cost of the runtime monitor: training-step time of a small `transformers` Llama with fp8fx,
monitor off vs on (sampling every 100, 10 and 1 calls), eager inner compiler, same run.

Run: python bench/monitor_cost.py [--layers 2 --dim 256 --seq 128 --batch 8 --steps 20]
Prints the median step time of each and its ratio to the monitor off.
"""

from __future__ import annotations

import argparse
import copy

import torch

import fp8fx
from train_step import build_model, time_steps


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
    medians = {}
    for every in (0, 100, 10, 1):
        model = copy.deepcopy(base)
        compiled = torch.compile(model, backend=fp8fx.backend(inner="eager", monitor_every=every))
        medians[every] = time_steps(model, compiled, tokens, args.steps)[1]
        torch._dynamo.reset()
    for every, median in medians.items():
        label = "monitor off" if every == 0 else f"monitor every {every}"
        print(f"{label:18s} step {1000 * median:7.1f} ms   x{median / medians[0]:.2f} of off")


if __name__ == "__main__":
    main()
