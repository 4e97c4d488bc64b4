"""The matrix products fp8fx knows, as data: one row per pattern.

A row says where an op's operands are, how its dimensions are read, whether a policy can enable
it for FP8 and under which op kind, whether ONNX export can write it, and how the cost model
times it. `find_matmuls`, `assign_precision`, the policy's op kinds, analysis, export, the cost
model and the backend's list of ops kept whole through decomposition all read this table; a new
GEMM form is a new row (plus, for an FP8 form, its lowering).

Dimensions: the left operand is [batch?, M, K], the right [batch?, K, N]; `batched` rows have the
leading batch dimension. A grouped GEMM (`offsets` set: mixture-of-experts layers) takes group
offsets, the cumulative ends of its groups: 2-D x 3-D multiplies each group of the left operand's
rows by its own matrix of the right ([M_total, K] x [G, K, N] -> [M_total, N]: the forward and the
input gradient), 2-D x 2-D splits K into groups and gives one product per group ([M, K_total] x
[K_total, N] -> [G, M, N]: the weight gradient). Both count as one M x N x K GEMM (M or K the total
over the groups: every routed row once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._ops import OpOverload

aten = torch.ops.aten


@dataclass(frozen=True)
class GemmPattern:
    kind: str  # the op kind reports and policy rules use
    target: OpOverload | None  # the ATen op (None: a kind made by an fp8fx lowering, or a family matched by predicate)
    left: int = 0  # argument positions of the left and right operand, and of the added term (None: none)
    right: int = 1
    added: int | None = None
    offsets: int | None = None  # argument position of a grouped GEMM's group offsets
    batched: bool = False
    policy_kind: str | None = None  # the op kind a policy enables it under (None: a policy cannot)
    rewrite: str | None = "scaled_mm"  # how an FP8 decision is lowered: "scaled_mm" | "grouped_mm" (None: it always stays high)
    exportable: bool = False  # ONNX QDQ export writes it in FP8 (a weight on the right)
    high_reason: str = ""  # why a pattern that is never rewritten stays high
    cost: str = "gemm"  # how the cost model times it: "gemm" (waves of tiles), "grouped_gemm", "fused_attention", "implicit_gemm"


_ADDBMM = (
    "aten.addbmm sums its batch of products into one matrix, which fp8fx does not rewrite; its backward GEMMs are "
    "bmms (policy op kind bmm)"
)

PATTERNS: tuple[GemmPattern, ...] = (
    GemmPattern("mm", aten.mm.default, policy_kind="mm", exportable=True),
    GemmPattern("addmm", aten.addmm.default, 1, 2, added=0, policy_kind="addmm", exportable=True),
    GemmPattern("bmm", aten.bmm.default, batched=True, policy_kind="bmm"),
    GemmPattern("baddbmm", aten.baddbmm.default, 1, 2, added=0, batched=True, policy_kind="baddbmm"),
    # Bias plus the sum of a batch of products: the forward stays high, its backward GEMMs are bmms.
    GemmPattern("addbmm", aten.addbmm.default, 1, 2, added=0, batched=True, policy_kind="bmm", rewrite=None, high_reason=_ADDBMM),
    # Grouped GEMMs of mixture-of-experts layers (torch._grouped_mm, and transformers' grouped-mm
    # custom op, matched as one in fp8fx.passes.find_matmuls): FP8 with one scale set per group.
    GemmPattern(
        "grouped_mm", aten._grouped_mm.default, offsets=2, policy_kind="grouped_mm", rewrite="grouped_mm", cost="grouped_gemm"
    ),
    # A patch convolution lowered to a GEMM (fp8fx.passes.lower_patch_convs): mm / addmm nodes.
    GemmPattern("conv_patch", None, policy_kind="conv_patch"),
    # Fused attention kernels (every _scaled_dot_product_* op): high, their FLOPs reported.
    GemmPattern("sdpa", None, rewrite=None, cost="fused_attention"),
    # Convolutions and their backward: high, as implicit GEMMs (see find_matmuls).
    GemmPattern("conv", aten.convolution.default, rewrite=None, cost="implicit_gemm"),
)

BY_TARGET: dict[OpOverload, GemmPattern] = {p.target: p for p in PATTERNS if p.target is not None and p.kind != "conv"}
BY_KIND: dict[str, GemmPattern] = {p.kind: p for p in PATTERNS}
# The op kinds a policy's `ops` and rules can name.
POLICY_KINDS: tuple[str, ...] = tuple(dict.fromkeys(p.policy_kind for p in PATTERNS if p.policy_kind))

# Matrix products fp8fx does not rewrite, and the position of their left operand (the right one
# follows it). Each output element is a dot product over the left operand's last dimension K, so
# FLOPs = 2 * K * output elements; a grouped GEMM of two 2-D operands splits K into groups, one
# output matrix per group, so its FLOPs are 2 * K * M * N. Grouped GEMMs count every row (column)
# as covered by their data-dependent offsets, an upper bound that MoE routing meets. (An FP8
# grouped GEMM, torch._scaled_grouped_mm, is another recipe's: fp8fx keeps it as it is.)
# CompositeImplicitAutograd ops (linear, matmul, einsum, ...) are not listed: they never reach an
# ATen graph, which holds their mm/bmm instead.
OPAQUE: dict[OpOverload, int] = {
    aten.mv.default: 0,
    aten.addmv.default: 1,
    aten.dot.default: 0,
    aten.vdot.default: 0,
    aten._addmm_activation.default: 1,
    aten._int_mm.default: 0,
    aten._scaled_mm.default: 0,
    aten._scaled_grouped_mm.default: 0,
    aten._weight_int8pack_mm.default: 0,
    aten._weight_int4pack_mm.default: 0,
    aten._weight_int4pack_mm_for_cpu.default: 0,
    aten._dyn_quant_matmul_4bit.default: 0,
}
GROUPED = (aten._grouped_mm.default, aten._scaled_grouped_mm.default)
# The grouped GEMM's operand forms fp8fx lowers to FP8 (left rank, right rank): 3-D left operands
# (torch._grouped_mm's 3-D x 2-D and 3-D x 3-D) stay high.
GROUPED_FORMS = {(2, 3): "2d-3d", (2, 2): "2d-2d"}
