"""Time of one optimizer step: fp8fx's Fp8AdamW (FP8 / FP16 moments, fused multi-tensor step) against
`torch.optim.AdamW` (fused=True on CUDA, foreach=True on the CPU), on the parameters of a
transformer-shaped model with many tensors, measured in one run.

Run: python bench/optim_step.py [--device cpu|cuda] [--tensors 200] [--width 256] [--steps 10] [--json F]
The model is `--tensors / 10` layers of width `--width`: two norm weights, q/k/v, o, up and down
projections (4x wide MLP) and four biases per layer, so mostly matrices with a tail of vectors, as
an LLM's parameter list is. On the CPU the run is a smoke test (memory-bound, two cores); on a GPU
the question is how close the fused FP8 step comes to torch's fused AdamW. It also prints the
states' bytes: the two moments take 3/8 of AdamW's fp32 moments (plus 8 bytes of scales per tensor).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fp8fx.runtime.optim import Fp8AdamW

_MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def model_shapes(tensors: int, width: int) -> list[tuple[int, ...]]:
    """Parameter shapes of `tensors // 10` transformer layers (10 tensors each)."""
    d, layer = width, []
    layer += [(d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return layer * max(1, tensors // len(layer))


def make_params(shapes, device: str, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(device=device, dtype=dtype)
    return params


def ms_per_step(opt: torch.optim.Optimizer, steps: int, sync) -> float:
    """Median over 3 rounds of the milliseconds per step of `steps` steps (after 2 warm-up steps)."""
    for _ in range(2):
        opt.step()
    rounds = []
    for _ in range(3):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            opt.step()
        sync()
        rounds.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(rounds)


def state_bytes(opt: torch.optim.Optimizer, keys) -> int:
    return sum(s[k].numel() * s[k].element_size() for s in opt.state.values() for k in keys)


def measure(device: str, tensors: int, width: int, steps: int, dtype: torch.dtype) -> dict:
    shapes = model_shapes(tensors, width)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    kind = {"fused": True} if device == "cuda" else {"foreach": True}
    ours = Fp8AdamW(make_params(shapes, device, dtype), lr=1e-4)
    torch_adamw = torch.optim.AdamW(make_params(shapes, device, dtype), lr=1e-4, **kind)
    row = {
        "device": device,
        "tensors": len(shapes),
        "params": sum(torch.Size(s).numel() for s in shapes),
        "torch_adamw": next(iter(kind)),
        "fp8_adamw_ms": ms_per_step(ours, steps, sync),
        "torch_adamw_ms": ms_per_step(torch_adamw, steps, sync),
        "fp8_moment_bytes": state_bytes(ours, _MOMENT_KEYS),
        "fp8_scale_bytes": state_bytes(ours, ("exp_avg_scale", "exp_avg_sq_scale")),
        "torch_moment_bytes": state_bytes(torch_adamw, _MOMENT_KEYS),
    }
    row["time_ratio"] = row["fp8_adamw_ms"] / row["torch_adamw_ms"]
    row["moment_bytes_ratio"] = row["fp8_moment_bytes"] / row["torch_moment_bytes"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args()
    row = measure(args.device, args.tensors, args.width, args.steps, getattr(torch, args.dtype))
    print(f"{row['tensors']} tensors, {row['params'] / 1e6:.2f}M {args.dtype} parameters on {args.device}")
    print(f"  Fp8AdamW step          {row['fp8_adamw_ms']:9.3f} ms")
    print(f"  AdamW({row['torch_adamw']}=True) step {row['torch_adamw_ms']:9.3f} ms")
    print(f"  ratio Fp8AdamW / AdamW {row['time_ratio']:9.2f}")
    print(
        f"  moment bytes: {row['fp8_moment_bytes']} vs {row['torch_moment_bytes']} = {row['moment_bytes_ratio']:.3f}"
        f" of AdamW's (3/8 = 0.375), plus {row['fp8_scale_bytes']} bytes of scales"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
