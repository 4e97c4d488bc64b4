"""Reference implementations of the fp8fx ops in plain torch: the CPU kernels of the ops, and
what the ops decompose into when Inductor compiles a CPU graph (so it can fuse them).

FP8 emulation is exact: operands are real FP8 tensors, and the GEMM runs on their fp32 upcast
(FP8 values and their pairwise products are exact in fp32) with fp32 accumulation; the scale
inverses are applied to the fp32 result, as FP8 tensor cores do."""

from __future__ import annotations

import torch
from torch import Tensor

from fp8fx import scaling
from fp8fx.formats import fp8_format_of, saturating_cast


def amax(x: Tensor) -> Tensor:
    return scaling.tensor_amax(x)


def amax_to_scale(amax: Tensor, fp8_max: float, margin: int) -> Tensor:
    return scaling.amax_to_scale(amax, fp8_max, margin)


def cast(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return saturating_cast(x.to(torch.float32) * scale, fp8_format_of(dtype))


def scaled_mm(a: Tensor, b: Tensor, scale_inv_a: Tensor, scale_inv_b: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    out = torch.matmul(a.to(torch.float32), b.to(torch.float32)).mul_(scale_inv_a * scale_inv_b)
    if bias is not None:
        out.add_(bias)
    return out.to(out_dtype)
