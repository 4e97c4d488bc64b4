"""Launcher for FP8 GEMMs on CUDA through PyTorch's scaled-mm kernels (cuBLASLt / CUTLASS).

These kernels take 2-D operands whose dimensions are multiples of 16, the left operand row-major
and the right one column-major, and at most one E5M2 operand. The policy keeps sites whose weight
dimensions (N, K) are not multiples of 16 in high precision; the token dimension varies from batch
to batch, so it is zero-padded here (zeros add nothing to the product). Rowwise and blockwise
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
) -> Tensor:
    """One 2-D FP8 GEMM: checks, pads M (and K for per-tensor scales), lays out b column-major."""
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise ValueError("FP8 GEMM with two E5M2 operands is not supported by cuBLASLt; use format hybrid or e4m3")
    m, n = a.shape[0], b.shape[1]
    if n % ALIGN:
        raise ValueError(f"FP8 GEMM needs N % {ALIGN} == 0, got N={n}; the policy should have kept this GEMM high")
    block_a, block_b = list(block_a), list(block_b)
    # Zero rows of a and zero K-columns/rows change no product; padding K to 16 never opens a new
    # 128-block (a K that is a multiple of 128 needs no padding).
    a = _pad_to(_pad_to(a, 0, ALIGN), 1, ALIGN).contiguous()
    b = _pad_to(b, 0, ALIGN).t().contiguous().t()  # column-major
    if not block_a and not block_b:
        return torch._scaled_mm(a, b, scale_a=scale_inv_a, scale_b=scale_inv_b, out_dtype=out_dtype)[:m]
    if all(not x or x in ([1, 0], [0, 1]) for x in (block_a, block_b)):
        # Rowwise (a tensorwise side becomes a constant column / row of scales).
        sa = _pad_to(scale_inv_a.reshape(-1, 1).expand(m, 1).contiguous(), 0, ALIGN, 1.0)
        sb = scale_inv_b.reshape(1, -1).expand(1, n).contiguous()
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)[:m].to(out_dtype)
    sa = _pad_to(scale_inv_a, 0, ALIGN, 1.0)
    out = F.scaled_mm(a, b, sa, _block_recipe(block_a), scale_inv_b, _block_recipe(block_b), output_dtype=torch.bfloat16)
    return out[:m].to(out_dtype)


def scaled_mm_cuda(
    a: Tensor,
    b: Tensor,
    scale_inv_a: Tensor,
    scale_inv_b: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    block_a: list[int],
    block_b: list[int],
) -> Tensor:
    from fp8fx.ops.reference import check_scaled_mm_args

    check_scaled_mm_args(a, b, scale_inv_a, scale_inv_b, block_a, block_b)
    if a.dim() == 2:
        out = scaled_mm_2d(a, b, scale_inv_a, scale_inv_b, out_dtype, block_a, block_b)
    else:  # bmm: one GEMM per batch entry until the batched Triton kernel exists
        def scale(s: Tensor, block: list[int], i: int) -> Tensor:
            return s[i] if block else s

        out = torch.stack([
            scaled_mm_2d(a[i], b[i], scale(scale_inv_a, block_a, i), scale(scale_inv_b, block_b, i), out_dtype, block_a, block_b)
            for i in range(a.shape[0])
        ])
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out
