"""Noise the defaults add: how far fp8fx's default path and torchao's float8 emulation move a small
fp32 GPT's final validation loss from fp32's, per seed, and which part of fp8fx's default path
(BF16-kept GEMM outputs, Inductor's fusion, recomputed weight casts) adds movement.

The model and setting a new user would try: `bench/convergence.py`'s character-level GPT (3 layers,
width 192, 4 heads, LayerNorm, GELU MLP 4x, causal SDPA, learned positions, lm_head without bias)
on its corpus (Python's documentation topics, `pydoc_data.topics`, shipped with Python: no
download), 16 x 128 characters per step, AdamW lr 2e-3 without weight decay, constant learning
rate, no clipping, 300 steps. Validation loss: 64 held-out windows of 128 characters from the last
10% of the text (the same windows for every run and seed), evaluated after the last step by the
model as it trains (the compiled one, so FP8 runs evaluate in FP8) in 4 batches of 16. Every run of
a seed starts from the same initial weights and sees the same batches.

Runs:
    fp32             eager fp32 (the baseline)
    fp32-inductor    torch.compile(model): fp32 too, only rounding-level differences (a control:
                     how far a perturbation that small moves the final loss)
    fp8fx            torch.compile(model, backend="fp8fx"): the defaults
    fp8fx-high       fp8fx.backend(saved_outputs="high")
    fp8fx-keep       fp8fx.backend(weight_fp8="keep")
    fp8fx-eager      fp8fx.backend(inner="eager"): no Inductor fusion of the lowered casts
    fp8fx-eager-high fp8fx.backend(inner="eager", saved_outputs="high")
    torchao          convert_to_float8_training(Float8LinearConfig(emulate=True)) on every Linear,
                     lm_head included, under torch.compile(model) (Inductor)
    torchao-no-lm-head  the same with lm_head left in fp32, as fp8fx's default policy leaves it
                     here: its N, the corpus's 103 characters, is not a multiple of 16

    python bench/noise_study.py --runs fp32,fp8fx,torchao --seeds 8 --csv noise_a.csv
    python bench/noise_study.py --report bench/results/noise_a.csv bench/results/noise_b.csv

Prints per run: each seed's final validation loss and its difference from fp32's with the same
seed (%), the mean, sample standard deviation and mean magnitude of those differences, and each
run paired with fp8fx, torchao and torchao-no-lm-head (mean of the per-seed differences of the
differences and its standard error).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence import GPT, corpus  # (bench/ is not a package)

import fp8fx

RUNS = (
    "fp32",
    "fp32-inductor",
    "fp8fx",
    "fp8fx-high",
    "fp8fx-keep",
    "fp8fx-eager",
    "fp8fx-eager-high",
    "torchao",
    "torchao-no-lm-head",
)
LAYERS, DIM, HEADS, SEQ, BATCH, LR = 3, 192, 4, 128, 16, 2e-3
VAL_WINDOWS, VAL_BATCH = 64, 16


def prepare(name: str, model: torch.nn.Module) -> torch.nn.Module:
    """The model as run `name` trains it (torchao's conversion changes `model` in place)."""
    if name == "fp32":
        return model
    if name == "fp32-inductor":
        return torch.compile(model)
    if name in ("torchao", "torchao-no-lm-head"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        keep = {"lm_head"} if name == "torchao-no-lm-head" else set()
        convert_to_float8_training(
            model, config=Float8LinearConfig(emulate=True), module_filter_fn=lambda _module, fqn: fqn not in keep
        )
        return torch.compile(model)
    options = {
        "fp8fx": {},
        "fp8fx-high": {"saved_outputs": "high"},
        "fp8fx-keep": {"weight_fp8": "keep"},
        "fp8fx-eager": {"inner": "eager"},
        "fp8fx-eager-high": {"inner": "eager", "saved_outputs": "high"},
    }[name]
    return torch.compile(model, backend=fp8fx.backend(**options) if options else "fp8fx")


def windows(data: torch.Tensor, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - SEQ - 1, (count,), generator=generator)
    rows = torch.stack([data[s : s + SEQ + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def train(name: str, seed: int, steps: int, train_data, val_data, vocab: int) -> tuple[float, float, float]:
    """Final train loss, final validation loss and seconds of run `name` with `seed`."""
    torch.manual_seed(seed)
    model = GPT(vocab, DIM, HEADS, LAYERS, SEQ)
    run = prepare(name, model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    vx, vy = windows(val_data, VAL_WINDOWS, torch.Generator().manual_seed(10_000))
    start = time.perf_counter()
    for _ in range(steps):
        x, y = windows(train_data, BATCH, g)
        loss = F.cross_entropy(run(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        val = statistics.fmean(
            F.cross_entropy(run(vx[i : i + VAL_BATCH]).reshape(-1, vocab), vy[i : i + VAL_BATCH].reshape(-1)).item()
            for i in range(0, VAL_WINDOWS, VAL_BATCH)
        )
    seconds = time.perf_counter() - start
    torch._dynamo.reset()
    return loss.item(), val, seconds


PAIRED_WITH = ("fp8fx", "torchao", "torchao-no-lm-head")


def summarize(rows: list[dict]) -> str:
    """The table: per run, each seed's validation loss and % difference from fp32 with the same
    seed, their mean, sample std and mean magnitude, and the run paired with each run of
    `PAIRED_WITH` present (mean and standard error of the per-seed differences of the % differences,
    over the seeds both have)."""
    val = {(r["run"], int(r["seed"])): float(r["val_loss"]) for r in rows}
    runs = [r for r in RUNS if any(k[0] == r for k in val)]
    base = {s: v for (r, s), v in val.items() if r == "fp32"}
    rel = {k: 100 * (v - base[k[1]]) / base[k[1]] for k, v in val.items() if k[1] in base}
    pairs = [p for p in PAIRED_WITH if p in runs]
    lines = []
    if base:
        b = list(base.values())
        spread = 100 * statistics.stdev(b) / statistics.fmean(b) if len(b) > 1 else math.nan
        lines.append(f"fp32: {len(b)} seeds, mean {statistics.fmean(b):.4f}, seed-to-seed std {spread:.2f}% of the mean")
    lines.append(
        f"{'run':19s} {'n':>2s} {'mean diff %':>11s} {'std %':>6s} {'|diff| %':>8s} "
        + " ".join(f"{'vs ' + p + ' % (SE)':>31s}" for p in pairs)
        + "  per seed: val loss (diff %)"
    )

    def stats(values: list[float]) -> tuple[float, float]:
        return (statistics.fmean(values) if values else math.nan, statistics.stdev(values) if len(values) > 1 else math.nan)

    for run in runs:
        seeds = sorted(s for r, s in val if r == run)
        diffs = [rel[(run, s)] for s in seeds if (run, s) in rel]
        mean, std = stats(diffs)
        mean_abs = statistics.fmean(abs(d) for d in diffs) if diffs else math.nan
        columns = []
        for other in pairs:
            paired = [rel[(run, s)] - rel[(other, s)] for s in seeds if (run, s) in rel and (other, s) in rel]
            if other == run or len(paired) < 2:
                columns.append(f"{'-':>31s}")
            else:
                m, sd = stats(paired)
                columns.append(f"{f'{m:+.3f} ({sd / math.sqrt(len(paired)):.3f}, n={len(paired)})':>31s}")
        per_seed = "  ".join(
            f"{s}: {val[(run, s)]:.4f}" + (f" ({rel[(run, s)]:+.2f})" if run != "fp32" and (run, s) in rel else "") for s in seeds
        )
        lines.append(f"{run:19s} {len(seeds):2d} {mean:+11.3f} {std:6.3f} {mean_abs:8.3f} {' '.join(columns)}  {per_seed}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="fp32,fp8fx,torchao", help="comma-separated subset of: " + ", ".join(RUNS))
    ap.add_argument("--seeds", default="0-4", help="seeds: a range 0-4 or a list 0,3,7")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    ap.add_argument("--csv", default="noise_study.csv", help="this invocation's CSV in --out-dir (appended to)")
    ap.add_argument("--report", nargs="+", type=Path, help="train nothing: print the table of these CSVs")
    args = ap.parse_args()
    if args.report:
        rows = [row for path in args.report for row in csv.DictReader(path.open())]
        print(summarize(rows))
        return
    runs = args.runs.split(",")
    if set(runs) - set(RUNS):
        raise SystemExit(f"unknown run(s) {sorted(set(runs) - set(RUNS))}; choose from {', '.join(RUNS)}")
    first, _, last = args.seeds.partition("-")
    seeds = list(range(int(first), int(last) + 1)) if last else [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(args.threads)
    # A fresh Inductor cache per invocation (the seeds of one invocation share it: same graphs).
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="noise-study-inductor-"))
    train_data, val_data, vocab = corpus()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / args.csv
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["run", "seed", "steps", "train_loss", "val_loss", "seconds"])
        for seed in seeds:  # seed-major: a cut-short invocation leaves every run's first seeds
            for name in runs:
                train_loss, val, seconds = train(name, seed, args.steps, train_data, val_data, vocab)
                writer.writerow([name, seed, args.steps, f"{train_loss:.5f}", f"{val:.5f}", f"{seconds:.1f}"])
                f.flush()
                print(f"{name:17s} seed {seed} train {train_loss:.4f} val {val:.4f} ({seconds:.0f} s)", flush=True)
    rows = list(csv.DictReader(path.open()))
    print(summarize([r for r in rows if int(r["steps"]) == args.steps]))


if __name__ == "__main__":
    main()
