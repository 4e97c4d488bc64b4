"""The grouped FP8 GEMM (mixture-of-experts), run by Triton's interpreter through the launcher a GPU
uses, against each group's dequantized product in fp32 computed here group by group.

Groups are uneven and some empty, offsets are not multiples of the interpreter's 32-wide tiles,
and the 2D-2D K-slices start and end inside BLOCK_K windows, fill one window partly, or span whole
windows between partial ones. The interpreter runs 3 persistent programs, so each walks many tiles
across groups. Runs only with TRITON_INTERPRET=1 set before import (tests/codegen/test_kernels.py
starts it that way)."""

from __future__ import annotations

import pytest
import torch
from helpers import sqnr
from test_kernels import E4M3, E5M2, fp8_operand

from fp8fx.codegen import launch

pytestmark = pytest.mark.skipif(not launch.interpreter_active(), reason="needs TRITON_INTERPRET=1 before import")

# The kernel sums K in 32-wide tiles, the reference in one fp32 matmul per group. Measured over
# the cases below: fp32 output SQNR 133.6-139.2 dB, largest error 3.5e-7 of the largest output;
# bf16 output 48.8-50.1 dB (its rounding), within one bf16 ulp of the fp32 reference.
MIN_SQNR = {torch.float32: 125.0, torch.bfloat16: 45.0}
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8}
ATOL = {torch.float32: 2e-6, torch.bfloat16: 2**-8}  # of the largest output magnitude


def bounds(offs: list[int]) -> list[tuple[int, int]]:
    return list(zip([0, *offs[:-1]], offs))


def reference_2d3d(a, b, scale_a, scale_b, offs):
    """out[rows of g] = (a[rows] * scale_a) @ (b[g] * scale_b[g]), scales per row / column or per group."""
    out = torch.zeros(a.shape[0], b.shape[-1])
    groups = len(offs)
    for g, (s, e) in enumerate(bounds(offs)):
        sa = scale_a[g] if scale_a.shape == (groups,) and scale_b.dim() == 1 else scale_a[s:e, None]
        sb = scale_b[g]
        out[s:e] = (a[s:e].float() * sa) @ (b[g].float() * sb)
    return out


def reference_2d2d(a, b, scale_a, scale_b, offs):
    """out[g] = (a[:, ks] * scale_a[g]) @ (b[ks] * scale_b[g]), scales per row / column or per group."""
    return torch.stack([
        (a[:, s:e].float() * scale_a[g].reshape(-1, 1)) @ (b[s:e].float() * scale_b[g].reshape(1, -1))
        for g, (s, e) in enumerate(bounds(offs))
    ])  # fmt: skip


def assert_close(out, ref):
    assert sqnr(out.float(), ref) >= MIN_SQNR[out.dtype]
    torch.testing.assert_close(out.float(), ref, rtol=RTOL[out.dtype], atol=ATOL[out.dtype] * ref.abs().max().item())


def operands_2d3d(m, k, n, groups, seed, formats=(E4M3, E4M3)):
    a, _ = fp8_operand((m, k), formats[0], (), seed)
    b = torch.stack([fp8_operand((k, n), formats[1], (), seed + 1 + g)[0] for g in range(groups)])
    g = torch.Generator().manual_seed(seed)
    return a, b, g


# (M_total, K, N, offsets): empty first, middle and last groups, a group of one row, offsets off
# the 32-row tiles, rows past the last group (zero), K and N not multiples of 32, an [M] scale
# with as many rows as groups.
CASES_2D3D = [
    (70, 48, 40, [0, 7, 7, 40, 70]),
    (64, 96, 72, [1, 33, 33, 64]),
    (45, 40, 16, [20, 30, 30]),
    (4, 32, 24, [1, 1, 3, 4]),
]


