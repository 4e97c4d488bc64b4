"""assign_precision: give every GEMM of every site a `Decision` - FP8 and how, or high and why.

Writes each GEMM's `GemmAnnotation` only; the graph is unchanged (annotate, then convert)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import fx

from fp8fx.core import grouped as grouped_scales
from fp8fx.core.patterns import BY_KIND
from fp8fx.core.policy import Policy, Settings
from fp8fx.core.recipes import ALIGN, GEMM_ROLES, GRANULARITIES, Granularity, Hadamard, Precision, Scaling
from fp8fx.passes.annotation import Decision, DelayedSpec, GemmAnnotation, ReasonKind, annotate
from fp8fx.passes.find_matmuls import (
    Gemm,
    MatmulSite,
    conv_params,
    custom_op_name,
    describe_call,
    fused_backward,
    group_offsets,
    grouped,
    is_opaque,
    matmul_operands,
    parameter_stack_pick,
    pattern_of,
)
from fp8fx.passes.graph_utils import PassContext, PassResult, op_args, strip_layout
from fp8fx.passes.lower_patch_convs import is_patch_conv

FP8_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# The operands of each backward GEMM when they cannot be told by identity (one op computing both gradients).
_CONVENTIONAL_ROLES = {"grad_input": ("grad_output", "weight"), "grad_weight": ("input", "grad_output")}


def _operand_roles(site: MatmulSite, gemm: Gemm) -> tuple[str, str]:
    """Roles of the GEMM's left and right operand. The site's weight is the forward operand
    find_matmuls found computed from parameters (the right one when that does not tell); a
    backward operand is the weight or the input when it is made from the same tensor as that
    forward operand, the incoming gradient otherwise."""
    if site.op == "sdpa":
        return ("input", "input") if gemm.role == "output" else ("grad_output", "input")
    if site.op == "conv":
        return ("input", "weight") if gemm.role == "output" else _CONVENTIONAL_ROLES[gemm.role]
    if fused_backward(gemm.node):
        return _CONVENTIONAL_ROLES[gemm.role]
    if gemm.role == "output":
        return ("weight", "input") if site.weight_operand == 0 else ("input", "weight")
    fwd = site.forward
    if fwd is None:
        return ("grad_output", "grad_output")
    f_operands = matmul_operands(fwd.node)[:2]
    f_input, f_weight = f_operands[1 - site.weight_operand], f_operands[site.weight_operand]
    by_root = {strip_layout(f_input)[0]: "input", strip_layout(f_weight)[0]: "weight"}
    left, right, _ = matmul_operands(gemm.node)
    roles = [by_root.get(strip_layout(x)[0], "grad_output") for x in (left, right)]
    if "grad_output" not in roles:  # x @ x: one of the two must be the incoming gradient
        roles[0] = "grad_output"
    return roles[0], roles[1]


def _shape_problem(n, k, granularity: Granularity) -> str | None:
    """Why FP8 GEMMs of `granularity` cannot take the forward GEMM's (N, K): each granularity says
    what they must be multiples of (16; MX's 32-element blocks: 32)."""
    align = GRANULARITIES[granularity].align
    which = "FP8 GEMMs" if align == ALIGN else f"{granularity.value} FP8 GEMMs"
    for dim_name, dim in (("N", n), ("K", k)):
        if not isinstance(dim, int):
            return f"{dim_name}={dim} is dynamic; {which} need a static {dim_name} that is a multiple of {align}"
        if dim % align:
            return f"{dim_name}={dim} is not a multiple of {align} ({which} need N and K % {align} == 0)"
    return None


def _operand_problem(node: fx.Node, settings: Settings) -> tuple[ReasonKind, str] | None:
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return ReasonKind.PATTERN, f"{node.target.__name__} with alpha/beta other than 1 is not rewritten"
    left, right, _ = matmul_operands(node)
    for x in (left, right):
        dtype = x.meta["val"].dtype
        if dtype not in FP8_INPUT_DTYPES:
            return ReasonKind.DTYPE, f"operand dtype {dtype} is not one fp8fx casts to FP8 (fp32, bf16, fp16)"
    offs = group_offsets(node)
    return _grouped_problem(node, offs, settings) if offs is not None else None


def _grouped_problem(node: fx.Node, offs: fx.Node, settings: Settings) -> tuple[ReasonKind, str] | None:
    """What keeps a grouped GEMM (op kind grouped_mm) high that no other GEMM has."""
    left, right, _ = matmul_operands(node)
    if not fused_backward(node):
        a, b = left.meta["val"], right.meta["val"]
        if grouped_scales.form_of(a.dim(), b.dim()) is None:
            return ReasonKind.PATTERN, (
                f"{describe_call(node)}: a grouped GEMM of a {a.dim()}-D x {b.dim()}-D form; fp8fx lowers 2-D x 3-D and 2-D x 2-D"
            )
        if op_args(node).get("bias") is not None:
            return ReasonKind.PATTERN, f"{describe_call(node)}: a grouped GEMM with a bias is not rewritten"
    if offs.meta["val"].dtype != torch.int32:
        return ReasonKind.DTYPE, f"group offsets of dtype {offs.meta['val'].dtype}; FP8 grouped GEMMs take int32 offsets"
    return grouped_settings_problem(settings)


def grouped_settings_problem(settings: Settings) -> tuple[ReasonKind, str] | None:
    """What in the resolved settings keeps every grouped GEMM high (their recipe has no grouped lowering)."""
    if settings.granularity is Granularity.NVFP4:
        return ReasonKind.PATTERN, (
            "NVFP4's two-level scales are not lowered for grouped GEMMs: "
            "a rule with op: [grouped_mm] and an FP8 recipe runs them in FP8"
        )
    if settings.scaling is Scaling.DELAYED:
        return ReasonKind.PATTERN, (
            "delayed scaling keeps one scale per tensor and grouped GEMMs take one per group: "
            "a rule with op: [grouped_mm] and scaling: dynamic runs them in FP8"
        )
    return None


def _grouped_note(gemm: Gemm, decision: Decision) -> str:
    """What an FP8 grouped GEMM's reason adds: its groups, where its scales go, padding."""
    node = gemm.node
    if fused_backward(node):
        form = "2d-3d" if gemm.role == "grad_input" else "2d-2d"
    else:
        left, right, _ = matmul_operands(node)
        form = grouped_scales.form_of(left.meta["val"].dim(), right.meta["val"].dim())
    specs = [grouped_scales.operand_scales(form, side, block) for side, block in enumerate(decision.blocks)]
    per_group = [s for s in specs if s.per_group]
    scales = "scales per group" if per_group and not any(s.lines for s in per_group) else "scales within each group"
    align = max(s.align for s in specs)
    pad = f"; each group's K padded to a multiple of {align} (blocks along K)" if align > 1 else ""
    return (
        f"; grouped {form} GEMM of {gemm.groups} groups, {scales}{pad}; FLOPs count every row as routed (its offsets "
        "are data-dependent)"
    )


def _opaque_reason(site: MatmulSite, gemm: Gemm) -> str:
    node = gemm.node
    if not is_opaque(node):  # a plain GEMM in the backward of an opaque op
        return f"backward GEMM of {site.op}, which fp8fx does not rewrite; kept in the model's precision"
    inside = "fp8fx cannot rewrite inside it" if custom_op_name(node) else "fp8fx does not rewrite it"
    if gemm.flops_hinted:
        flops = "; FLOPs from the compile's shape hints (dynamic shape)"
    elif not gemm.flops_known:
        flops = "; FLOPs unknown" if gemm.m is None else "; FLOPs unknown (dynamic shape)"
    else:
        flops = "; FLOPs count every row as routed (its offsets are data-dependent)" if grouped(node) else ""
    return f"{describe_call(node)}: {inside}; kept in the model's precision{flops}"


def _conv_reason(node: fx.Node) -> str:
    """`aten.convolution(...) -> ...: convolution (depthwise: ...; overlapping windows: stride 1 < kernel 4): ...`."""
    p = conv_params(node)
    forms = []
    if p.transposed:
        forms.append("transposed")
    if p.groups > 1:
        forms.append(f"depthwise: groups == C_in == {p.groups}" if p.groups == p.in_channels else f"grouped: groups={p.groups}")
    if any(s < k for s, k in zip(p.stride, p.kernel)):
        forms.append(f"overlapping windows: stride {_dims_text(p.stride)} < kernel {_dims_text(p.kernel)}")
    if any(p.padding):
        forms.append(f"padded: padding {_dims_text(p.padding)}")
    if any(d != 1 for d in p.dilation):
        forms.append(f"dilated: dilation {_dims_text(p.dilation)}")
    form = f" ({'; '.join(forms)})" if forms else ""
    hint = "; its patches do not overlap: add conv_patch to ops to run it in FP8" if is_patch_conv(node) else ""
    return f"{describe_call(node)}: convolution{form}: fp8fx runs convolutions in high precision{hint}"


def _dims_text(dims: tuple) -> str:
    return "x".join(str(d) for d in dims)


def decide(site: MatmulSite, gemm: Gemm, ctx: PassContext) -> Decision:
    roles = _operand_roles(site, gemm)

    def high(kind: ReasonKind, reason: str) -> Decision:
        return Decision(Precision.HIGH, kind, reason, roles)

    if site.op == "sdpa":
        kernel = gemm.node.target.overloadpacket.__name__
        return high(
            ReasonKind.OP_KIND,
            f"fused attention kernel aten.{kernel}: FP8 attention is not supported; runs in the model's precision",
        )
    if site.op == "conv":
        return high(ReasonKind.CONV, _conv_reason(gemm.node))
    if site.opaque or is_opaque(gemm.node):
        return high(ReasonKind.OPAQUE, _opaque_reason(site, gemm))
    pattern = pattern_of(gemm.node)
    if pattern is not None and pattern.rewrite is None:
        return high(ReasonKind.PATTERN, pattern.high_reason)
    if site.forward is None:
        return high(ReasonKind.UNLINKED, "backward GEMM with no forward matmul to link it to; kept high")
    if (site.name, gemm.role) in ctx.overrides:
        return high(ReasonKind.SHADOW, ctx.overrides[(site.name, gemm.role)])
    vector = _expert_vector_problem(site, gemm)
    if vector:
        return high(ReasonKind.SHAPE, vector)
    dims = (site.forward.n, site.forward.k)
    timing = ctx.bf16_faster.get((site.name, gemm.role))
    decision = policy_decision(
        ctx.options.policy,
        site.names,
        site.op,
        gemm.role,
        roles,
        dims,
        lambda s: _operand_problem(gemm.node, s),
        timing.bf16_faster() if timing else "",
    )
    if decision.fp8 and gemm.groups is not None:
        decision = replace(decision, reason=decision.reason + _grouped_note(gemm, decision))
    return decision


def _expert_vector_problem(site: MatmulSite, gemm: Gemm) -> str | None:
    """Why a batched matmul of one routed token by its expert's matrix (transformers'
    `experts_implementation="batched_mm"`: `bmm(W[expert_ids], x[:, :, None])`) stays high."""
    fwd = site.forward
    if site.op != "bmm" or fwd is None or not any(d == 1 for d in (fwd.m, fwd.n)):
        return None
    if not any(parameter_stack_pick(x) for x in matmul_operands(fwd.node)[:2]):
        return None
    vector = "N=1" if fwd.n == 1 else "M=1"
    return (
        f"one routed token per product: a batch of {fwd.batch} matrix-vector products of {fwd.m} x {fwd.k} by {fwd.k} x {fwd.n} "
        f"with each token's expert matrix (transformers' batched_mm experts); {vector}, and FP8 GEMMs need N and K % 16 == 0. "
        "fp8fx rewrites these into grouped GEMMs where the module's policy runs grouped_mm in FP8 (in bf16, "
        "or with transformers' grouped-mm op registered), which it does not here"
    )


def policy_decision(
    policy: Policy,
    names: tuple[str, ...],
    kind: str,
    role: str,
    roles: tuple[str, str],
    dims: tuple,
    operand_problem: Callable[[Settings], tuple[ReasonKind, str] | None] = lambda settings: None,
    bf16_faster: str = "",
) -> Decision:
    """The policy's decision for one GEMM of a pattern fp8fx rewrites: site `names`, pattern `kind`,
    GEMM `role`, operand `roles` and the forward GEMM's (N, K); `operand_problem(settings)` says
    what keeps this GEMM's operands high under the resolved settings; `bf16_faster`, why it was
    measured slower in FP8 than in BF16 on its GPU (`fp8fx.passes.prefer_bf16`), which keeps it
    high unless a rule sets its precision. The one place a policy is turned into a decision: the
    passes and the FP8 all-gather (fp8fx.distributed) both call it."""

    def high(reason_kind: ReasonKind, reason: str) -> Decision:
        return Decision(Precision.HIGH, reason_kind, reason, roles, source=where)

    op = BY_KIND[kind].policy_kind
    res = policy.resolve(names, op)
    where = policy.describe(res)
    if op not in res.settings.ops and not res.forced_fp8:
        ops = ", ".join(res.settings.ops)
        shown = op if op == kind else f"{op} ({kind}'s backward GEMMs)"
        return high(ReasonKind.OP_KIND, f"op {shown} is not in defaults.ops [{ops}]; a rule with precision: fp8 enables it")
    if res.settings.gemms[role] is Precision.HIGH:
        return high(ReasonKind.POLICY, f"{res.gemm_sources[role]}: high")
    problem = _shape_problem(*dims, res.settings.granularity)
    if problem:
        return high(ReasonKind.SHAPE, problem)
    problem = operand_problem(res.settings)
    if problem:
        return high(*problem)
    if bf16_faster and not res.gemm_sources[role].startswith("rules["):  # a rule's fp8 is the user's choice
        return high(ReasonKind.MEASURED, f"{bf16_faster}; a rule with precision: fp8 or gemms: {{{role}: fp8}} keeps it in FP8")
    settings = res.settings
    mx = settings.granularity is Granularity.MX
    blocks = GRANULARITIES[settings.granularity].blocks(roles)
    # Scales in blocks along K promote every K-block's partial sum to fp32 (cuBLAS refuses fast
    # accumulation with them): the GEMM's accumulation is the promoted one whatever the policy says.
    k_blocked = (len(blocks[0]) == 2 and blocks[0][1] > 0) or (len(blocks[1]) == 2 and blocks[1][0] > 0)
    return Decision(
        Precision.FP8,
        ReasonKind.POLICY,
        f"{where}: fp8",
        roles,
        formats=(settings.format.operand_format(roles[0]), settings.format.operand_format(roles[1])),
        scaling=settings.scaling,
        granularity=settings.granularity,
        blocks=blocks,
        power_of_two=settings.power_of_two_scales or mx,  # MX scales are E8M0: powers of two
        margin=settings.margin,
        scale_rounding=settings.scale_rounding if mx else None,
        fast_accum=settings.fast_accum[role] and not k_blocked,
        stochastic_rounding=bool(settings.stochastic_rounding) and "grad_output" in roles,
        hadamard=settings.hadamard is Hadamard.WGRAD and role == "grad_weight",
        delayed=(
            DelayedSpec(settings.amax_history_len, settings.amax_compute_algo, settings.interval)
            if settings.scaling is Scaling.DELAYED
            else None
        ),
        source=where,
    )


def assign_precision(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    gemms = [(site, site.gemms[role]) for site in ctx.sites for role in GEMM_ROLES if role in site.gemms]
    for index, (site, gemm) in enumerate(gemms):
        decision = decide(site, gemm, ctx)
        annotate(
            gemm.node,
            GemmAnnotation(
                index,
                site.name,
                site.fqn,
                site.op,
                gemm.role,
                site.source,
                gemm.m,
                gemm.n,
                gemm.k,
                gemm.batch,
                gemm.flops,
                decision,
                groups=gemm.groups,
                flops_hinted=gemm.flops_hinted,
                measured=ctx.bf16_faster.get((site.name, gemm.role)) if decision.reason_kind is ReasonKind.MEASURED else None,
            ),
        )
    return PassResult(gm, modified=False)
