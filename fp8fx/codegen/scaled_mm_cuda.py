"""Launcher for FP8 GEMMs on CUDA through PyTorch's scaled-mm kernels (cuBLASLt / CUTLASS).

These kernels take 2-D operands whose dimensions are multiples of 16, the left operand row-major
and the right one column-major, and at most one E5M2 operand. Any other shape or layout is
zero-padded and copied here (zeros add nothing to the product): the token dimension varies from
batch to batch, and it is K in the weight gradient. Rowwise and blockwise
scaling produce bf16 in the kernel; the result is then cast to the requested dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ALIGN = 16


def _pad_to(t: Tensor, dim: int, multiple: int, value: float = 0.0) -> Tensor:
    extra = -t.shape[dim] % multiple
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # F.pad has no FP8 kernels: pad the bytes
        return F.pad(t.view(torch.uint8), pad).view(t.dtype)
    return F.pad(t, pad, value=value)


def _kind(block_a: list[int], block_b: list[int]) -> str | None:
    """Which of PyTorch's scaled-mm kernels takes these scale blocks (a rowwise GEMM may have one
    tensorwise side); None: none of them."""
    if not block_a and not block_b:
        return "tensorwise"
    if block_a in ([], [1, 0]) and block_b in ([], [0, 1]):
        return "rowwise"
    if block_a in ([1, 128], [128, 128]) and block_b in ([128, 1], [128, 128]):
        return "blockwise"
    return None


def scaled_mm_supports(variant) -> str:
    """Why PyTorch's scaled-mm kernels cannot run `variant`'s GEMM ("" when they can)."""
    block_a, block_b = list(variant.block_a), list(variant.block_b)
    if variant.a_dtype == variant.b_dtype == torch.float8_e5m2:
        return "two E5M2 operands"
    return "" if _kind(block_a, block_b) else f"scale blocks {block_a} x {block_b}"


def _block_recipe(block: list[int]):
    if block == [1, 128] or block == [128, 1]:
        return F.ScalingType.BlockWise1x128
    if block == [128, 128]:
        return F.ScalingType.BlockWise128x128
    raise ValueError(f"FP8 GEMM on CUDA: no kernel for block {block}; supported: [1,128], [128,1], [128,128]")


def scaled_mm_2d(
    a: Tensor,
    b: Tensor,
    scale_inv_a: Tensor,
    scale_inv_b: Tensor,
    out_dtype: torch.dtype,
    block_a: list[int] = (),
    block_b: list[int] = (),
    fast_accum: bool = False,
) -> Tensor:
    """One 2-D FP8 GEMM: checks, pads M, N and K to multiples of 16, lays out b column-major.
    `fast_accum` is `torch._scaled_mm`'s `use_fast_accum` (Hopper's FP8 accumulator, unpromoted)."""
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise ValueError("FP8 GEMM with two E5M2 operands is not supported by cuBLASLt; use format hybrid or e4m3")
    m, n = a.shape[0], b.shape[1]
    block_a, block_b = list(block_a), list(block_b)
    # Zero rows / columns / K-slices change no product, and padding to 16 never opens a new 128-block.
    a = _pad_to(_pad_to(a, 0, ALIGN), 1, ALIGN).contiguous()
    b = _pad_to(_pad_to(b, 0, ALIGN), 1, ALIGN).t().contiguous().t()  # column-major
    kind = _kind(block_a, block_b)
    if kind == "tensorwise":
        out = torch._scaled_mm(a, b, scale_a=scale_inv_a, scale_b=scale_inv_b, out_dtype=out_dtype, use_fast_accum=fast_accum)
        return out[:m, :n]
    if kind == "rowwise":  # a tensorwise side becomes a constant column / row of scales
        sa = _pad_to(scale_inv_a.reshape(-1, 1).expand(m, 1).contiguous(), 0, ALIGN, 1.0)
        sb = _pad_to(scale_inv_b.reshape(1, -1).expand(1, n).contiguous(), 1, ALIGN, 1.0)
        out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
        return out[:m, :n].to(out_dtype)
    sa = _pad_to(scale_inv_a, 0, ALIGN, 1.0)
    sb = _pad_to(scale_inv_b, 1, ALIGN, 1.0) if block_b == [128, 1] else scale_inv_b
    out = F.scaled_mm(a, b, sa, _block_recipe(block_a), sb, _block_recipe(block_b), output_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    return out[:m, :n].to(out_dtype)


def scaled_mm_cuda(
    a: Tensor,
    b: Tensor,
    scale_inv_a: Tensor,
    scale_inv_b: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    block_a: list[int],
    block_b: list[int],
    fast_accum: bool = False,
) -> Tensor:
    from fp8fx.ops.reference import check_scaled_mm_args

    check_scaled_mm_args(a, b, scale_inv_a, scale_inv_b, block_a, block_b)
    if a.dim() == 2:
        out = scaled_mm_2d(a, b, scale_inv_a, scale_inv_b, out_dtype, block_a, block_b, fast_accum)
    else:  # bmm: one GEMM per batch entry until the batched Triton kernel exists
        def scale(s: Tensor, block: list[int], i: int) -> Tensor:
            return s[i] if block else s

        out = torch.stack([
            scaled_mm_2d(a[i], b[i], scale(scale_inv_a, block_a, i), scale(scale_inv_b, block_b, i), out_dtype, block_a, block_b, fast_accum)
            for i in range(a.shape[0])
        ])
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out
