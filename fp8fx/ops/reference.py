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

from fp8fx.core import grouped, scaling
from fp8fx.core.epilogue import ACTIVATIONS, Epilogue
from fp8fx.core.formats import fp8_format_of, saturating_cast, upcast
from fp8fx.core.scaling import block_dims, scale_shape
from fp8fx.ops.args import Fp8GemmArgs


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


def amax_to_scale(amax: Tensor, fp8_max: float, margin: int, power_of_two: bool, rounding: str | None = None) -> Tensor:
    """`fp8_max / amax / 2**margin` (optionally rounded down to a power of two), 1 for a zero or non-finite amax.

    With `power_of_two` and margin 0 this is MX's RCEIL E8M0 scale (torchao's and cuBLAS's) for every
    nonzero amax above `fp8_max * 2**-127`, which is how the graph computes the scales of
    granularity mx; `rounding` "floor" gives MX's FLOOR scales instead (see
    `fp8fx.core.scaling.amax_to_scale`)."""
    return scaling.amax_to_scale(amax, fp8_max, margin, power_of_two, rounding)


def laid_out_like(result: Tensor, x: Tensor) -> Tensor:
    """`result` (of `x`'s shape) in the layout `torch.empty_like(x)` gives, which the fakes of the
    elementwise ops promise: a copy only where torch's elementwise kernels chose another (they follow
    a permuted input's dims even where it is not dense, e.g. a slice of a transposed tensor)."""
    expected = torch.empty_like(x, dtype=result.dtype, device="meta")
    if all(a == b for a, b, size in zip(result.stride(), expected.stride(), x.shape) if size > 1):
        return result
    return torch.empty_like(x, dtype=result.dtype).copy_(result)


def cast(x: Tensor, scale: Tensor, dtype: torch.dtype, block: list[int]) -> Tensor:
    """Saturating cast of `x * scale` (scale per block) to the FP8 `dtype`, laid out as `x`."""
    check_block(block, "cast")
    scale = scaling.expand_blocks(scale, tuple(block), x.shape)
    return laid_out_like(saturating_cast(x.to(torch.float32) * scale, fp8_format_of(dtype)), x)


def widen(q: Tensor, scale_inv: Tensor, dtype: torch.dtype, block: list[int]) -> Tensor:
    """An FP8 tensor `q` back in `dtype`: `q * scale_inv` (scale inverse per block), laid out as `q`."""
    check_block(block, "widen")
    scale_inv = scaling.expand_blocks(scale_inv, tuple(block), q.shape)
    return laid_out_like((upcast(q) * scale_inv).to(dtype), q)


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
    return emulated_mm(a, b, scale_inv_a, scale_inv_b, bias, out_dtype, block_a, block_b, upcast)


