"""MX GEMMs built for Blackwell on the CPU: the block-scaled MMA (`tcgen05.mma ... mxf8f6f4.block_scale`)
in the PTX, no spills, shared memory within the limit; and which kernel family runs them where.
(tests/codegen/interpreter/test_mx.py runs the same kernel through the same launcher.)"""

from __future__ import annotations

import torch

from fp8fx.codegen import versions
from fp8fx.codegen.dispatch import choose_kernel
from fp8fx.codegen.targets import build_all
from fp8fx.codegen.variants import GemmVariant, configs_for, gemm_family
from fp8fx.core.epilogue import Epilogue

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MX_A, MX_B = (1, 32), (32, 1)
# Every output kind, both format pairs with an E5M2 side, and the heaviest epilogues.
MX_VARIANTS = [
    GemmVariant(E4M3, E4M3, MX_A, MX_B, Epilogue(), torch.bfloat16),
    GemmVariant(
        E4M3, E4M3, MX_A, MX_B, Epilogue(bias=True, activation="gelu", aux="pre_activation", out_amax=True), torch.bfloat16
    ),
    GemmVariant(E5M2, E4M3, MX_A, MX_B, Epilogue(mul="gated", mul_activation="silu", aux="pre_activation"), torch.float32),
    GemmVariant(E4M3, E5M2, MX_A, MX_B, Epilogue(bias=True, residual=True), E4M3),
]


def test_mx_gemms_build_with_block_scaled_mma_on_blackwell():
    results = build_all(MX_VARIANTS, archs=("sm_100a",), all_configs=True, families=("mx",), workers=1)
    assert (
        len(results) == sum(len(configs_for("sm_100a", v, "mx")) for v in MX_VARIANTS) > len(MX_VARIANTS)
    )  # both configs of the plain one
    for r in results:
        assert r.ok, r  # 0 spills, shared memory within the limit
        assert r.fp8_mma == "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32", r
        assert "block_k=" not in r.config and r.config.startswith("128x"), r  # whole 128-wide K tiles


def test_mx_gemms_take_block_scaled_mma_only_where_it_exists():
    """Blackwell (and the interpreter, from Triton 3.8 on) run MX blocks in the mx family; Hopper
    and Ada have no block-scaled MMA and promote each 32-K block in their default kernels; other
    blocks never go mx."""
    mx = MX_VARIANTS[0]
    interpreter = "mx" if versions.has("interpreter_dot_scaled") else "tma"
    assert [gemm_family(t, mx) for t in ("sm_100a", "interpreter", "sm_90a", "sm_89")] == ["mx", interpreter, "tma", "pointer"]
    blockwise = GemmVariant(E4M3, E4M3, (1, 128), (128, 128))
    assert gemm_family("sm_100a", blockwise) == "tma" and not blockwise.mx
    assert [c.block_k for c in configs_for("sm_100a", mx, "mx")] == [128, 128]
    assert {c.block_k for c in configs_for("sm_100a", mx, "tma")} == {32}  # promotion every MX block


def test_mx_gemms_are_reported_in_the_kernel_that_runs_them():
    """kernels="scaled_mm" cannot give an MX GEMM to torch._scaled_mm (it takes MX only as swizzled
    E8M0 scales): the generated kernel runs it, and the report says so."""
    kernel, reason, _ = choose_kernel("scaled_mm", MX_VARIANTS[0], (64, 64, 64))
    assert kernel == "triton" and "MX scale blocks" in reason and "kernels='scaled_mm'" in reason
    assert choose_kernel("auto", MX_VARIANTS[0], (64, 64, 64))[0] == "triton"
    assert choose_kernel("scaled_mm", GemmVariant(E4M3, E4M3, (1, 128), (128, 128)), (64, 64, 64))[0] == "scaled_mm"
