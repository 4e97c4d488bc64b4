"""Convergence: a character-level GPT trained on CPU in fp32, BF16 autocast, fp8fx under every named
recipe (lm_head high), and torchao's float8 emulate mode and MXFP8 emulation - same init and batches
per seed. `--experts E` makes every MLP a mixture of E experts (top 2) run as grouped GEMMs.

The defaults against torchao, both compiled by Inductor: `fp8fx-default` is exactly
`torch.compile(model, backend="fp8fx")` (default policy: tensorwise; lm_head, as wide as the
corpus's 103 characters, stays high: N is not a multiple of 16),
`fp8fx-default-high` the same with `saved_outputs="high"`, and `torchao-default` torchao's
`convert_to_float8_training` (emulate=True; the same recipe: dynamic tensorwise scales, E4M3
forward, E5M2 gradients) on every Linear, lm_head included (torchao takes N = 103), under
`torch.compile(model)`: not the same GEMMs in FP8.
`--autocast` runs every run's model under BF16 autocast; its baseline is then the `bf16` run:
    python bench/convergence.py --autocast --runs bf16,fp8fx-default,fp8fx-default-high,torchao-default

Options, as suffixes of a run's name (`split_run`): `-savedfp8` (fp8fx runs) sets the backend option
saved_activations="fp8" (what backward reads besides the FP8 GEMMs' operands kept in FP8 too), and a
last `-o2` trains with fp8fx.runtime.optim.Fp8AdamW (FP8 first moment, FP16 second: the optimizer of
a policy's `level: O2`) in place of torch's AdamW, on any run. Each option on and both together,
against BF16 (the target: final loss within 0.25% of BF16's):
    python bench/convergence.py --autocast --steps 1000 --seeds 3 \
        --runs bf16,fp8fx-rowwise,fp8fx-rowwise-savedfp8,fp8fx-rowwise-o2,fp8fx-rowwise-savedfp8-o2

Data: Python's own documentation topics (`pydoc_data.topics`), 90/10 train/validation split.
Target: every FP8 run's final validation loss within 0.25% of fp32's, over >= 1000 steps, with
fp32's seed-to-seed spread printed beside it (>= 3 seeds).

Run (4 layers, d=256: hours on 2 cores):
    python bench/convergence.py --steps 1000 --seeds 3
Quick check:
    python bench/convergence.py --steps 40 --eval-every 20 --seeds 1 --layers 2 --dim 64 --seq 32 --batch 8
Writes convergence.csv (run, seed, step, train_loss, val_loss, seconds) and convergence.png to
--out-dir. To use both cores, train subsets into separate CSVs with --runs/--csv and merge them:
    python bench/convergence.py --report a.csv b.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fp8fx
from fp8fx.runtime.optim import Fp8AdamW


def corpus() -> tuple[torch.Tensor, torch.Tensor, int]:
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    index = {c: i for i, c in enumerate(sorted(set(text)))}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    return data[:split], data[split:], len(index)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Experts(nn.Module):
    """Mixture-of-experts MLPs: each token's `top_k` experts' up and down projections run as grouped
    GEMMs over the tokens sorted by expert, as MoE models in `transformers` run them: in fp32
    through its `grouped_mm_fallback` op (`torch._grouped_mm` takes only bfloat16 under
    torch.compile)."""

    def __init__(self, dim: int, experts: int):
        super().__init__()
        import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)

        self.up = nn.Parameter(torch.randn(experts, dim, 4 * dim) / dim**0.5)
        self.down = nn.Parameter(torch.randn(experts, 4 * dim, dim) / (4 * dim) ** 0.5)

    def forward(self, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        top_k = chosen.shape[-1]
        order = chosen.reshape(-1).argsort(stable=True)  # (token, slot) pairs grouped by expert
        ends = torch.bincount(chosen.reshape(-1), minlength=self.up.shape[0]).cumsum(0).to(torch.int32)
        hidden = F.gelu(torch.ops.transformers.grouped_mm_fallback(tokens[order // top_k], self.up, ends))
        out = torch.ops.transformers.grouped_mm_fallback(hidden, self.down, ends) * weights.reshape(-1, 1)[order]
        return torch.zeros_like(tokens).index_add(0, order // top_k, out)


class MoEBlock(Block):
    """`Block` with a mixture of experts (a linear router, top 2) in place of its MLP."""

    def __init__(self, dim: int, heads: int, experts: int, top_k: int = 2):
        super().__init__(dim, heads)
        del self.up, self.down
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(dim, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        tokens = self.norm2(x).reshape(-1, d)
        weights, chosen = self.router(tokens).softmax(-1).topk(self.top_k, dim=-1)
        return x + self.experts(tokens, weights, chosen).reshape(b, t, d)


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int, experts: int = 0):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(MoEBlock(dim, heads, experts) if experts else Block(dim, heads) for _ in range(layers))
        self.norm, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def batch(data: torch.Tensor, args, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=generator)
    rows = torch.stack([data[s : s + args.seq + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def split_run(name: str) -> tuple[str, bool, bool]:
    """(a run's name without its options, -savedfp8, -o2): `name` is <run>[-savedfp8][-o2]."""
    stem = name.removesuffix("-o2")
    return stem.removesuffix("-savedfp8"), stem.endswith("-savedfp8"), stem != name


def prepare_run(name: str, model: nn.Module, autocast: bool = False):
    """The model as the run trains it, and the autocast context (BF16 only, or every run with
    `autocast`). -o2 is the optimizer's (`train`)."""
    stem, saved_fp8, _ = split_run(name)
    run, context = _prepare_run(stem, model, {"saved_activations": "fp8"} if saved_fp8 else {})
    return run, torch.autocast("cpu", dtype=torch.bfloat16) if autocast else context


def _prepare_run(name: str, model: nn.Module, options: dict):
    """`options`: fp8fx's backend options beyond the run's own."""
    if name == "bf16":
        return model, torch.autocast("cpu", dtype=torch.bfloat16)
    if name == "fp8fx-default":
        backend = fp8fx.backend(**options) if options else "fp8fx"  # (the name alone: exactly the one-line change)
        return torch.compile(model, backend=backend), torch.autocast("cpu", enabled=False)
    if name == "fp8fx-default-high":
        return torch.compile(model, backend=fp8fx.backend(saved_outputs="high", **options)), torch.autocast("cpu", enabled=False)
    if name == "torchao-default":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
        return torch.compile(model), torch.autocast("cpu", enabled=False)
    if name == "torchao-emulate":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model, config=Float8LinearConfig(emulate=True), module_filter_fn=lambda m, fqn: fqn != "lm_head"
        )
        return torch.compile(model, backend="aot_eager"), torch.autocast("cpu", enabled=False)
    if name == "torchao-mxfp8":
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
        from torchao.quantization import quantize_
        from torchao.quantization.quantize_.common import KernelPreference

        # torchao 0.18's MXFP8 linear drops F.linear's bias: each bias is added after the GEMM instead.
        for fqn, module in model.named_modules():
            if isinstance(module, nn.Linear) and fqn != "lm_head" and module.bias is not None:
                module.bias_after, module.bias = module.bias, None
                module.register_forward_hook(lambda m, _args, out: out + m.bias_after)
        config = MXFP8TrainingOpConfig(kernel_preference=KernelPreference.EMULATED, out_dtype=torch.float32)
        if any(isinstance(m, Experts) for m in model.modules()):
            # Measured with torchao 0.18: its emulated MXFP8 grouped GEMM asserts in to_mx ("unsupported":
            # a non-contiguous operand of its own making), eager and compiled.
            raise SystemExit(
                "torchao-mxfp8 does not run with --experts on CPU: torchao's emulated MXFP8 grouped GEMM fails in to_mx"
            )
        quantize_(
            model,
            config,
            filter_fn=lambda m, fqn: fqn != "lm_head" and not fqn.endswith("router") and isinstance(m, (nn.Linear, Experts)),
        )
        return torch.compile(model, backend="aot_eager"), torch.autocast("cpu", enabled=False)
    if name.startswith("fp8fx-"):
        recipe = name.removeprefix("fp8fx-")
        policy = fp8fx.Policy.from_recipe(recipe, rules=(fp8fx.Rule(match="lm_head", precision="high"),))
        if policy.uses_delayed_scaling:
            fp8fx.prepare(model)
        backend = fp8fx.backend(policy=policy, inner="eager", **options)
        return torch.compile(model, backend=backend), torch.autocast("cpu", enabled=False)
    return model, torch.autocast("cpu", enabled=False)


