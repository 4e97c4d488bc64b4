"""Build every generated kernel for sm_89, sm_90a and sm_100a on the CPU and print what it became.

For each variant (a covering set plus those fp8fx generates for a training step of a tiny Llama),
architecture and GEMM kernel family (pointer everywhere; the persistent TMA kernel on sm_90a and
sm_100a): the FP8 tensor-core instruction in the PTX, registers, spills (from ptxas), shared
memory against the limit, TMA loads (cp.async.bulk.tensor) and warp specialization. Then a summary
per architecture and family, and a line comparing the pointer and TMA kernels per architecture.
Exit code 1 if any kernel spills, overflows shared memory, misses its FP8 instruction, or (TMA)
misses TMA loads or the warp specialization its config asks for.

    python bench/kernel_build.py [--all-configs] [--workers 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))


def llama_variants() -> list:
    from helpers import tiny_llama

    import fp8fx
    from fp8fx.passes.annotation import annotation

    torch.manual_seed(0)
    backend = fp8fx.backend(inner="eager", keep_graphs=True)
    model = torch.compile(tiny_llama(), backend=backend)
    model(torch.randint(0, 256, (2, 16))).logits.sum().backward()
    return [annotation(n).fusion.variant for _, g in backend.kept_graphs for n in g.graph.nodes if n.target == torch.ops.fp8fx.fp8_gemm.default]


def problems(r) -> list[str]:
    """What is wrong with one build (empty if nothing)."""
    bad = []
    if r.spill_bytes:
        bad.append(f"{r.spill_bytes} B spilled")
    if r.shared_bytes > r.shared_limit:
        bad.append("shared memory over the limit")
    if r.family != "quantize" and not r.fp8_mma:
        bad.append("no FP8 MMA")
    if r.family == "tma" and not r.tma:
        bad.append("no TMA load")
    if r.warp_specialize_asked and not r.warp_specialized:
        bad.append("not warp-specialized")
    return bad


def summary(results) -> list[str]:
    """Per (arch, family): builds, spills, TMA / warp specialization present, registers and shared
    memory; then pointer against TMA per arch."""
    lines = []
    groups: dict[tuple[str, str], list] = {}
    for r in results:
        groups.setdefault((r.arch, r.family), []).append(r)
    for (arch, family), rs in sorted(groups.items()):
        regs = [r.registers for r in rs]
        smem = [r.shared_bytes / 1024 for r in rs]
        spilled = sum(1 for r in rs if r.spill_bytes)
        tma = sum(r.tma for r in rs)
        ws = sum(r.warp_specialized for r in rs)
        asked = sum(r.warp_specialize_asked for r in rs)
        lines.append(
            f"{arch:<7} {family:<8} {len(rs):>3} builds  {spilled} spilling  TMA in {tma}  warp-specialized {ws} (asked {asked})  "
            f"registers {min(regs)}-{max(regs)} (median {statistics.median(regs):.0f})  shared {min(smem):.0f}-{max(smem):.0f} KB"
        )
    for arch in sorted({a for a, _ in groups}):
        old, new = groups.get((arch, "pointer"), []), groups.get((arch, "tma"), [])
        if not old or not new:
            continue
        # Each variant's first build per family: its largest config.
        by_kernel_old = {r.kernel: r for r in reversed(old)}
        by_kernel_new = {r.kernel: r for r in reversed(new)}
        common = sorted(by_kernel_old.keys() & by_kernel_new.keys())
        if not common:
            continue

        def med(rs, f):
            return statistics.median(f(r) for r in rs)

        o = [by_kernel_old[k] for k in common]
        n = [by_kernel_new[k] for k in common]
        lines.append(
            f"{arch:<7} pointer vs tma, largest configs of {len(common)} variants: spilling {sum(1 for r in o if r.spill_bytes)} vs {sum(1 for r in n if r.spill_bytes)}, "
            f"median registers {med(o, lambda r: r.registers):.0f} vs {med(n, lambda r: r.registers):.0f}, "
            f"median shared {med(o, lambda r: r.shared_bytes) / 1024:.0f} vs {med(n, lambda r: r.shared_bytes) / 1024:.0f} KB, "
            f"TMA loads {sum(r.tma for r in o)} vs {sum(r.tma for r in n)}, warp-specialized {sum(r.warp_specialized for r in o)} vs {sum(r.warp_specialized for r in n)}"
        )
    return lines


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
    cwidth = max(len(r.config) for r in results)
    print(f"{'kernel':<{width}}  arch     family    {'config':<{cwidth}}  regs  spill  smem KB  TMA  WS  FP8 instruction")
    for r in results:
        smem = f"{r.shared_bytes / 1024:.0f}/{r.shared_limit // 1024}"
        ws = "yes" if r.warp_specialized else ("NO" if r.warp_specialize_asked else "-")
        print(
            f"{r.kernel:<{width}}  {r.arch:<7}  {r.family:<8}  {r.config:<{cwidth}}  {r.registers:>4}  {r.spill_bytes:>5}  {smem:>7}  "
            f"{'yes' if r.tma else '-':>3}  {ws:>3}  {r.fp8_mma or '-'}"
        )
    bad = [(r, problems(r)) for r in results if problems(r)]
    print()
    for line in summary(results):
        print(line)
    gemms = sum(1 for v in variants if hasattr(v, "epilogue"))
    archs = len({r.arch for r in results})
    print(
        f"{len(results)} builds of {len(variants)} variants ({gemms} GEMMs) x {archs} archs in {elapsed:.0f} s; "
        f"{len(bad)} spill, overflow, lack FP8 MMA / TMA or warp specialization asked for"
    )
    for r, why in bad:
        print(f"  {r.kernel} {r.arch} {r.family} {r.config}: {', '.join(why)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
