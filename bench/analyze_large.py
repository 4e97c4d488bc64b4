"""Analyse Llama-shaped models on the meta device: time and peak memory of `fp8fx.analyze`.

    python bench/analyze_large.py [--model 70b|7b|8b] [--train] [--no-fold] [--target h100]

Llama-3-70B: 80 layers, hidden 8192, MLP 28672, 64 heads / 8 KV heads, vocab 128256, sequence
2048. Nothing is allocated for the weights; repeated layers are traced once (--no-fold traces all).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

import fp8fx

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))  # the model builders the tests use

SHAPES = {  # layers, hidden, intermediate, heads, kv heads, vocab
    "70b": (80, 8192, 28672, 64, 8, 128256),
    "8b": (32, 4096, 14336, 32, 8, 128256),
    "7b": (32, 4096, 11008, 32, 32, 32000),
}


def build(name: str):
    from helpers import meta_llama

    return meta_llama(*SHAPES[name])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="70b", choices=list(SHAPES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--no-fold", action="store_true")
    ap.add_argument("--target", default="h100", help="GPU the cost model predicts for (fp8fx.reporting.costmodel)")
    args = ap.parse_args()
    start = time.perf_counter()
    model = build(args.model)
    ids = torch.zeros(1, args.seq, dtype=torch.long, device="meta")
    report = fp8fx.analyze(model, (ids,), train=args.train, fold_repeated=not args.no_fold).with_predictions(args.target)
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    s = report.summary()
    print(f"Llama-{args.model} ({'train' if args.train else 'inference'}, seq {args.seq}): {s['gemms']} GEMMs, {s['fp8_gemms']} in FP8, "
          f"FP8 FLOP share {100 * s['fp8_flop_share_forward']:.1f}% forward")
    print(f"analysis took {elapsed:.1f} s, peak memory {peak:.0f} MiB, folded: {s['folded_blocks'] or 'nothing'}")
    print(f"predicted on {s['target']}: step {s['predicted_step_speedup']:.2f}x, GEMMs {s['predicted_gemm_speedup']:.2f}x, {s['slower_in_fp8']} FP8 GEMMs slower than BF16")
    if s["saved_for_backward_bytes"] is not None:
        high = s["saved_for_backward_bytes"] + s["fp8_saved_activation_bytes"]
        print(f"saved for backward: {s['saved_for_backward_bytes'] / 2**30:.1f} GiB ({high / 2**30:.1f} GiB with every GEMM high)")


if __name__ == "__main__":
    main()
