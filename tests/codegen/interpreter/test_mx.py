"""MX GEMMs (E8M0 scales per 1 x 32 block along K, both operands) in the kernel family Blackwell
runs them with: block-scaled MMAs (`tl.dot_scaled`), run by Triton's interpreter through the same
launcher, against the CPU emulation (`fp8fx.ops.reference.fp8_gemm`, which promotes every 32 K)
and against operands quantized by torchao's `to_mx`.

Runs only with TRITON_INTERPRET=1 set before import (tests/codegen/test_kernels.py starts it that way)."""

from __future__ import annotations

import pytest
import torch
from helpers import sqnr
from test_kernels import E4M3, E5M2, close_as, wide_range

from fp8fx.codegen import launch, versions
from fp8fx.codegen.variants import GemmVariant, gemm_family
from fp8fx.core.epilogue import Epilogue
from fp8fx.core.scaling import amax_to_scale, block_amax
from fp8fx.ops import reference
from fp8fx.ops.args import Fp8GemmArgs

pytestmark = pytest.mark.skipif(not launch.interpreter_active(), reason="needs TRITON_INTERPRET=1 before import")

MX_A, MX_B = (1, 32), (32, 1)
# Triton's interpreter runs tl.dot_scaled from 3.8 on; before it MX GEMMs take the interpreter's
# default family (each 32-K block promoted in fp32, as on Hopper), checked here all the same.
MX_FAMILY = "mx" if versions.has("interpreter_dot_scaled") else "tma"


def mx_operand(shape, dtype, block, seed):
    """An MX operand as the graph makes it (rceil E8M0 scales), with values over 12 binades and one
    all-zero block (its scale inverse is 2**-127, subnormal in fp32)."""
    x = wide_range(shape, seed)
    if block == MX_A:
        x[1, 32:64] = 0.0
    else:
        x[32:64, 1] = 0.0
    scale = amax_to_scale(block_amax(x, block), torch.finfo(dtype).max, rounding="rceil")
    return reference.cast(x, scale, dtype, list(block)), scale.reciprocal()


# (M, N, K): partial 32-row / -column tiles; K a multiple of the interpreter's BLOCK_K = 64, K
# with a last half tile (160), and K ending inside an MX block (200: a partial block of 8).
CASES = [
    ((40, 72, 128), (E4M3, E4M3), Epilogue(), torch.float32),
    ((7, 33, 160), (E4M3, E4M3), Epilogue(bias=True, activation="gelu", aux="pre_activation"), torch.bfloat16),
    ((40, 16, 200), (E5M2, E4M3), Epilogue(residual=True, out_amax=True), torch.float32),
    ((33, 40, 96), (E4M3, E5M2), Epilogue(mul="gated", mul_activation="silu"), E4M3),
]


@pytest.mark.parametrize("shape,formats,epilogue,out_dtype", CASES, ids=lambda v: getattr(v, "spec", lambda: str(v))() or "plain")
def test_mx_gemm_on_block_scaled_mma_matches_emulation(shape, formats, epilogue, out_dtype):
    (m, n, k), seed = shape, sum(shape)
    a, sa = mx_operand((m, k), formats[0], MX_A, seed)
    b, sb = mx_operand((k, n), formats[1], MX_B, seed + 1)
    b = b.t().contiguous().t()
    assert (sa.min() == 2.0**-127) and (sb.min() == 2.0**-127)  # the zero blocks
    assert gemm_family("interpreter", GemmVariant(*formats, MX_A, MX_B, epilogue, out_dtype)) == MX_FAMILY
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if epilogue.bias else None
    other = torch.randn(m, n, generator=g) if epilogue.mul != "none" else None
    residual = torch.randn(m, n, generator=g).to(torch.bfloat16) if epilogue.residual else None
    out_scale = torch.tensor(3.0) if out_dtype == E4M3 else None
    out, aux, amax = launch.fp8_gemm(
        a, b, sa, sb, block_a=MX_A, block_b=MX_B, epilogue=epilogue, bias=bias, other=other, residual=residual,
        out_scale=out_scale, out_dtype=out_dtype, aux_dtype=torch.float32,
    )  # fmt: skip
    ref, ref_aux, ref_amax = reference.fp8_gemm(
        Fp8GemmArgs(
            a,
            b,
            sa,
            sb,
            bias=bias,
            other=other,
            residual=residual,
            out_scale=out_scale,
            out_dtype=out_dtype,
            aux_dtype=torch.float32,
            block_a=list(MX_A),
            block_b=list(MX_B),
            epilogue=epilogue.spec(),
            gpu_kernel="scaled_mm",
            fast_accum=False,
        )
    )
    close_as(out, ref)
    if aux is not None:
        close_as(aux, ref_aux)
    if amax is not None:
        torch.testing.assert_close(amax, ref_amax, rtol=1e-6, atol=0)


