"""gathered_experts: rewrite mixture-of-experts GEMMs over gathered weights into grouped GEMMs.

`transformers`' `batched_mm` experts gather one weight matrix per routed token and multiply each by
its token alone: `bmm(W[expert_ids], x[:, :, None])` (or `bmm(x[:, None], W[expert_ids])` with
transposed weights), a batch of one-column GEMMs (N = 1) that no FP8 kernel speeds up, over an
[S, N, K] copy of the weights. The same products are one grouped GEMM over the tokens sorted by
expert: `_grouped_mm(x[order], W^T, offs)` with `offs` the cumulative group ends, put back in token
order. Autograd then derives the grouped dgrad and the grouped 2-D x 2-D wgrad (K = tokens per
expert) in place of per-token outer products, and fp8fx's grouped lowering runs all three in FP8.

This pass runs on Dynamo's graph, before aot_autograd traces the backward, and only where the
policy runs the module's grouped GEMMs in FP8 (`assign_precision.policy_decision` for op kind
grouped_mm, role output, by the module's FQN: site-name rules do not exist yet at this stage), in
bf16, or in other dtypes where `transformers`' grouped-mm op is registered.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fp8fx.core.policy import Policy
from fp8fx.passes.assign_precision import grouped_settings_problem, policy_decision
from fp8fx.passes.find_matmuls import module_fqn
from fp8fx.passes.graph_utils import copy_meta


def gathered_as_grouped(weight: torch.Tensor, expert_ids: torch.Tensor, x: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`bmm(weight[expert_ids], x.unsqueeze(-1))` ([E, N, K] weights), or with `transposed`
    `bmm(x.unsqueeze(1), weight[expert_ids])` ([E, K, N] weights), as one grouped GEMM over the
    rows of `x` sorted by expert (a stable sort: rows of one expert keep their order)."""
    order = torch.argsort(expert_ids, stable=True)
    experts = torch.arange(weight.shape[0], device=expert_ids.device, dtype=expert_ids.dtype)
    ends = torch.searchsorted(expert_ids[order], experts, right=True).to(torch.int32)
    grouped = _grouped_mm(weight.dtype)(x[order], weight if transposed else weight.transpose(-2, -1), offs=ends)
    out = torch.index_copy(torch.empty_like(grouped), 0, order, grouped)  # back in token order
    return out.unsqueeze(1) if transposed else out.unsqueeze(-1)


def _grouped_mm(dtype: torch.dtype):
    """The high-precision grouped GEMM that traces for `dtype`, or None: `torch._grouped_mm` takes
    bf16 only under compile; other dtypes take `transformers`' own fallback op (registered by its
    MoE integration, which `batched_mm` experts import), as its `grouped_mm` experts do."""
    if dtype == torch.bfloat16:
        return torch._grouped_mm
    return getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)


def _is(node, method: str, fn=None) -> bool:
    return isinstance(node, fx.Node) and (
        (node.op == "call_method" and node.target == method) or (node.op == "call_function" and node.target is fn)
    )


def _val(node: fx.Node):
    return node.meta.get("example_value")


def _gather(node) -> tuple[fx.Node, fx.Node] | None:
    """(weight, expert_ids) of `weight[expert_ids]`: a 3-D float tensor indexed by a 1-D integer one."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    weight, ids = node.args
    w, i = (_val(weight) if isinstance(weight, fx.Node) else None), (_val(ids) if isinstance(ids, fx.Node) else None)
    if not isinstance(w, torch.Tensor) or not isinstance(i, torch.Tensor):
        return None
    if w.dim() != 3 or not w.dtype.is_floating_point or i.dim() != 1 or i.dtype not in (torch.int32, torch.int64):
        return None
    return weight, ids


def _column(node, dim: int) -> fx.Node | None:
    """x of `x.unsqueeze(dim)` for a 2-D x (dim -1 / 2 makes columns, 1 rows)."""
    if not _is(node, "unsqueeze", torch.unsqueeze):
        return None
    x, d = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    v = _val(x) if isinstance(x, fx.Node) else None
    if not isinstance(v, torch.Tensor) or v.dim() != 2 or (d % 3) != dim:
        return None
    return x


def match(bmm: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, bool] | None:
    """(weight, expert_ids, x, transposed) of a gathered-weight bmm, else None."""
    if not _is(bmm, "bmm", torch.bmm) or len(bmm.args) != 2:
        return None
    left, right = bmm.args
    gathered, x = _gather(left), _column(right, 2)
    if gathered is not None and x is not None:
        return (*gathered, x, False)
    gathered, x = _gather(right), _column(left, 1)
    if gathered is not None and x is not None:
        return (*gathered, x, True)
    return None


def rewrite_gathered_experts(gm: fx.GraphModule, policy: Policy) -> int:
    """Rewrite every gathered-weight bmm whose module runs grouped GEMMs in FP8; returns how many."""
    count = 0
    for bmm in list(gm.graph.nodes):
        found = match(bmm)
        if found is None:
            continue
        weight, ids, x, transposed = found
        w = _val(weight)
        if _grouped_mm(w.dtype) is None or _val(x).dtype != w.dtype:
            continue  # (the bmm stays, with find_matmuls' reason)
        n, k = (w.shape[2], w.shape[1]) if transposed else (w.shape[1], w.shape[2])
        roles = ("input", "weight")
        decision = policy_decision(policy, (module_fqn(bmm),), "grouped_mm", "output", roles, (n, k), grouped_settings_problem)
        if not decision.fp8:
            continue
        gather = bmm.args[1 if transposed else 0]
        with gm.graph.inserting_before(bmm):
            grouped = gm.graph.call_function(gathered_as_grouped, (weight, ids, x, transposed))
        copy_meta(bmm, grouped)  # (a Dynamo graph: no partition or backward keys yet)
        bmm.replace_all_uses_with(grouped)
        gm.graph.erase_node(bmm)
        if not gather.users:
            gm.graph.erase_node(gather)
        count += 1
    if count:
        gm.recompile()
    return count