def train(name: str, seed: int, args, train_data, val_data, vocab: int, writer) -> None:
    torch.manual_seed(seed)
    model = GPT(vocab, args.dim, args.heads, args.layers, args.seq, args.experts)
    run, autocast = prepare_run(name, model, args.autocast)  # first: torchao's MXFP8 conversion makes new Parameters
    opt = (Fp8AdamW if split_run(name)[2] else torch.optim.AdamW)(model.parameters(), lr=1e-3, weight_decay=0.1)
    warmup = min(50, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            (s + 1) / warmup if s < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, args.steps - warmup)))
        ),
    )
    g = torch.Generator().manual_seed(seed)
    val_g = torch.Generator().manual_seed(10_000)
    val_batches = [batch(val_data, args, val_g) for _ in range(args.eval_batches)]
    start, val = time.perf_counter(), float("nan")
    for step in range(1, args.steps + 1):
        x, y = batch(train_data, args, g)
        with autocast:
            loss = F.cross_entropy(run(x).float().reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        if step % args.eval_every == 0 or step == args.steps:
            with torch.no_grad(), autocast:
                val = statistics.fmean(
                    F.cross_entropy(run(vx).float().reshape(-1, vocab), vy.reshape(-1)).item() for vx, vy in val_batches
                )
            writer.writerow([name, seed, step, f"{loss.item():.5f}", f"{val:.5f}", f"{time.perf_counter() - start:.1f}"])
            print(f"{name:26s} seed {seed} step {step:5d} train {loss.item():.4f} val {val:.4f}", flush=True)
    torch._dynamo.reset()


def baseline_of(rows: list[list], baseline: str | None = None) -> str:
    """The run the gaps are measured against: `baseline`, else fp32 where the rows have it, else bf16."""
    return baseline or ("fp32" if any(row[0] == "fp32" for row in rows) else "bf16")


def plot(rows: list[list], out: Path, baseline: str = "fp32") -> bool:
    """Writes the plot to `out`; False (no plot) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, dict[int, list[float]]] = {}
    for name, _seed, step, _train, val, _seconds in rows:
        curves.setdefault(name, {}).setdefault(int(step), []).append(float(val))
    fig, (ax, gap_ax) = plt.subplots(1, 2, figsize=(13, 5))
    base = {s: statistics.fmean(v) for s, v in curves.get(baseline, {}).items()}
    for i, (name, by_step) in enumerate(curves.items()):
        steps = sorted(by_step)
        means = [statistics.fmean(by_step[s]) for s in steps]
        color = f"C{i % 10}"  # one colour per run in both plots
        ax.plot(steps, means, label=name, color=color)
        if base and name != baseline:
            gap_ax.plot(
                steps, [100 * (m - base[s]) / base[s] for s, m in zip(steps, means) if s in base], label=name, color=color
            )
    ax.set(xlabel="step", ylabel="validation loss (mean over seeds)", title="Character-level GPT on pydoc topics")
    gap_ax.axhspan(-0.25, 0.25, color="#2ca02c", alpha=0.15, label="target: within 0.25%")
    gap_ax.set(xlabel="step", ylabel=f"validation loss gap to {baseline} (%)", title=f"Gap to {baseline}")
    ax.legend(fontsize=8)
    gap_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return True


def summarize(rows: list[list], baseline: str = "fp32") -> None:
    """Final validation loss per run and seed, the gap to `baseline` with the same seed, each run's
    seed-to-seed spread (std of its final loss over seeds, % of its mean), and s/step."""
    last: dict[tuple[str, int], tuple[int, float, float]] = {}
    for name, seed, step, _train, val, seconds in rows:
        key = (name, int(seed))
        if key not in last or int(step) > last[key][0]:
            last[key] = (int(step), float(val), float(seconds))
    runs = list(dict.fromkeys(name for name, _seed in last))
    base = {seed: val for (name, seed), (_s, val, _t) in last.items() if name == baseline}
    steps = {s for s, _v, _t in last.values()}
    if len(steps) != 1:
        raise SystemExit(f"runs stopped at different steps {sorted(steps)}: not comparable")
    (steps,) = steps
    noise = 100 * statistics.pstdev(base.values()) / statistics.fmean(base.values()) if base else float("nan")
    print(f"\nfinal validation loss after {steps} steps, {len(base)} seed(s); {baseline} seed-to-seed spread (std) {noise:.3f}%")
    print(f"{'run':26s} {'val loss':>9s} {'gap %':>8s} {'min..max %':>16s} {'std %':>7s} {'s/step':>7s}  target |gap| <= 0.25%")
    for name in runs:
        mine = {seed: v for (n, seed), v in last.items() if n == name}
        gaps = [100 * (val - base[seed]) / base[seed] for seed, (_s, val, _t) in mine.items() if seed in base]
        mean_gap = statistics.fmean(gaps) if gaps else float("nan")
        verdict = "" if name == baseline or not gaps else ("PASS" if abs(mean_gap) <= 0.25 else "FAIL")
        spread = f"{min(gaps):+.3f}..{max(gaps):+.3f}" if gaps else "-"
        per_step = statistics.fmean(t for _s, _v, t in mine.values()) / steps
        vals = [v for _s, v, _t in mine.values()]
        std = 100 * statistics.pstdev(vals) / statistics.fmean(vals)
        print(f"{name:26s} {statistics.fmean(vals):9.4f} {mean_gap:+8.3f} {spread:>16s} {std:7.3f} {per_step:7.3f}  {verdict}")


def read_rows(paths: list[Path]) -> list[list]:
    rows = []
    for path in paths:
        with path.open() as f:
            rows += list(csv.reader(f))[1:]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (
        ("--steps", 1000),
        ("--seeds", 3),
        ("--layers", 4),
        ("--dim", 256),
        ("--heads", 4),
        ("--seq", 128),
        ("--batch", 32),
        ("--eval-every", 100),
        ("--eval-batches", 8),
    ):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument(
        "--experts", type=int, default=0, help="mixture-of-experts MLPs with this many experts (top 2), as grouped GEMMs"
    )
    runs = ["fp32", "bf16", *(f"fp8fx-{r}" for r in fp8fx.core.recipes.RECIPES), "torchao-emulate", "torchao-mxfp8"]
    runs += ["fp8fx-default", "fp8fx-default-high", "torchao-default"]
    options = " (fp8fx's may end in -savedfp8, then any in -o2: the module's docstring)"
    ap.add_argument("--runs", default=",".join(runs), help="comma-separated subset of: " + ", ".join(runs) + options)
    ap.add_argument(
        "--autocast", action="store_true", help="every run's model under BF16 autocast (baseline: the bf16 run; no fp32 run)"
    )
    ap.add_argument("--baseline", help="the run gaps are measured against (default: fp32 if present, else bf16)")
    ap.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    ap.add_argument("--csv", default="convergence.csv", help="file name of this invocation's CSV in --out-dir")
    ap.add_argument("--png", default="convergence.png", help="file name of the plot in --out-dir")
    ap.add_argument("--report", nargs="+", type=Path, help="train nothing: merge these CSVs, plot and print the table")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if not args.report:
        names = args.runs.split(",")
        unknown = [n for n in names if split_run(n)[0] not in runs or (split_run(n)[1] and not n.startswith("fp8fx-"))]
        if unknown:
            raise SystemExit(f"unknown run(s) {unknown}; choose from {runs}, fp8fx's with -savedfp8, any with -o2 last")
        if args.autocast and "fp32" in (split_run(n)[0] for n in names):
            raise SystemExit("--autocast runs every model under BF16 autocast: its baseline is the bf16 run, not fp32")
        # A fresh Inductor cache per invocation: no compiled graph or record from another process or
        # an older checkout; the seeds of one invocation share it (same graphs, same keys).
        import os
        import tempfile

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="convergence-inductor-"))
        train_data, val_data, vocab = corpus()
        with (args.out_dir / args.csv).open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["run", "seed", "step", "train_loss", "val_loss", "seconds"])
            for name in args.runs.split(","):
                for seed in range(args.seeds):
                    train(name, seed, args, train_data, val_data, vocab, writer)
                    f.flush()
    rows = read_rows(args.report or [args.out_dir / args.csv])
    baseline = baseline_of(rows, args.baseline)
    plotted = plot(rows, args.out_dir / args.png, baseline)
    summarize(rows, baseline)
    print(f"wrote {args.out_dir / args.png}" if plotted else "no plot: matplotlib is not installed")


if __name__ == "__main__":
    main()
