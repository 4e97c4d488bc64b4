"""Predicted against measured training-step speedups: fp8fx's cost model on the GPU benchmarks' models.

    python bench/predict_steps.py [--targets h100,h200]

Builds bench/llama_gpu.py's models shape-only (the meta device: no weights) with the shapes they
were measured at, runs the analysis `fp8fx analyze --train` runs (`fp8fx.analyze(train=True)`,
default policy of each recipe) on the benchmark's step (forward with labels: the model's own
cross-entropy; backward; the AdamW step the report prices from the parameters), predicts the step
on each target (`Report.with_predictions`) and prints it beside the step times measured on GPUs
(`MEASURED`, from docs/results.md, section "On a GPU"). Takes under a minute on one CPU core.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn

import fp8fx

sys.path.insert(0, str(Path(__file__).parent))

from llama_gpu import MODELS, build_model  # noqa: E402

# Measured medians (ms) of bench/llama_gpu.py's steps: BF16 torch.compile and fp8fx's recipe from the
# same run (docs/results.md, "On a GPU"): (target, model, sequence, recipe, BF16 ms, FP8 ms, section).
# The first run's fp8fx steps (H200, 0.84x and 0.45x) were an implementation since replaced (its GEMM
# launchers copied their operands; cuBLAS wrote fp32 products): the model prices today's, so they are
# not here.
MEASURED = [
    ("h100", "llama3-8b", 4096, "tensorwise", 67.4, 55.5, "Fifth run"),
    ("h100", "llama3-8b", 4096, "rowwise", 67.4, 63.1, "Fifth run"),
    ("h100", "gpt3-6.7b", 2048, "tensorwise", 36.5, 31.8, "Fourth run"),
    ("h200", "llama3-8b", 4096, "tensorwise", 64.4, 51.4, "Third run, run A"),
    ("h200", "llama3-8b", 4096, "rowwise", 64.4, 58.0, "Third run, run A"),
]


class WithLoss(nn.Module):
    """The benchmark's forward: the causal LM with labels, returning its cross-entropy loss."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def shape_only(model: str, seq: int) -> tuple[nn.Module, tuple]:
    """bench/llama_gpu.py's `model` (bf16 weights, on the meta device) and its token batch."""
    args = types.SimpleNamespace(model=model, seed=0, dtype="bfloat16", **{**MODELS[model], "seq": seq})
    tokens = torch.zeros(args.batch, seq, dtype=torch.long, device="meta")
    return WithLoss(build_model(args, torch.device("meta"))), (tokens,)


def analysed(model: str, seq: int, recipe: str) -> fp8fx.Report:
    """The training-step report of a benchmark model under `recipe` (no target yet)."""
    module, inputs = shape_only(model, seq)
    return fp8fx.analyze(module, inputs, fp8fx.Policy.from_recipe(recipe), train=True)


def rows(targets: list[str]) -> list[dict]:
    """Each measured step with its prediction, for the rows whose target is in `targets`."""
    reports: dict[tuple, fp8fx.Report] = {}
    out = []
    for target, model, seq, recipe, bf16_ms, fp8_ms, section in MEASURED:
        if target not in targets:
            continue
        if (model, seq, recipe) not in reports:
            reports[model, seq, recipe] = analysed(model, seq, recipe)
        summary = reports[model, seq, recipe].with_predictions(target).summary()
        ms = {f"{part}_ms": value for part, value in summary["predicted_step_ms"].items()}  # bf16, fp8, gemm_bf16, ...
        out.append(dict(
            target=target, model=model, seq=seq, recipe=recipe, section=section, measured_bf16_ms=bf16_ms, measured_fp8_ms=fp8_ms,
            measured=bf16_ms / fp8_ms, predicted=summary["predicted_step_speedup"], slower_gemms=summary["slower_in_fp8"], **ms,
        ))  # fmt: skip
    return out


def markdown(found: list[dict]) -> str:
    lines = [
        "| target | model (seq) | recipe | measured BF16 / FP8 ms | measured | predicted BF16 / FP8 ms | predicted | predicted / measured | docs/results.md |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in found:
        lines.append(
            f"| {r['target']} | {r['model']} ({r['seq']}) | {r['recipe']} | {r['measured_bf16_ms']:.1f} / {r['measured_fp8_ms']:.1f} | "
            f"{r['measured']:.3f}x | {r['bf16_ms']:.1f} / {r['fp8_ms']:.1f} | {r['predicted']:.3f}x | {r['predicted'] / r['measured']:.3f} | {r['section']} |"
        )
    lines += ["", "Predicted step parts, ms (GEMMs BF16 -> FP8 with its casts; the rest is the same in both):", ""]
    lines += ["| target | model | recipe | GEMMs | attention | optimizer | other ops | FP8 GEMMs predicted slower |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in found:
        lines.append(
            f"| {r['target']} | {r['model']} | {r['recipe']} | {r['gemm_bf16_ms']:.1f} -> {r['gemm_fp8_ms']:.1f} | {r['attention_ms']:.1f} | "
            f"{r['optimizer_ms']:.1f} | {r['other_ms']:.1f} | {r['slower_gemms']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="h100,h200", help="comma-separated targets among the measured ones (h100, h200)")
    args = ap.parse_args()
    start = time.perf_counter()
    found = rows([t.strip() for t in args.targets.split(",") if t.strip()])
    print(markdown(found))
    worst = max(abs(r["predicted"] / r["measured"] - 1) for r in found)
    print(f"\nlargest error of the predicted speedup: {worst:.1%}; analysis took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
