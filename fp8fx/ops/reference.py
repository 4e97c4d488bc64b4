"""Reference implementations of the fp8fx ops in plain torch: the CPU kernels of the ops.

FP8 emulation is exact: operands are real FP8 tensors, and the GEMM runs on their fp32 upcast
(FP8 values and their pairwise products are exact in fp32) with fp32 accumulation; the scale
inverses are applied to the fp32 result, as FP8 tensor cores do. With blockwise scales along the
contraction dimension, each K-block's partial product is scaled and promoted to the fp32
accumulator separately (DeepSeek-V3's FP32 promotion every 128 K-elements); MX's 1x32 blocks the
same way, every 32 K-elements (their power-of-two scales make each scaled partial product exact).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fp8fx.core import scaling
from fp8fx.core.epilogue import ACTIVATIONS, Epilogue
from fp8fx.core.formats import fp8_format_of, saturating_cast
from fp8fx.core.scaling import block_dims, scale_shape


def check_block(block: list[int], what: str) -> None:
    if block and (len(block) != 2 or any(b < 0 for b in block)):
        raise ValueError(f"fp8fx: {what} block must be [] or [rows, cols] with sizes >= 0 (0 = whole dim), got {block}")


def check_scaled_mm_args(a, b, scale_inv_a, scale_inv_b, block_a, block_b) -> None:
    for name, t in (("a", a), ("b", b)):
        fp8_format_of(t.dtype)  # raises with the dtype named
        if t.dim() not in (2, 3):
            raise ValueError(f"fp8fx::scaled_mm: operand {name} must be 2-D or 3-D, got shape {tuple(t.shape)}")
    if a.dim() != b.dim() or a.shape[-1] != b.shape[-2] or (a.dim() == 3 and a.shape[0] != b.shape[0]):
        raise ValueError(f"fp8fx::scaled_mm: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    for name, x, s, block in (("a", a, scale_inv_a, block_a), ("b", b, scale_inv_b, block_b)):
        check_block(block, f"scaled_mm operand {name}")
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


def amax(x: Tensor, block: list[int]) -> Tensor:
    """Largest magnitude of `x` (per block), fp32."""
    check_block(block, "amax")
    return scaling.block_amax(x, tuple(block))


def amax_to_scale(amax: Tensor, fp8_max: float, margin: int, power_of_two: bool) -> Tensor:
    """`fp8_max / amax / 2**margin` (optionally rounded down to a power of two), 1 for a zero or non-finite amax.

    With `power_of_two` and margin 0 this is MX's RCEIL E8M0 scale (torchao's and cuBLAS's) for every
    nonzero amax above `fp8_max * 2**-127`, which is how the graph computes the scales of
    granularity mx (see `fp8fx.core.scaling.amax_to_scale`)."""
    return scaling.amax_to_scale(amax, fp8_max, margin, power_of_two)


def cast(x: Tensor, scale: Tensor, dtype: torch.dtype, block: list[int]) -> Tensor:
    """Saturating cast of `x * scale` (scale per block) to the FP8 `dtype`."""
    check_block(block, "cast")
    scale = scaling.expand_blocks(scale, tuple(block), x.shape)
    return saturating_cast(x.to(torch.float32) * scale, fp8_format_of(dtype))


def _as_blocks(scale_inv: Tensor, block: list[int]) -> tuple[Tensor, tuple[int, ...]]:
    """A tensorwise scale as one block covering everything, so all granularities share one path."""
    return (scale_inv, tuple(block)) if block else (scale_inv.reshape(1, 1), (0, 0))


def scaled_mm(
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
    """`(a * scale_inv_a) @ (b * scale_inv_b) + bias` in `out_dtype`; a, b FP8, 2-D (mm) or 3-D (bmm).
    The CPU accumulates in fp32 whatever `fast_accum` (for Hopper's FP8 accumulator) says."""
    check_scaled_mm_args(a, b, scale_inv_a, scale_inv_b, block_a, block_b)
    if not block_a and not block_b:  # tensorwise: one GEMM, one scaling of the result
        out = torch.matmul(a.to(torch.float32), b.to(torch.float32)).mul_(scale_inv_a * scale_inv_b)
    else:
        sa, block_a = _as_blocks(scale_inv_a, block_a)
        sb, block_b = _as_blocks(scale_inv_b, block_b)
        k = a.shape[-1]
        rows_a, k_a = scaling.block_dims(a.shape, block_a)
        k_b, cols_b = scaling.block_dims(b.shape, block_b)
        k_block = min(k_a, k_b)
        n_k = math.ceil(k / k_block)
        # Scales as [.., M or 1, n_k] and [.., n_k, N or 1]: one column / row per K-block of the GEMM.
        sa = scaling.expand_blocks(sa, (rows_a, math.ceil(k_a / k_block)), (*a.shape[:-1], n_k))
        sb = scaling.expand_blocks(sb, (math.ceil(k_b / k_block), cols_b), (*b.shape[:-2], n_k, b.shape[-1]))
        sa, sb = sa.expand(*sa.shape[:-1], n_k), sb.expand(*sb.shape[:-2], n_k, sb.shape[-1])
        out = None
        for i, start in enumerate(range(0, k, k_block)):
            part = torch.matmul(
                a[..., start : start + k_block].to(torch.float32), b[..., start : start + k_block, :].to(torch.float32)
            )
            part.mul_(sa[..., i : i + 1]).mul_(sb[..., i : i + 1, :])
            out = part if out is None else out.add_(part)
    if bias is not None:
        out.add_(bias)
    return out.to(out_dtype)


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
    """One step of TransformerEngine's delayed scaling, functionally.

    This step's amax goes into slot 0 of the history; the scale is recomputed from the history's
    max (or from this amax, `most_recent`) every `interval` steps; a zero or non-finite amax keeps
    the previous scale (TE: `sf = where(amax > 0, sf, scale); sf = where(isfinite(amax), sf, scale)`)
    and is recorded as 0; then the history rolls by one and slot 0 is cleared for the next step."""
    # A non-finite amax is counted, never recorded: one NaN step would otherwise poison the
    # history's max for its whole length (TransformerEngine's reduction skips it too).
    recorded = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    history = torch.cat([recorded.reshape(1).to(amax_history.dtype), amax_history[1:]])
    chosen = history[0] if most_recent else history.max()
    candidate = scaling.amax_to_scale(chosen, fp8_max, margin, power_of_two)
    usable = torch.isfinite(amax) & torch.isfinite(chosen) & (chosen > 0) & (steps % interval == 0)
    new_scale = torch.where(usable, candidate, scale)
    rolled = torch.roll(history, -1)
    new_history = torch.cat([torch.zeros_like(rolled[:1]), rolled[1:]])
    return new_history, new_scale, steps + 1, non_finite + (~torch.isfinite(amax)).to(non_finite.dtype)


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
    kernel: str,
    fast_accum: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """FP8 GEMM with a fused epilogue (see `fp8fx.codegen.triton_kernels` for the order).

    `epilogue` is an `Epilogue.spec()` string. Everything after the GEMM runs in fp32 and is rounded
    once, to `out_dtype` (FP8: saturating cast of `y * out_scale`). Returns (out, aux, amax); aux
    and amax are empty tensors when the epilogue does not make them. `kernel` names what runs on a
    GPU ("triton": the generated kernel, "scaled_mm"; see `fp8fx.ops.cuda`): the emulation is the
    same for both. The CPU accumulates in fp32 whatever `fast_accum` (Hopper's reduced-precision
    FP8 accumulator) says."""
    y = scaled_mm(a, b, scale_inv_a, scale_inv_b, None, torch.float32, block_a, block_b)
    return fp8_gemm_epilogue_after(y, bias, other, residual, out_scale, out_dtype, aux_dtype, Epilogue.parse(epilogue))


def fp8_gemm_epilogue_after(y, bias, other, residual, out_scale, out_dtype, aux_dtype, ep) -> tuple[Tensor, Tensor, Tensor]:
    """The epilogue of `fp8_gemm` on the dequantized fp32 product `y` (updated in place), in the
    kernel's order."""
    aux = y.new_empty(0, dtype=aux_dtype)

    def keep(stage: str) -> None:
        nonlocal aux
        if ep.aux == stage:
            aux = y.to(aux_dtype, copy=True)

    if ep.bias:
        y.add_(bias)
    keep("pre_activation")
    y = ACTIVATIONS[ep.activation].reference(y)
    keep("activation")
    if ep.mul == "by_other":
        y.mul_(other)
    elif ep.mul == "gated":
        y.mul_(ACTIVATIONS[ep.mul_activation].reference(other.to(torch.float32)))
    keep("product")
    if ep.residual:
        y.add_(residual)
    keep("sum")
    amax = scaling.tensor_amax(y) if ep.out_amax else y.new_empty(0)
    if out_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        out = saturating_cast(y * out_scale, fp8_format_of(out_dtype))
    else:
        out = y.to(out_dtype)
    return out, aux, amax
