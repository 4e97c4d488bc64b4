"""Build every generated kernel for sm_89, sm_90a and sm_100a on the CPU and print what it became.

For each variant (a covering set plus those fp8fx generates for a training step of a tiny Llama)
and each architecture: the FP8 tensor-core instruction in the PTX, registers, spills (from ptxas)
and shared memory against the limit. Exit code 1 if any kernel spills, overflows shared memory or
misses its FP8 instruction.

    python bench/kernel_build.py [--all-configs] [--workers 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))


def llama_variants() -> list:
    import fp8fx
    from helpers import tiny_llama

    torch.manual_seed(0)
    backend = fp8fx.backend(inner="eager", keep_graphs=True)
    model = torch.compile(tiny_llama(), backend=backend)
    model(torch.randint(0, 256, (2, 16))).logits.sum().backward()
    return [n.meta["fp8fx"]["variant"] for _, g in backend.kept_graphs for n in g.graph.nodes if n.target == torch.ops.fp8fx.fp8_gemm.default]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-configs", action="store_true", help="every tile config, not only each arch's largest")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    from fp8fx.codegen.targets import build_all, coverage_variants

    variants = list(dict.fromkeys(coverage_variants() + llama_variants()))
    start = time.perf_counter()
    results = build_all(variants, all_configs=args.all_configs, workers=args.workers)
    elapsed = time.perf_counter() - start
    width = max(len(r.kernel) for r in results)
    print(f"{'kernel':<{width}}  arch     config              regs  spill  smem KB  FP8 instruction")
    for r in results:
        smem = f"{r.shared_bytes / 1024:.0f}/{r.shared_limit // 1024}"
        print(f"{r.kernel:<{width}}  {r.arch:<7}  {r.config:<18}  {r.registers:>4}  {r.spill_bytes:>5}  {smem:>7}  {r.fp8_mma or '-'}")
    bad = [r for r in results if not r.ok or (r.kernel.startswith("fp8_gemm") and not r.fp8_mma)]
    print(f"\n{len(results)} builds of {len(variants)} variants in {elapsed:.0f} s; {len(bad)} spill, overflow or lack FP8 MMA")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
