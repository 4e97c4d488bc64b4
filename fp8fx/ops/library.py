"""`torch.library` operators for the explicit amax -> scale -> cast -> FP8 GEMM chain.

Each op is the reference implementation of `reference.py` (which emulates FP8 exactly) plus a
fake (shape) implementation; `fp8fx.ops.cuda` registers what runs on CUDA tensors (the generated
Triton kernels, `torch._scaled_mm`) and a "triton" `fp8_gemm` on CPU tensors under Triton's
interpreter.
The ops have no autograd formula: they are inserted into graphs that are already differentiated
(the joint graph) or inference-only. `block` arguments describe the granularity (see
`fp8fx.core.scaling`): `[]` tensorwise, `[b0, b1]` one scale per b0 x b1 block of the last two dims
(0 = whole dim).

Grouped GEMMs (mixture-of-experts layers) have their own chain: `grouped_amax` and `grouped_cast`
scale each group of a 2-D operand (one scale per group, or per row / column within it: a router
decides the groups, so no fixed block can), `pad_groups` / `pad_offsets` pad each group to a
multiple of a block along K, and `fp8_grouped_mm` multiplies (`fp8fx.core.grouped` says where
every granularity puts the scales).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import custom_op

from fp8fx.core import grouped
from fp8fx.core.epilogue import Epilogue
from fp8fx.core.scaling import scale_shape
from fp8fx.ops import reference
from fp8fx.ops.args import Fp8GemmArgs

# Inductor leaves a custom op that a pass inserted free to take its inputs in any layout; the GEMMs
# need theirs as their fake values say (a right operand column-major: K-contiguous), or their
# launchers copy the FP8 tensors. This tag makes Inductor write the inputs in that stride order.
GEMM_TAGS = (torch.Tag.needs_fixed_stride_order,)

amax = custom_op("fp8fx::amax", reference.amax, mutates_args=())
amax_to_scale = custom_op("fp8fx::amax_to_scale", reference.amax_to_scale, mutates_args=())
cast = custom_op("fp8fx::cast", reference.cast, mutates_args=())
scaled_mm = custom_op("fp8fx::scaled_mm", reference.scaled_mm, mutates_args=(), tags=GEMM_TAGS)
delayed_scale_update = custom_op("fp8fx::delayed_scale_update", reference.delayed_scale_update, mutates_args=())
grouped_amax = custom_op("fp8fx::grouped_amax", reference.grouped_amax, mutates_args=())
grouped_cast = custom_op("fp8fx::grouped_cast", reference.grouped_cast, mutates_args=())
pad_offsets = custom_op("fp8fx::pad_offsets", reference.pad_offsets, mutates_args=())
pad_groups = custom_op("fp8fx::pad_groups", reference.pad_groups, mutates_args=())
fp8_grouped_mm = custom_op("fp8fx::fp8_grouped_mm", reference.fp8_grouped_mm, mutates_args=(), tags=GEMM_TAGS)


@custom_op("fp8fx::saved_copy", mutates_args=())
def saved_copy(x: Tensor, dtype: torch.dtype) -> Tensor:
    """`x` in `dtype`: the narrower copy of a GEMM output that backward reads
    (fp8fx.passes.saved_outputs). An op of its own, not a dtype conversion, so that
    min-cut partitioning sees a tensor worth saving rather than one to fuse and recompute."""
    return x.to(dtype)


@saved_copy.register_fake
def _(x: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty_like(x, dtype=dtype)


@custom_op("fp8fx::widen", mutates_args=())
def widen(q: Tensor, scale_inv: Tensor, dtype: torch.dtype, block: list[int]) -> Tensor:
    """`reference.widen`: backward's copy of an activation kept in FP8 (fp8fx.passes.saved_activations)."""
    return reference.widen(q, scale_inv, dtype, block)


@widen.register_fake
def _(q: Tensor, scale_inv: Tensor, dtype: torch.dtype, block: list[int]) -> Tensor:
    return torch.empty_like(q, dtype=dtype)


@custom_op("fp8fx::scale_inverse", mutates_args=())
def scale_inverse(scale: Tensor) -> Tensor:
    """`1 / scale`, the scale inverse a GEMM applies to its product. An op of its own, not
    `aten.reciprocal`: Inductor cannot fuse a reciprocal of a scale into the GEMM ops that read it,
    so it compiled the graph's reciprocals into kernels of their own (one more C++ or Triton build
    per graph, a second or so each, for a few scalars of work)."""
    return scale.reciprocal()