@pytest.mark.parametrize("m,k,n,offs", CASES_2D3D)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_2d3d_rowwise_matches_per_group_products(m, k, n, offs, out_dtype):
    groups = len(offs)
    a, b, g = operands_2d3d(m, k, n, groups, seed=m + k)
    scale_a = torch.rand(m, generator=g) + 0.5
    scale_b = torch.rand(groups, n, generator=g) + 0.5
    b = b.transpose(1, 2).contiguous().transpose(1, 2)  # column-major experts, as torch._scaled_grouped_mm takes them
    out = launch.grouped_fp8_gemm(a, b, scale_a, scale_b, torch.tensor(offs, dtype=torch.int32), out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert_close(out, reference_2d3d(a, b, scale_a, scale_b, offs))


@pytest.mark.parametrize("formats", [(E4M3, E4M3), (E5M2, E4M3)])
def test_2d3d_tensorwise_per_group_and_any_layout(formats):
    """One scale per group on both sides; row-major experts and a sliced activation are copied."""
    m, k, n, offs = 50, 80, 36, [13, 13, 50]
    a, b, g = operands_2d3d(m, k, n, len(offs), seed=3, formats=formats)
    wide = torch.zeros(m, k + 5, dtype=a.dtype)
    wide[:, 5:] = a
    a = wide[:, 5:]
    scale_a, scale_b = torch.rand(3, generator=g) + 0.5, torch.rand(3, generator=g) + 0.5
    out = launch.grouped_fp8_gemm(a, b, scale_a, scale_b, torch.tensor(offs, dtype=torch.int32), torch.float32)
    assert_close(out, reference_2d3d(a, b, scale_a, scale_b, offs))


# (M, N, K_total, offsets along K) against BLOCK_K = 32: a slice inside one window (5..20), one
# starting on a window (32..40), one spanning whole windows between partial ones (40..140), empty
# slices first, between and last, and K_total past the last whole window.
CASES_2D2D = [
    (40, 24, 150, [0, 5, 20, 32, 40, 140, 140, 150]),
    (33, 48, 64, [64, 64]),
    (16, 16, 90, [17, 90, 90]),
]


@pytest.mark.parametrize("m,n,k,offs", CASES_2D2D)
@pytest.mark.parametrize("scales", ["rowwise", "per_group", "flat"])
def test_2d2d_weight_gradient_matches_per_group_products(m, n, k, offs, scales):
    groups = len(offs)
    a, _ = fp8_operand((m, k), E4M3, (), seed=k)
    b, _ = fp8_operand((k, n), E4M3, (), seed=k + 1, column_major=True)
    g = torch.Generator().manual_seed(k)
    if scales == "per_group":
        scale_a, scale_b = torch.rand(groups, generator=g) + 0.5, torch.rand(groups, generator=g) + 0.5
    else:
        scale_a, scale_b = torch.rand(groups, m, generator=g) + 0.5, torch.rand(groups, n, generator=g) + 0.5
    ref = reference_2d2d(a, b, scale_a, scale_b, offs)
    if scales == "flat":  # torch._scaled_grouped_mm's form: [G * M] and [G * N]
        scale_a, scale_b = scale_a.flatten(), scale_b.flatten()
    out = launch.grouped_fp8_gemm(a, b, scale_a, scale_b, torch.tensor(offs, dtype=torch.int32), torch.float32)
    assert out.shape == (groups, m, n)
    assert_close(out, ref)
    for gi, (s, e) in enumerate(bounds(offs)):
        if s == e:
            assert not out[gi].any()  # an empty K-slice: a zero product


def test_2d2d_reads_only_each_groups_k_slice():
    """NaNs past offs[-1], in the partial BLOCK_K window the last K-slice ends in, reach no output:
    the kernel zeroes what lies outside a slice rather than multiplying it by zero."""
    a, _ = fp8_operand((40, 100), E4M3, (), seed=1)
    b, _ = fp8_operand((100, 24), E4M3, (), seed=2)
    ones = torch.ones(3)
    a_nan, b_nan = a.clone(), b.clone()
    a_nan[:, 90:] = torch.tensor(float("nan")).to(E4M3)  # offsets end at 90, inside the window 64..96
    b_nan[90:] = torch.tensor(float("nan")).to(E4M3)
    out = launch.grouped_fp8_gemm(a_nan, b_nan, ones, ones, torch.tensor([10, 45, 90], dtype=torch.int32), torch.float32)
    assert out.isfinite().all()
    assert_close(out, reference_2d2d(a, b, ones, ones, [10, 45, 90]))


def test_grouped_rejects_bad_arguments():
    a, b, _ = operands_2d3d(32, 32, 16, 2, seed=7)
    offs = torch.tensor([16, 32], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"scale_b must have shape \(2,\) \(per group\) or \(2, 16\)"):
        launch.grouped_fp8_gemm(a, b, torch.ones(32), torch.ones(16), offs)
    with pytest.raises(ValueError, match="offs must be a 1-D int32"):
        launch.grouped_fp8_gemm(a, b, torch.ones(32), torch.ones(2, 16), offs.long())
    with pytest.raises(ValueError, match="b has 2 groups, offs 3"):
        launch.grouped_fp8_gemm(a, b, torch.ones(32), torch.ones(2, 16), torch.tensor([1, 2, 32], dtype=torch.int32))
    with pytest.raises(ValueError, match="float32 scale inverses"):
        launch.grouped_fp8_gemm(a, b, torch.ones(32, dtype=torch.bfloat16), torch.ones(2, 16), offs)