def emulated_mm(a, b, scale_inv_a, scale_inv_b, bias, out_dtype, block_a, block_b, to_fp32) -> Tensor:
    """`scaled_mm`, with the operands taken to fp32 by `to_fp32` (`upcast` eagerly; `.to` where
    Inductor compiles it, `fp8fx.compiler.lowering`)."""
    check_scaled_mm_args(a, b, scale_inv_a, scale_inv_b, block_a, block_b)
    if not block_a and not block_b:  # tensorwise: one GEMM, one scaling of the result
        out = torch.matmul(to_fp32(a), to_fp32(b)).mul_(scale_inv_a * scale_inv_b)
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
            part = torch.matmul(to_fp32(a[..., start : start + k_block]), to_fp32(b[..., start : start + k_block, :]))
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
    and is recorded as 0; then the history rolls by one and slot 0 is cleared for the next step.

    Batched too: histories [..., history_len] with amax, scale, steps and non_finite [...], one
    state per index (`fp8fx::delayed_scale_steps` steps a graph's states at once)."""
    # A non-finite amax is counted, never recorded: one NaN step would otherwise poison the
    # history's max for its whole length (TransformerEngine's reduction skips it too).
    finite = torch.isfinite(amax)
    recorded = torch.where(finite, amax, torch.zeros_like(amax))
    history = torch.cat([recorded.unsqueeze(-1).to(amax_history.dtype), amax_history[..., 1:]], dim=-1)
    chosen = history[..., 0] if most_recent else history.amax(dim=-1)
    candidate = scaling.amax_to_scale(chosen, fp8_max, margin, power_of_two)
    usable = finite & torch.isfinite(chosen) & (chosen > 0) & (steps % interval == 0)
    new_scale = torch.where(usable, candidate, scale)
    rolled = torch.roll(history, -1, dims=-1)
    new_history = torch.cat([torch.zeros_like(rolled[..., :1]), rolled[..., 1:]], dim=-1)
    return new_history, new_scale, steps + 1, non_finite + (~finite).to(non_finite.dtype)


def fp8_gemm(g: Fp8GemmArgs) -> tuple[Tensor, Tensor, Tensor]:
    """FP8 GEMM with a fused epilogue (see `fp8fx.codegen.triton_kernels` for the order), on the
    arguments of `fp8fx::fp8_gemm`.

    `epilogue` is an `Epilogue.spec()` string. Everything after the GEMM runs in fp32 and is rounded
    once, to `out_dtype` (FP8: saturating cast of `y * out_scale`). Returns (out, aux, amax); aux
    and amax are empty tensors when the epilogue does not make them. `gpu_kernel` names what runs on a
    GPU ("triton": the generated kernel, "scaled_mm"; see `fp8fx.ops.cuda`): the emulation is the
    same for both. The CPU accumulates in fp32 whatever `fast_accum` (Hopper's reduced-precision
    FP8 accumulator) says."""
    return emulated_fp8_gemm(g, upcast)


def emulated_fp8_gemm(g: Fp8GemmArgs, to_fp32) -> tuple[Tensor, Tensor, Tensor]:
    """`fp8_gemm` with the operands taken to fp32 by `to_fp32` (see `emulated_mm`)."""
    y = emulated_mm(g.a, g.b, g.scale_inv_a, g.scale_inv_b, None, torch.float32, g.block_a, g.block_b, to_fp32)
    ep = Epilogue.parse(g.epilogue)
    return fp8_gemm_epilogue_after(y, g.bias, g.other, g.residual, g.out_scale, g.out_dtype, g.aux_dtype, ep)


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


# Grouped GEMMs (mixture-of-experts layers): groups of rows (2-D x 3-D) or of K (2-D x 2-D) given
# by `offs`, the int32 cumulative ends of the groups; group g spans [offs[g - 1], offs[g]) (from 0
# for g = 0). Rows (K) past offs[-1] belong to no group. Where each operand's scales go:
# fp8fx.core.grouped.


def _group_ids(offs: Tensor, extent: int) -> Tensor:
    """The group of each index along the grouped dimension (len(offs) past the last group)."""
    return torch.searchsorted(offs, torch.arange(extent, device=offs.device, dtype=offs.dtype), right=True)


def per_index(values: Tensor, offs: Tensor, extent: int) -> Tensor:
    """`values` ([G, ...], one entry per group) looked up for each of the `extent` indices along the
    grouped dimension; 1 for an index of no group."""
    return torch.cat([values, torch.ones_like(values[:1])])[_group_ids(offs, extent)]


def _rows(x: Tensor, dim: int) -> Tensor:
    """`x` with its grouped dimension first."""
    return x if dim == 0 else x.transpose(0, 1)


def grouped_amax(x: Tensor, offs: Tensor, dim: int, lines: bool) -> Tensor:
    """Largest magnitude of each group of the 2-D `x` along `dim` (fp32 [G]); with `lines`, of each
    row (column) within each group ([G, x.shape[1 - dim]]). An empty group's amax is 0."""
    rows = _rows(x.detach(), dim).abs().to(torch.float32)
    ids = _group_ids(offs, rows.shape[0]).to(torch.int64)
    out = rows.new_zeros((offs.shape[0] + 1, rows.shape[1]))  # the last row takes what no group holds
    out.scatter_reduce_(0, ids[:, None].expand_as(rows), rows, "amax", include_self=True)
    out = out[:-1]
    return out if lines else out.amax(dim=1)


def grouped_cast(x: Tensor, scale: Tensor, offs: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """Saturating cast of `x * scale` to `dtype` with one scale per group along `dim` (`scale` [G]),
    or per row (column) within each group ([G, x.shape[1 - dim]]); what no group holds gets scale 1."""
    rows = _rows(x, dim)
    per_row = per_index(scale.reshape(scale.shape[0], -1), offs, rows.shape[0])  # [G, 1] or [G, lines] per row
    out = saturating_cast(rows.to(torch.float32) * per_row, fp8_format_of(dtype))
    return _rows(out, dim).contiguous()


def pad_offsets(offs: Tensor, multiple: int) -> Tensor:
    """The offsets of the groups once each is padded with zeros to a multiple of `multiple`."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.cumsum((sizes + multiple - 1) // multiple * multiple, 0).to(offs.dtype)


def padded_positions(offs: Tensor, extent: int, multiple: int) -> Tensor:
    """Where each of the `extent` indices along a grouped dimension goes once every group is padded
    to a multiple of `multiple` (`fp8fx.core.grouped.padded_extent` for an index of no group)."""
    ids = _group_ids(offs, extent)
    starts = torch.cat([offs.new_zeros(1), offs])[ids]  # each index's group start (past the last group: offs[-1])
    new_starts = torch.cat([offs.new_zeros(1), pad_offsets(offs, multiple)])[ids]
    index = torch.arange(extent, device=offs.device)
    return torch.where(
        ids < offs.shape[0], index - starts + new_starts, grouped.padded_extent(extent, offs.shape[0], multiple)
    ).to(torch.int64)


def pad_groups(x: Tensor, offs: Tensor, dim: int, multiple: int) -> Tensor:
    """`x` with each group along `dim` padded with zeros to a multiple of `multiple` (groups at
    `pad_offsets(offs, multiple)`), to the static extent of `fp8fx.core.grouped.padded_extent`;
    what no group holds is dropped."""
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # no index_copy for FP8: copy the bytes
        return pad_groups(x.view(torch.uint8), offs, dim, multiple).view(x.dtype)
    rows = _rows(x, dim)
    extent = grouped.padded_extent(rows.shape[0], offs.shape[0], multiple)
    out = rows.new_zeros((extent + 1, rows.shape[1]))  # the last row takes what is dropped
    out.index_copy_(0, padded_positions(offs, rows.shape[0], multiple), rows)
    return _rows(out[:-1], dim).contiguous()


def grouped_form(a: Tensor, b: Tensor, offs: Tensor, what: str = "fp8fx::fp8_grouped_mm") -> str:
    """The grouped GEMM form of the operands ("2d-3d" | "2d-2d"), checked."""
    form = grouped.form_of(a.dim(), b.dim())
    if form is None:
        raise ValueError(f"{what}: operands must be 2-D x 3-D or 2-D x 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    groups = b.shape[0] if form == "2d-3d" else offs.shape[0]
    if offs.dim() != 1 or offs.dtype != torch.int32 or offs.shape[0] != groups:
        raise ValueError(f"{what}: offs must be int32 of shape ({groups},), got {offs.dtype} {tuple(offs.shape)}")
    return form


def check_grouped_args(a, b, scale_inv_a, scale_inv_b, offs, block_a, block_b) -> tuple[str, tuple]:
    """The form and the two operands' `OperandScales`, with every scale's dtype and shape checked."""
    form = grouped_form(a, b, offs)
    sides = []
    for side, (name, x, s, block) in enumerate((("a", a, scale_inv_a, block_a), ("b", b, scale_inv_b, block_b))):
        fp8_format_of(x.dtype)
        check_block(block, f"fp8_grouped_mm operand {name}")
        spec = grouped.operand_scales(form, side, block)
        expected = grouped.scale_shape(tuple(x.shape), offs.shape[0], spec)
        if s.dtype != torch.float32 or tuple(s.shape) != tuple(expected):
            raise ValueError(
                f"fp8fx::fp8_grouped_mm: scale_inv_{name} must be fp32 of shape {tuple(expected)} for block {list(block)} "
                f"({form}), got {s.dtype} {tuple(s.shape)}"
            )
        sides.append(spec)
    return form, tuple(sides)


def _group_scale(s: Tensor, spec: grouped.OperandScales, side: int, g: int, start: int, end: int) -> tuple[Tensor, list[int]]:
    """The scale_inv and block of one group's slice of an operand, as `scaled_mm` takes them."""
    if spec.per_group:
        if not spec.lines:
            return s[g], []
        return (s[g][:, None], [1, 0]) if side == 0 else (s[g][None, :], [0, 1])
    block = list(spec.block)
    if spec.group_dim is None and s.dim() == 3:  # the 3-D right operand: group g's matrix
        return s[g], block
    if spec.align == 1:  # rows of the left operand (2-D x 3-D)
        return s[start:end], block
    lo, hi = start // spec.align, math.ceil(end / spec.align)  # blocks along K (2-D x 2-D)
    return (s[:, lo:hi], block) if side == 0 else (s[lo:hi], block)


def fp8_grouped_mm(
    a: Tensor,
    b: Tensor,
    scale_inv_a: Tensor,
    scale_inv_b: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype,
    block_a: list[int],
    block_b: list[int],
    fast_accum: bool = False,
) -> Tensor:
    """The grouped GEMM of FP8 operands: 2-D x 3-D `out[rows of g] = a[rows of g] @ b[g]` ([M_total,
    N]; rows past offs[-1] are 0), 2-D x 2-D `out[g] = a[:, K of g] @ b[K of g]` ([G, M, N]), each
    group's product the exact emulation of `scaled_mm` with that group's scales. `block_a` and
    `block_b` are the granularity's blocks; `fp8fx.core.grouped.operand_scales` tells where they
    put the scales. Groups scaled by blocks along K must start at multiples of the block."""
    form, (spec_a, spec_b) = check_grouped_args(a, b, scale_inv_a, scale_inv_b, offs, block_a, block_b)
    ends = offs.tolist()
    align = max(spec_a.align, spec_b.align)
    if align > 1 and any(e % align for e in ends):
        raise ValueError(
            f"fp8fx::fp8_grouped_mm: blocks of {align} along K need group offsets that are multiples of {align}, got {ends}"
        )
    if form == "2d-3d":
        out = a.new_zeros((a.shape[0], b.shape[-1]), dtype=torch.float32)
    else:
        out = a.new_zeros((len(ends), a.shape[0], b.shape[-1]), dtype=torch.float32)
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            sa, ba = _group_scale(scale_inv_a, spec_a, 0, g, start, end)
            sb, bb = _group_scale(scale_inv_b, spec_b, 1, g, start, end)
            if form == "2d-3d":
                out[start:end] = scaled_mm(a[start:end], b[g], sa, sb, None, torch.float32, ba, bb)
            else:
                out[g] = scaled_mm(a[:, start:end], b[start:end], sa, sb, None, torch.float32, ba, bb)
        start = max(start, end)
    return out.to(out_dtype)