@scale_inverse.register_fake
def _(scale: Tensor) -> Tensor:
    return torch.empty_like(scale)


@custom_op("fp8fx::fp8_gemm", mutates_args=(), tags=GEMM_TAGS)
def fp8_gemm(
    a: Tensor,
    b: Tensor,
    scale_inv_a: Tensor,
    scale_inv_b: Tensor,
    bias: Tensor | None,
    other: Tensor | None,
    residual: Tensor | None,
    out_scale: Tensor | None,
    out_dtype: torch.dtype,
    aux_dtype: torch.dtype,
    block_a: list[int],
    block_b: list[int],
    epilogue: str,
    *,
    gpu_kernel: str,
    fast_accum: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """`reference.fp8_gemm`. How a GPU runs it is keyword-only: `gpu_kernel` and `fast_accum`; the
    CPU emulation is the same for every value. The parameters are `Fp8GemmArgs`'s fields."""
    return reference.fp8_gemm(Fp8GemmArgs(**locals()))  # (only the parameters are defined yet)


@amax.register_fake
def _(x: Tensor, block: list[int]) -> Tensor:
    return x.new_empty(scale_shape(x.shape, block), dtype=torch.float32)


@amax_to_scale.register_fake
def _(amax: Tensor, fp8_max: float, margin: int, power_of_two: bool, rounding: str | None = None) -> Tensor:
    return torch.empty_like(amax, dtype=torch.float32)


@cast.register_fake
def _(x: Tensor, scale: Tensor, dtype: torch.dtype, block: list[int]) -> Tensor:
    return torch.empty_like(x, dtype=dtype)


@scaled_mm.register_fake
def _(a, b, scale_inv_a, scale_inv_b, bias, out_dtype, block_a, block_b, fast_accum=False) -> Tensor:
    reference.check_scaled_mm_args(a, b, scale_inv_a, scale_inv_b, block_a, block_b)
    return a.new_empty((*a.shape[:-1], b.shape[-1]), dtype=out_dtype)


@delayed_scale_update.register_fake
def _(amax_history, scale, steps, non_finite, amax, fp8_max, margin, power_of_two, most_recent, interval):
    return torch.empty_like(amax_history), torch.empty_like(scale), torch.empty_like(steps), torch.empty_like(non_finite)


@fp8_gemm.register_fake
def _(*args, **kwargs):
    g = Fp8GemmArgs.bind(args, kwargs)
    reference.check_scaled_mm_args(g.a, g.b, g.scale_inv_a, g.scale_inv_b, g.block_a, g.block_b)
    ep = Epilogue.parse(g.epilogue)
    shape = (*g.a.shape[:-1], g.b.shape[-1])
    aux = g.a.new_empty(shape if ep.aux != "none" else (0,), dtype=g.aux_dtype)
    amax = g.a.new_empty(() if ep.out_amax else (0,), dtype=torch.float32)
    return g.a.new_empty(shape, dtype=g.out_dtype), aux, amax


@grouped_amax.register_fake
def _(x: Tensor, offs: Tensor, dim: int, lines: bool) -> Tensor:
    return x.new_empty((offs.shape[0], x.shape[1 - dim]) if lines else (offs.shape[0],), dtype=torch.float32)


@grouped_cast.register_fake
def _(x: Tensor, scale: Tensor, offs: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


@pad_offsets.register_fake
def _(offs: Tensor, multiple: int) -> Tensor:
    return torch.empty_like(offs)


@pad_groups.register_fake
def _(x: Tensor, offs: Tensor, dim: int, multiple: int) -> Tensor:
    shape = list(x.shape)
    shape[dim] = grouped.padded_extent(shape[dim], offs.shape[0], multiple)
    return x.new_empty(shape)


@fp8_grouped_mm.register_fake
def _(a, b, scale_inv_a, scale_inv_b, offs, out_dtype, block_a, block_b, fast_accum=False) -> Tensor:
    form, _ = reference.check_grouped_args(a, b, scale_inv_a, scale_inv_b, offs, block_a, block_b)
    if form == "2d-3d":
        return a.new_empty((a.shape[0], b.shape[-1]), dtype=out_dtype)
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[-1]), dtype=out_dtype)
