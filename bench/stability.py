"""Stability study: where FP8 training of a small, fragile character-level GPT diverges as the
learning rate grows, per recipe, against fp32 - and whether the shadow check saw it coming.

Every run has the same init and batches (pydoc topics, as bench/convergence.py), a constant learning
rate after a 10-step warmup and no gradient clipping, so that instability shows. Each FP8 run has
shadow checks on in observe-only mode (a tolerance, but a patience no run reaches, so nothing is
switched and the run is not changed). A run has diverged at the first step where the loss is not
finite, or where the mean loss of the last 20 steps is more than --blowup nats above the best such
mean so far. The shadow flag is the first check of any GEMM below --tolerance-db. When an FP8 run
diverged and fp32 did not, it is run again with the fallback on (patience 3), to show whether
switching the flagged GEMMs to high precision keeps it finite.

Run: python bench/stability.py [--lrs 1e-3,3e-3,1e-2,3e-2,1e-1 --steps 300]
Prints one row per recipe and learning rate; writes stability.csv (every step's loss) to --out-dir.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from convergence import GPT, batch, corpus

import fp8fx
from fp8fx.core.policy import Shadow

NEVER = 10**9  # a patience no run reaches: shadow checks observe, nothing is switched
WINDOW = 20


@dataclass
class Run:
    losses: list[float]
    diverged_at: int | None
    flagged_at: int | None = None  # first shadow check below the tolerance (training step)
    flagged_gemm: str = ""
    switched: int = 0  # GEMMs the fallback switched to high precision


def diverged_at(losses: list[float], blowup: float) -> int | None:
    best = math.inf
    for step, loss in enumerate(losses, 1):
        if not math.isfinite(loss):
            return step
        if step >= WINDOW:
            mean = statistics.fmean(losses[step - WINDOW : step])
            if mean > best + blowup:
                return step
            best = min(best, mean)
    return None


def train(recipe: str | None, lr: float, args, data, vocab: int, patience: int = NEVER) -> Run:
    torch.manual_seed(0)
    model = GPT(vocab, args.dim, args.heads, args.layers, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    backend = None
    run = model
    if recipe is not None:
        shadow = Shadow(every=args.shadow_every, tolerance_db=args.tolerance_db, patience=patience)
        policy = fp8fx.Policy.from_recipe(recipe, rules=(fp8fx.Rule(match="lm_head", precision="high"),))
        policy = dataclasses.replace(policy, shadow=shadow)
        if policy.uses_delayed_scaling:
            fp8fx.prepare(model)
        backend = fp8fx.backend(policy=policy, inner="eager")
        run = torch.compile(model, backend=backend)
    g = torch.Generator().manual_seed(0)
    losses: list[float] = []
    for _ in range(args.steps):
        x, y = batch(data, args, g)
        loss = F.cross_entropy(run(x).float().reshape(-1, vocab), y.reshape(-1))
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    torch._dynamo.reset()
    result = Run(losses, diverged_at(losses, args.blowup))
    if backend is not None:
        flags = [c for c in backend.shadow.checks if c.sqnr_db < args.tolerance_db]
        if flags:
            first = min(flags, key=lambda c: c.step)
            result.flagged_at = first.step + 1  # checks count calls from 0, steps from 1
            result.flagged_gemm = f"{first.site} {first.role} {first.sqnr_db:.1f} dB"
        result.switched = len(backend.shadow.switched)
    return result


def tail_loss(run: Run) -> float:
    return statistics.fmean(run.losses[-WINDOW:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--steps", 300), ("--layers", 2), ("--dim", 64), ("--heads", 2), ("--seq", 32), ("--batch", 8), ("--shadow-every", 5)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2,1e-1")
    ap.add_argument("--recipes", default=",".join(fp8fx.core.recipes.RECIPES))
    ap.add_argument("--tolerance-db", type=float, default=15.0)
    ap.add_argument("--blowup", type=float, default=0.5, help="nats above the best 20-step mean loss that count as diverged")
    ap.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    data, _val, vocab = corpus()
    lrs = [float(v) for v in args.lrs.split(",")]
    recipes = args.recipes.split(",")
    rows = []
    print(f"{'recipe':15s} {'lr':>7s} {'final loss':>10s} {'vs fp32':>8s} {'diverged':>9s} {'shadow flag':>11s}  first flag / fallback", flush=True)
    for lr in lrs:
        base = train(None, lr, args, data, vocab)
        rows += [("fp32", lr, i + 1, v) for i, v in enumerate(base.losses)]
        print(f"{'fp32':15s} {lr:7.0e} {tail_loss(base):10.4f} {'':>8s} {base.diverged_at or '-':>9} {'':>11s}", flush=True)
        for recipe in recipes:
            run = train(recipe, lr, args, data, vocab)
            rows += [(recipe, lr, i + 1, v) for i, v in enumerate(run.losses)]
            gap = 100 * (tail_loss(run) - tail_loss(base)) / tail_loss(base)
            note = run.flagged_gemm
            if run.diverged_at is not None:
                ahead = "before" if run.flagged_at is not None and run.flagged_at < run.diverged_at else "not before"
                note += f"; flagged {ahead} the loss diverged"
                if base.diverged_at is None:
                    again = train(recipe, lr, args, data, vocab, patience=3)
                    state = f"diverged at {again.diverged_at}" if again.diverged_at else f"finite, final {tail_loss(again):.4f}"
                    note += f"; with fallback ({again.switched} GEMMs switched): {state}"
            print(f"{recipe:15s} {lr:7.0e} {tail_loss(run):10.4f} {gap:+7.2f}% {run.diverged_at or '-':>9} {run.flagged_at or '-':>11}  {note}", flush=True)
    with (args.out_dir / "stability.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "lr", "step", "loss"])
        writer.writerows(rows)
    print(f"wrote {args.out_dir / 'stability.csv'}")


if __name__ == "__main__":
    main()
