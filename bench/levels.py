"""Precision levels: the convergence bench's character-level GPT trained on 2 gloo ranks (CPU) under
FSDP2 in fp32, with fp8fx, and at each MS-AMP level (O1, O2, O3), plus DDP at O2 - same init and
batches (each rank takes half of every batch); prints each run's final validation-loss gap to fp32.

Run: python bench/levels.py [--steps 1000 --layers 2 --dim 128 --heads 4 --seq 64 --batch 16]
Writes levels.csv (run, step, train_loss, val_loss) to --out-dir.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from convergence import GPT, batch, corpus

import fp8fx
from fp8fx.distributed import ddp_with_level, shard_with_level

WORLD = 2
POLICY = fp8fx.Policy.from_recipe("tensorwise", rules=(fp8fx.Rule(match="lm_head", precision="high"),))
RUNS = {"fp32": ("fsdp", False, None), "fp8fx": ("fsdp", True, None), "O1": ("fsdp", True, "O1"), "O2": ("fsdp", True, "O2"),
        "O3": ("fsdp", True, "O3"), "DDP O2": ("ddp", True, "O2")}  # fmt: skip


def train(name: str, rank: int, args, train_data, val_data, vocab: int) -> list[tuple]:
    from torch.distributed.fsdp import fully_shard

    engine, use_fp8fx, level = RUNS[name]
    torch.manual_seed(0)
    model = GPT(vocab, args.dim, args.heads, args.layers, args.seq)
    policy = dataclasses.replace(POLICY, level=level)
    if use_fp8fx:
        backend = fp8fx.backend(policy=policy, inner="eager")
        for block in model.blocks:
            block.compile(backend=backend)
    units = [*model.blocks, model.lm_head]
    if level is None:
        for module in [*units, model]:
            fully_shard(module)
        run, make_optimizer = model, torch.optim.AdamW
    elif engine == "fsdp":
        setup = shard_with_level(model, units, policy)
        run, make_optimizer = model, setup.optimizer
    else:
        run, setup = ddp_with_level(model, policy)
        make_optimizer = setup.optimizer
    opt = make_optimizer(model.parameters(), lr=1e-3, weight_decay=0.1)
    warmup = min(50, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, args.steps - warmup)))
    )
    g, val_g = torch.Generator().manual_seed(0), torch.Generator().manual_seed(10_000)
    val_batches = [batch(val_data, args, val_g) for _ in range(args.eval_batches)]
    mine = slice(rank * args.batch // WORLD, (rank + 1) * args.batch // WORLD)
    rows, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = batch(train_data, args, g)
        loss = F.cross_entropy(run(x[mine]).float().reshape(-1, vocab), y[mine].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if step % args.eval_every == 0 or step == args.steps:
            with torch.no_grad():
                val = statistics.fmean(F.cross_entropy(run(vx[mine]).float().reshape(-1, vocab), vy[mine].reshape(-1)).item() for vx, vy in val_batches)
            rows.append((name, rank, step, loss.item(), val, time.perf_counter() - start))
            if rank == 0:
                print(f"{name:8s} step {step:5d} train {loss.item():.4f} val {val:.4f}", flush=True)
    torch._dynamo.reset()
    return rows


def worker(rank: int, store: str, out: str, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    train_data, val_data, vocab = corpus()
    try:
        rows = [row for name in args.runs.split(",") for row in train(name, rank, args, train_data, val_data, vocab)]
        torch.save(rows, Path(out) / f"rows-{rank}.pt")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--steps", 1000), ("--layers", 2), ("--dim", 128), ("--heads", 4), ("--seq", 64), ("--batch", 16), ("--eval-every", 100), ("--eval-batches", 8)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of: " + ", ".join(RUNS))
    ap.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    unknown = set(args.runs.split(",")) - set(RUNS)
    if unknown:
        raise SystemExit(f"unknown run(s) {sorted(unknown)}; choose from {list(RUNS)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(str(Path(tmp) / "store"), tmp, args), nprocs=WORLD, join=True, start_method="spawn")
        ranks = [torch.load(Path(tmp) / f"rows-{r}.pt") for r in range(WORLD)]
    # each rank evaluated half of every validation batch: the loss of the whole batch is their mean
    merged = {}
    for rows in ranks:
        for name, _rank, step, train_loss, val, seconds in rows:
            merged.setdefault((name, step), []).append((train_loss, val, seconds))
    with (args.out_dir / "levels.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "step", "train_loss", "val_loss", "seconds"])
        for (name, step), values in merged.items():
            writer.writerow([name, step, *(f"{statistics.fmean(v[i] for v in values):.5f}" for i in range(3))])
    final = {name: statistics.fmean(v[1] for v in merged[(name, args.steps)]) for name in args.runs.split(",")}
    seconds = {name: max(v[2] for v in merged[(name, args.steps)]) for name in final}
    print(f"\nfinal validation loss after {args.steps} steps on {WORLD} ranks")
    print(f"{'run':8s} {'val loss':>9s} {'gap to fp32 %':>14s} {'s/step':>7s}")
    for name, val in final.items():
        gap = f"{100 * (val - final['fp32']) / final['fp32']:+14.3f}" if "fp32" in final else f"{'-':>14s}"
        print(f"{name:8s} {val:9.4f} {gap} {seconds[name] / args.steps:7.3f}")
    print(f"wrote {args.out_dir / 'levels.csv'}")


if __name__ == "__main__":
    main()
