"""Host time of one generated FP8 GEMM call: fp8fx's launcher with its launch plan cached per call
signature, against the same launcher planning every call, measured in one run.

Run: TRITON_INTERPRET=1 python bench/launch_overhead.py [--calls 3000] [--json F]   (CPU)
     python bench/launch_overhead.py --device cuda                                   (GPU)
On the CPU (Triton's interpreter) the Triton launch itself is replaced by a no-op, so the figures
are fp8fx's own host work per call: checks, plan lookup, operand layout, TMA descriptors, output
allocation. On a GPU the launches are real and not synchronised: the time is what the host spends
enqueueing a 256 x 256 x 256 GEMM (too small to keep the GPU busy longer than that), beside
`torch._scaled_mm`'s for the same GEMM. Rows per kernel family ("tma": Hopper and Blackwell's
default, "pointer"); `through the op` calls `torch.ops.fp8fx.fp8_gemm`, as Inductor's code does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import fp8fx  # noqa: F401  (registers the fp8fx ops)
from fp8fx.codegen import launch
from fp8fx.ops.args import Fp8GemmArgs


def _operands(device: str, size: int):
    torch.manual_seed(0)
    a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=device).to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device=device)
    return a, b, one, one


def _per_call_us(fn, calls: int, sync) -> float:
    """Median over 5 rounds of the microseconds per call of `calls` calls."""
    rounds = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    return statistics.median(rounds)


class _NoLaunch:
    """Stands for a Triton autotuner on the CPU: the interpreter would run the kernel itself."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def measure(device: str, calls: int) -> dict:
    a, b, sa, sb = _operands(device, 256 if device == "cuda" else 64)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device != "cuda":
        if not launch.interpreter_active():
            raise SystemExit("on the CPU this needs TRITON_INTERPRET=1 (set before Python starts)")
        launch.autotuner = lambda *args, **kwargs: _NoLaunch()
    rows = {}
    for family in ("tma", "pointer"):

        def planned(family=family):
            launch.fp8_gemm(a, b, sa, sb, family=family)

        def replanned(family=family):
            launch.gemm_plan.cache_clear()
            launch.fp8_gemm(a, b, sa, sb, family=family)

        planned()  # autotune (GPU) and plan once
        rows[family] = {"planned_us": _per_call_us(planned, calls, sync), "replanned_us": _per_call_us(replanned, calls, sync)}
    if device == "cuda":  # the generated kernel as a graph runs it (default family), and cuBLAS's host path

        op_args, op_kwargs = Fp8GemmArgs(
            a, b, sa, sb, out_dtype=torch.bfloat16, aux_dtype=torch.bfloat16, gpu_kernel="triton"
        ).call_args()  # bound once: the loop times the op's call alone

        def through_op():
            torch.ops.fp8fx.fp8_gemm(*op_args, **op_kwargs)

        through_op()
        rows["through the op"] = {"planned_us": _per_call_us(through_op, calls, sync)}
        rows["torch._scaled_mm"] = {
            "planned_us": _per_call_us(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16), calls, sync)
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    rows = measure(args.device, args.calls)
    where = (
        torch.cuda.get_device_name() if args.device == "cuda" else "CPU, Triton's interpreter, Triton launch replaced by a no-op"
    )
    print(f"host microseconds per FP8 GEMM call ({where}; torch {torch.__version__})")
    print(f"{'':18s} {'planned':>9s} {'replanned':>10s} {'ratio':>6s}")
    for name, r in rows.items():
        replanned = r.get("replanned_us")
        tail = f" {replanned:10.1f} {r['planned_us'] / replanned:6.2f}" if replanned else ""
        print(f"{name:18s} {r['planned_us']:9.1f}{tail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