def test_mx_gemm_matches_torchao_quantized_operands():
    """Operands quantized by torchao (to_mx, RCEIL), their E8M0 scales passed as fp32: the kernel
    equals the fp32 product of torchao's dequantized operands up to summation order (measured
    SQNR 160 dB; 28 dB against the unquantized product)."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    rceil = mx.ScaleCalculationMode.RCEIL
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(48, 256, generator=g), torch.randn(40, 256, generator=g) * 1e-3  # w as a Linear's [N, K]

    def to_mx(t):  # blocks of 32 along the last dim (K)
        scale, data = mx.to_mx(t, E4M3, 32, scaling_mode=rceil)
        return data, scale.view(torch.float8_e8m0fnu).float()

    (xd, xs), (wd, ws) = to_mx(x), to_mx(w)
    out, _, _ = launch.fp8_gemm(xd, wd.t(), xs, ws.t(), block_a=MX_A, block_b=MX_B, out_dtype=torch.float32)
    dequantized = (xd.float() * xs.repeat_interleave(32, 1)) @ (wd.float() * ws.repeat_interleave(32, 1)).t()
    assert sqnr(out, dequantized) > 120
    assert sqnr(out, x @ w.t()) > 25  # and FP8's error against the unquantized product


def test_mx_family_takes_only_mx_blocks():
    a, sa = mx_operand((32, 64), E4M3, MX_A, 1)
    b, sb = mx_operand((64, 32), E4M3, MX_B, 2)
    with pytest.raises(ValueError, match=r"family mx runs MX blocks"):
        launch.fp8_gemm(a, b, sa.amax(), sb.amax(), family="mx")


def test_cuda_scaled_mm_path_runs_mx_in_the_generated_kernel():
    """fp8fx::scaled_mm's CUDA GEMM (and kernels="scaled_mm") has no torch._scaled_mm for MX's fp32
    scale inverses: it runs the generated kernel, here on CPU tensors under the interpreter."""
    from fp8fx.ops.cuda import scaled_mm_2d

    a, sa = mx_operand((24, 96), E4M3, MX_A, 5)
    b, sb = mx_operand((96, 40), E4M3, MX_B, 6)
    out = scaled_mm_2d(a, b, sa, sb, torch.float32, list(MX_A), list(MX_B))
    close_as(out, reference.scaled_mm(a, b, sa, sb, None, torch.float32, list(MX_A), list(MX_B)))


def test_mxfp8_training_step_runs_the_block_scaled_kernel(monkeypatch):
    """Recipe mxfp8, fwd + bwd with kernels="triton": all six GEMMs (output, grad_input and
    grad_weight of two Linears) launch the mx family, and the step equals the same step on the
    exact emulation (measured SQNR 158-178 dB: only fp32 summation order differs; 60 dB leaves room
    for one FP8 value rounded the other way where the next cast happens)."""
    from test_shapes import kernel_and_emulated_steps

    families = []
    planned = launch.gemm_plan

    def recorded(*args):  # the family each launch runs (its call signature's plan)
        plan = planned(*args)
        families.append(plan.family)
        return plan

    monkeypatch.setattr(launch, "gemm_plan", recorded)
    # A small Mlp(32, 64) on 40 tokens still has one- and two-block K (32, 64) and a partial block
    # (the tokens, grad_weight's K).
    results = kernel_and_emulated_steps("mxfp8", monkeypatch, d=32, hidden=64, batch=1)
    assert all(len(report.fp8_ops) == 6 for _, report in results)
    assert families == [MX_FAMILY] * 6
    (kernel_grads, _), (emulated_grads, _) = results
    for ours, ref in zip(kernel_grads, emulated_grads):
        assert sqnr(ours, ref) >= 60
