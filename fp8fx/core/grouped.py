"""Where the scales of a grouped GEMM's operands go: one set of scales per group.

A grouped GEMM (`fp8fx.core.patterns`, a row with `offsets`) splits one dimension into groups whose
extents are data (a router decides them): the left operand's rows in the 2-D x 3-D form, K in the
2-D x 2-D form (the weight gradient). A granularity's scale blocks (`fp8fx.core.recipes`) are
placed within each group, so no scale spans two groups:

    form   operand               tensorwise       rowwise                mx (1x32 along K)
    2d-3d  left  [M_total, K]    one per group    one per row            1x32 blocks
    2d-3d  right [G, K, N]       one per matrix   one per column each    32x1 blocks
    2d-2d  left  [M, K_total]    one per group    one per row each       1x32 blocks, groups padded
    2d-2d  right [K_total, N]    one per group    one per column each    32x1 blocks, groups padded

Blocks of one row (column) along the grouped dimension never straddle two groups and are plain
blocks (`fp8fx.core.scaling`); blocks spanning the whole grouped dimension become one scale per
group (per row or column of the other dimension, `lines`); blocks of b > 1 elements along it
need every group's extent to be a multiple of b, which the graph makes by padding each group with
zeros (`align`). Blockwise follows the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8fx.core import scaling

# Operand ranks (left, right) -> form name. A 3-D left operand (torch._grouped_mm's 3-D x 2-D and
# 3-D x 3-D) is not lowered.
FORMS = {(2, 3): "2d-3d", (2, 2): "2d-2d"}
# The dimension of each operand (left, right) that the groups split; None: a stack of matrices,
# one per group.
GROUP_DIMS = {"2d-3d": (0, None), "2d-2d": (1, 0)}


@dataclass(frozen=True)
class OperandScales:
    """How one operand of a grouped GEMM is scaled."""

    block: tuple[int, ...] | None  # plain scale blocks (fp8fx.core.scaling); None: scales per group
    group_dim: int | None = None  # per group: the dimension the groups split
    lines: bool = False  # per group: one scale per row (column) of the other dimension, else one per group
    align: int = 1  # plain blocks along the grouped dimension: each group's extent is padded to a multiple of this

    @property
    def per_group(self) -> bool:
        return self.block is None


def form_of(left_dim: int, right_dim: int) -> str | None:
    return FORMS.get((left_dim, right_dim))


def operand_scales(form: str, side: int, block: tuple[int, ...] | list[int]) -> OperandScales:
    """The scales of operand `side` (0 left, 1 right) of a grouped GEMM of `form` for the
    granularity's `block` on that side (`()`: tensorwise)."""
    block = tuple(block)
    dim = GROUP_DIMS[form][side]
    if dim is None:  # one matrix per group: blocks within each matrix, a whole matrix for tensorwise
        return OperandScales(block or (0, 0))
    if not block:
        return OperandScales(None, dim)
    along, across = block[dim], block[1 - dim]
    if along == 1:
        return OperandScales(block)
    if along == 0:
        if across != 1:
            raise ValueError(f"fp8fx: grouped GEMM {form} operand {side}: no per-group form of block {list(block)}")
        return OperandScales(None, dim, lines=True)
    return OperandScales(block, dim, align=along)


def scale_shape(shape: tuple, groups: int, scales: OperandScales) -> tuple:
    """Shape of the scales of an operand of `shape` (grouped into `groups`) scaled as `scales`."""
    if scales.block is not None:
        return tuple(scaling.scale_shape(shape, scales.block))
    return (groups, shape[1 - scales.group_dim]) if scales.lines else (groups,)


def padded_extent(extent, groups: int, align: int):
    """A static bound on the grouped dimension once every group is padded to a multiple of `align`
    (`extent` may be symbolic), itself a multiple of `align`."""
    return (extent + groups * (align - 1) + align - 1) // align * align


def rowwise_layout(scales: tuple[OperandScales, OperandScales]) -> bool:
    """Whether both operands' scales are one per group or per row / column (what
    `torch._scaled_grouped_mm` takes, with a per-group scale expanded), not blocks along K."""
    return all(s.per_group or s.block in ((1, 0), (0, 1), (0, 0)) for s in scales)


def gpu_kernel(formats: tuple[str, str], scales: tuple[OperandScales, OperandScales], triton: bool) -> tuple[str, str]:
    """What runs an FP8 grouped GEMM on a GPU, and why (`fp8fx.ops.cuda`): "scaled_grouped_mm"
    (`torch._scaled_grouped_mm`: two E4M3 operands, scales per group or per row / column), "triton"
    (the generated grouped kernel, `triton` when it is there: any FP8 pair, scales also in blocks
    along K), or "emulated" (without Triton: the exact reference, one GEMM per group in torch ops)."""
    rowwise = rowwise_layout(scales)
    if rowwise and formats == ("e4m3", "e4m3"):
        return "scaled_grouped_mm", "E4M3 operands with per-group or per-row scales: torch._scaled_grouped_mm"
    why = "an E5M2 operand, which torch._scaled_grouped_mm does not take" if rowwise else "scales in blocks along K"
    if triton:
        return "triton", f"{why}: the generated grouped kernel" + (
            "" if rowwise else ", promoting each K block (MX on Blackwell: its block-scaled MMA)"
        )
    return (
        "emulated",
        f"{why}, and no Triton for the generated grouped kernel: the exact emulation in torch ops, one GEMM per group",
    )
