"""`torch.library` operators for the explicit amax -> scale -> cast -> FP8 GEMM chain.

Each op has a fake (shape) implementation and the reference implementation of `reference.py`,
which emulates FP8 exactly; CUDA tensors go to `fp8fx.codegen.scaled_mm_cuda` for the GEMM. The
ops have no autograd formula: they are inserted into graphs that are already differentiated (the
joint graph) or inference-only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fp8fx.formats import fp8_format_of
from fp8fx.ops import reference


@torch.library.custom_op("fp8fx::amax", mutates_args=())
def amax(x: Tensor) -> Tensor:
    """Largest magnitude of `x`, an fp32 scalar."""
    return reference.amax(x)


@amax.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("fp8fx::amax_to_scale", mutates_args=())
def amax_to_scale(amax: Tensor, fp8_max: float, margin: int) -> Tensor:
    """`fp8_max / amax / 2**margin`, or 1 for a zero or non-finite amax."""
    return reference.amax_to_scale(amax, fp8_max, margin)


@amax_to_scale.register_fake
def _(amax: Tensor, fp8_max: float, margin: int) -> Tensor:
    return amax.new_empty((), dtype=torch.float32)


@torch.library.custom_op("fp8fx::cast", mutates_args=())
def cast(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Saturating cast of `x * scale` to the FP8 `dtype`."""
    return reference.cast(x, scale, dtype)


@cast.register_fake
def _(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty_like(x, dtype=dtype)


def _check_scaled_mm_args(a: Tensor, b: Tensor, scale_inv_a: Tensor, scale_inv_b: Tensor) -> None:
    for name, t in (("a", a), ("b", b)):
        fp8_format_of(t.dtype)  # raises with the dtype named
        if t.dim() not in (2, 3):
            raise ValueError(f"fp8fx::scaled_mm: operand {name} must be 2-D or 3-D, got shape {tuple(t.shape)}")
    if a.dim() != b.dim() or a.shape[-1] != b.shape[-2] or (a.dim() == 3 and a.shape[0] != b.shape[0]):
        raise ValueError(f"fp8fx::scaled_mm: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    for name, s in (("scale_inv_a", scale_inv_a), ("scale_inv_b", scale_inv_b)):
        if s.numel() != 1 or s.dtype != torch.float32:
            raise ValueError(f"fp8fx::scaled_mm: {name} must be an fp32 scalar (tensorwise), got {s.dtype} {tuple(s.shape)}")


@torch.library.custom_op("fp8fx::scaled_mm", mutates_args=())
def scaled_mm(
    a: Tensor, b: Tensor, scale_inv_a: Tensor, scale_inv_b: Tensor, bias: Tensor | None, out_dtype: torch.dtype
) -> Tensor:
    """`(a * scale_inv_a) @ (b * scale_inv_b) + bias` in `out_dtype`; a, b FP8, 2-D (mm) or 3-D (bmm)."""
    _check_scaled_mm_args(a, b, scale_inv_a, scale_inv_b)
    if a.is_cuda:
        from fp8fx.codegen.scaled_mm_cuda import scaled_mm_cuda

        return scaled_mm_cuda(a, b, scale_inv_a, scale_inv_b, bias, out_dtype)
    return reference.scaled_mm(a, b, scale_inv_a, scale_inv_b, bias, out_dtype)


@scaled_mm.register_fake
def _(a: Tensor, b: Tensor, scale_inv_a: Tensor, scale_inv_b: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    _check_scaled_mm_args(a, b, scale_inv_a, scale_inv_b)
    return a.new_empty((*a.shape[:-1], b.shape[-1]), dtype=out_dtype)
