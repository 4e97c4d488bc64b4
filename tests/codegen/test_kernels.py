"""The generated kernels: correct under Triton's interpreter, and built for real GPUs on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import GatedBlock, compile_captured, tiny_llama

from fp8fx.codegen import versions
from fp8fx.codegen.targets import build_all, coverage_variants
from fp8fx.codegen.variants import GPU_TARGETS, configs_for
from fp8fx.passes.annotation import annotation

ROOT = Path(__file__).parents[2]


# The interpreter's test files in three groups, one process each, so that a parallel run (pytest -n)
# spreads them over its workers: a process costs seconds to start. test_op_layouts.py's Inductor steps
# take most of its group's time. Every file of the folder is in a group.
INTERPRETER_GROUPS: dict[str, list[str]] = {
    "gemm": ["test_kernels.py", "test_activations.py", "test_tma.py", "test_shapes.py", "test_split_k.py"],
    "families": ["test_mx.py", "test_nvfp4.py", "test_grouped.py", "test_grouped_op.py"],
    "layouts": ["test_op_layouts.py"],
}


def test_interpreter_groups_cover_the_folder():
    files = sorted(p.name for p in (ROOT / "tests" / "codegen" / "interpreter").glob("test_*.py"))
    grouped = [name for names in INTERPRETER_GROUPS.values() for name in names]
    assert sorted(grouped) == files  # each file once


@pytest.mark.parametrize("group", list(INTERPRETER_GROUPS))
def test_kernels_match_reference_under_the_interpreter(group):
    """tests/codegen/interpreter, in a process started with TRITON_INTERPRET=1 (it must precede the import)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    files = [str(ROOT / "tests" / "codegen" / "interpreter" / f) for f in INTERPRETER_GROUPS[group]]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:logging", "-p", "no:cacheprovider", "-p", "no:xdist", *files]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    # Skips only where this Triton lacks an interpreter feature (fp8fx.codegen.versions: NVFP4's
    # E4M3 scales before 3.9, tl.dot_scaled before 3.8).
    assert " passed" in run.stdout and ("skipped" not in run.stdout or versions.missing()), run.stdout[-2000:]


def model_variants() -> list:
    """The kernel variants fp8fx generates for a training step of GatedBlock and of a tiny Llama."""
    torch.manual_seed(0)
    variants = []
    for model, x in ((GatedBlock(), torch.randn(2, 16, 64, requires_grad=True)), (tiny_llama(), torch.randint(0, 256, (2, 16)))):
        cap = compile_captured(model)
        out = cap.compiled(x)
        (out if isinstance(out, torch.Tensor) else out.logits).float().sum().backward()
        variants += [annotation(n).fusion.variant for g in cap.forward + cap.backward for n in g.graph.nodes if n.target == torch.ops.fp8fx.fp8_gemm.default]
        torch._dynamo.reset()
    return variants


def test_every_generated_variant_builds_for_ada_hopper_and_blackwell():
    variants = list(dict.fromkeys(coverage_variants() + model_variants()))
    assert len(variants) >= 16
    results = build_all(variants, families=("pointer",))  # the TMA family: tests/codegen/test_kernel_build.py
    assert len(results) == 3 * len(variants)
    gemms = [r for r in results if r.kernel.startswith("fp8_gemm")]
    bad = [r for r in results if not r.ok or (r in gemms and r.fp8_mma is None)]
    assert not bad, "\n".join(map(str, bad))
    for r in gemms:  # the architecture's own FP8 tensor-core instruction
        expected = {"sm_89": "mma.sync", "sm_90a": "wgmma.mma_async", "sm_100a": "tcgen05.mma"}[r.arch]
        assert r.fp8_mma.startswith(expected), r


def test_every_tile_config_builds():
    variant = coverage_variants()[0]  # bias + gelu + aux + amax: the heaviest common epilogue
    results = build_all([variant], all_configs=True, families=("pointer",))
    assert len(results) == sum(len(configs_for(t, variant, "pointer")) for t in GPU_TARGETS)
    heavy = coverage_variants()[3]  # relu + residual + aux, blockwise: a product of tiles in registers
    results += build_all([heavy], all_configs=True, families=("pointer",))
    assert all(r.ok and r.fp8_mma for r in results), "\n".join(map(str, results))


def test_triton_kernels_on_cpu_need_the_interpreter():
    from fp8fx.codegen import launch

    a = torch.zeros(16, 32, dtype=torch.float8_e4m3fn)
    b = torch.zeros(16, 32, dtype=torch.float8_e4m3fn).t()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        launch.fp8_gemm(a, b, torch.tensor(1.0), torch.tensor(1.0))


def test_gemm_gpu_bench_says_it_needs_a_gpu():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gemm_gpu.py")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "no CUDA GPU" in run.stderr
