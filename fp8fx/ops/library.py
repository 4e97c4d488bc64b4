"""`torch.library` operators for the explicit amax -> scale -> cast -> FP8 GEMM chain.

Each op has a fake (shape) implementation and the reference implementation of `reference.py`,
which emulates FP8 exactly; CUDA tensors go to `fp8fx.codegen.scaled_mm_cuda` for the GEMM. The
ops have no autograd formula: they are inserted into graphs that are already differentiated (the
joint graph) or inference-only. `block` arguments describe the granularity (see `fp8fx.scaling`):
`[]` tensorwise, `[b0, b1]` one scale per b0 x b1 block of the last two dims (0 = whole dim).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fp8fx.formats import fp8_format_of
from fp8fx.ops import reference
from fp8fx.scaling import block_dims, scale_shape


def _check_block(block: list[int], what: str) -> None:
    if block and (len(block) != 2 or any(b < 0 for b in block)):
        raise ValueError(f"fp8fx: {what} block must be [] or [rows, cols] with sizes >= 0 (0 = whole dim), got {block}")


@torch.library.custom_op("fp8fx::amax", mutates_args=())
def amax(x: Tensor, block: list[int]) -> Tensor:
    """Largest magnitude of `x` (per block), fp32."""
    _check_block(block, "amax")
    return reference.amax(x, block)


@amax.register_fake
def _(x: Tensor, block: list[int]) -> Tensor:
    return x.new_empty(scale_shape(x.shape, block), dtype=torch.float32)


@torch.library.custom_op("fp8fx::amax_to_scale", mutates_args=())
def amax_to_scale(amax: Tensor, fp8_max: float, margin: int, power_of_two: bool) -> Tensor:
    """`fp8_max / amax / 2**margin` (optionally rounded down to a power of two), 1 for a zero or non-finite amax."""
    return reference.amax_to_scale(amax, fp8_max, margin, power_of_two)


@amax_to_scale.register_fake
def _(amax: Tensor, fp8_max: float, margin: int, power_of_two: bool) -> Tensor:
    return torch.empty_like(amax, dtype=torch.float32)


@torch.library.custom_op("fp8fx::cast", mutates_args=())
def cast(x: Tensor, scale: Tensor, dtype: torch.dtype, block: list[int]) -> Tensor:
    """Saturating cast of `x * scale` (scale per block) to the FP8 `dtype`."""
    _check_block(block, "cast")
    return reference.cast(x, scale, dtype, block)


@cast.register_fake
def _(x: Tensor, scale: Tensor, dtype: torch.dtype, block: list[int]) -> Tensor:
    return torch.empty_like(x, dtype=dtype)


def _check_scaled_mm_args(a, b, scale_inv_a, scale_inv_b, block_a, block_b) -> None:
    for name, t in (("a", a), ("b", b)):
        fp8_format_of(t.dtype)  # raises with the dtype named
        if t.dim() not in (2, 3):
            raise ValueError(f"fp8fx::scaled_mm: operand {name} must be 2-D or 3-D, got shape {tuple(t.shape)}")
    if a.dim() != b.dim() or a.shape[-1] != b.shape[-2] or (a.dim() == 3 and a.shape[0] != b.shape[0]):
        raise ValueError(f"fp8fx::scaled_mm: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    for name, x, s, block in (("a", a, scale_inv_a, block_a), ("b", b, scale_inv_b, block_b)):
        _check_block(block, f"scaled_mm operand {name}")
        expected = scale_shape(x.shape, block)
        if s.dtype != torch.float32 or tuple(s.shape) != tuple(expected):
            raise ValueError(
                f"fp8fx::scaled_mm: scale_inv_{name} must be fp32 of shape {tuple(expected)} for block {block}, "
                f"got {s.dtype} {tuple(s.shape)}"
            )
    k = a.shape[-1]
    k_a = block_dims(a.shape, block_a)[1] if block_a else k
    k_b = block_dims(b.shape, block_b)[0] if block_b else k
    if k_a != k_b and k_a != k and k_b != k:
        raise ValueError(f"fp8fx::scaled_mm: the operands' blocks along K differ ({k_a} vs {k_b})")


@torch.library.custom_op("fp8fx::scaled_mm", mutates_args=())
def scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_inv_a: Tensor,
    scale_inv_b: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    block_a: list[int],
    block_b: list[int],
) -> Tensor:
    """`(a * scale_inv_a) @ (b * scale_inv_b) + bias` in `out_dtype`; a, b FP8, 2-D (mm) or 3-D (bmm)."""
    _check_scaled_mm_args(a, b, scale_inv_a, scale_inv_b, block_a, block_b)
    if a.is_cuda:
        from fp8fx.codegen.scaled_mm_cuda import scaled_mm_cuda

        return scaled_mm_cuda(a, b, scale_inv_a, scale_inv_b, bias, out_dtype, block_a, block_b)
    return reference.scaled_mm(a, b, scale_inv_a, scale_inv_b, bias, out_dtype, block_a, block_b)


@scaled_mm.register_fake
def _(a, b, scale_inv_a, scale_inv_b, bias, out_dtype, block_a, block_b) -> Tensor:
    _check_scaled_mm_args(a, b, scale_inv_a, scale_inv_b, block_a, block_b)
    return a.new_empty((*a.shape[:-1], b.shape[-1]), dtype=out_dtype)


@torch.library.custom_op("fp8fx::delayed_scale_update", mutates_args=())
def delayed_scale_update(
    amax_history: Tensor,
    scale: Tensor,
    steps: Tensor,
    non_finite: Tensor,
    amax: Tensor,
    fp8_max: float,
    margin: int,
    power_of_two: bool,
    most_recent: bool,
    interval: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Next (amax_history, scale, steps, non_finite) of a delayed-scaling state, given this step's amax."""
    return reference.delayed_scale_update(amax_history, scale, steps, non_finite, amax, fp8_max, margin, power_of_two, most_recent, interval)


@delayed_scale_update.register_fake
def _(amax_history, scale, steps, non_finite, amax, fp8_max, margin, power_of_two, most_recent, interval):
    return torch.empty_like(amax_history), torch.empty_like(scale), torch.empty_like(steps), torch.empty_like(non_finite)
