"""Launcher for FP8 GEMMs on CUDA through `torch._scaled_mm` (cuBLASLt).

cuBLASLt FP8 GEMMs take 2-D operands whose dimensions are multiples of 16, the left operand
row-major and the right one column-major, and at most one E5M2 operand. The policy keeps sites
whose weight dimensions (N, K) are not multiples of 16 in high precision; the token dimension
varies from batch to batch, so it is zero-padded here (zeros add nothing to the product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ALIGN = 16


def _pad_to(t: Tensor, dim: int, multiple: int) -> Tensor:
    extra = -t.shape[dim] % multiple
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    # F.pad has no FP8 kernels: pad the bytes.
    return F.pad(t.view(torch.uint8), pad).view(t.dtype)


def scaled_mm_2d(a: Tensor, b: Tensor, scale_inv_a: Tensor, scale_inv_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """One 2-D FP8 GEMM: checks, pads M and K to multiples of 16, lays out b column-major."""
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise ValueError("FP8 GEMM with two E5M2 operands is not supported by cuBLASLt; use format hybrid or e4m3")
    m, n = a.shape[0], b.shape[1]
    if n % ALIGN:
        raise ValueError(f"FP8 GEMM needs N % {ALIGN} == 0, got N={n}; the policy should have kept this GEMM high")
    a = _pad_to(_pad_to(a, 0, ALIGN), 1, ALIGN).contiguous()
    b = _pad_to(b, 0, ALIGN)
    b = b.t().contiguous().t()  # column-major
    out = torch._scaled_mm(a, b, scale_a=scale_inv_a, scale_b=scale_inv_b, out_dtype=out_dtype)
    return out[:m]


def scaled_mm_cuda(
    a: Tensor, b: Tensor, scale_inv_a: Tensor, scale_inv_b: Tensor, bias: Tensor | None, out_dtype: torch.dtype
) -> Tensor:
    if a.dim() == 2:
        out = scaled_mm_2d(a, b, scale_inv_a, scale_inv_b, out_dtype)
    else:  # bmm: one GEMM per batch entry until the batched Triton kernel exists
        out = torch.stack([scaled_mm_2d(a[i], b[i], scale_inv_a, scale_inv_b, out_dtype) for i in range(a.shape[0])])
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out
