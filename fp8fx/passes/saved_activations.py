"""saved_activations: keep what backward reads in FP8 (E4M3 or E5M2, a scale per row or 1x128 group).

FP8 GEMMs already keep their operands for backward in FP8; everything else backward reads (a norm's
input, attention's q, k, v and output, an activation's input, a residual) stays in the model's
precision. With `saved_activations="fp8"` (backend option, or the policy's `saved_activations`
section) those tensors are kept as FP8 too: the FP8 copy and its fp32 scale inverses.

This runs on the partitioned graphs, right after min-cut has chosen what forward saves: exactly
those tensors change, not the ones min-cut would have recomputed (rewritten on the joint graph, a
gated MLP kept its gate, its up projection and their product, three FP8 tensors where min-cut keeps
two). Forward casts each chosen tensor right after producing it (`fp8fx::amax`, `amax_to_scale`,
`cast`, `scale_inverse`, which Inductor fuses into the producing kernel as it fuses any cast) and
returns the FP8 tensor in its place among the saved values, the scale inverses after them;
backward takes them as inputs and widens the tensor (`fp8fx::widen`) where it first reads it. The
high-precision tensor is then dead once forward's own readers are done with it: backward never
holds it.

Several saved views of one storage are cast together (one kept high keeps the storage alive):
each alone, or the storage once and the views taken again in backward (grouped-query attention's
K and V, expanded per head, are larger than their storage), whichever keeps fewer bytes.

A saved tensor stays in its precision, with the reason in the report (`_why_high`), when it is a
graph input (a parameter, the model's input: alive anyway), a forward output, not floating point,
already FP8, attention's softmax statistics or mask, a table broadcast over larger tensors, of
dynamic size, or too small for FP8 to save bytes (scales included). The policy chooses per module
and kind (`fp8fx.core.policy.SavedActivations`).
"""

from __future__ import annotations

import math
import operator
from dataclasses import asdict, dataclass

import torch
from torch import fx

from fp8fx.core.formats import FP8_DTYPES
from fp8fx.core.policy import SAVED_BLOCKS, Precision, SavedActivations
from fp8fx.passes.find_matmuls import dim_hint, module_fqn
from fp8fx.passes.graph_utils import add_node, fake_mode_of

fp8fx_ops = torch.ops.fp8fx
_WIDE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MIN_NUMEL = 256  # smaller tensors stay: their bytes do not matter, and scales would cost more
_MAX_KEPT_FRACTION = 0.75  # FP8 with its scales must keep at most this share of the bytes


@dataclass(frozen=True)
class SavedTensor:
    """One tensor forward saves for backward: what it is, and how it is kept."""

    name: str  # the forward graph's node
    module: str  # module FQN of the op that made it
    kind: str  # attention | norm | activation | other (fp8fx.core.policy.SAVED_KINDS)
    shape: tuple[int, ...]
    dtype: str  # as produced
    kept_as: str  # "e4m3 rowwise", "e5m2 1x128", ..., or the dtype it stays in
    bytes_high: int  # bytes of its storage in the precision it was made in
    bytes_kept: int  # bytes kept for backward (FP8 values and scales, or bytes_high)
    reason: str  # the policy entry that chose FP8, or why it stays

    @property
    def fp8(self) -> bool:
        return self.kept_as.startswith(("e4m3 ", "e5m2 "))

    def to_dict(self) -> dict:
        return {**asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict) -> SavedTensor:
        return cls(**{**d, "shape": tuple(d["shape"])})


def _passes_through(node: fx.Node) -> bool:
    """A view or a dtype conversion: the same values, for what reads a tensor."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return target.is_view or target in (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _storage_root(node: fx.Node) -> fx.Node:
    """The node whose output `node` is a view of (itself when it is not a view)."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        node = node.args[0]
    return node


def _source(node: fx.Node) -> fx.Node:
    """What `node` is a view or conversion of."""
    while node.op == "call_function" and _passes_through(node):
        node = node.args[0]
    return node


def _readers(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(`node` and its views and conversions, the ops that read any of them and are neither)."""
    family, readers, todo = [], [], [node]
    while todo:
        n = todo.pop()
        family.append(n)
        for u in n.users:
            if u.op == "call_function":
                (todo if _passes_through(u) else readers).append(u)
    return family, readers


_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_NORM = ("native_layer_norm", "_fused_rms_norm", "var_mean", "mean.dim", "sum.dim_IntList", "var.correction")
_ACTIVATION = ("gelu", "silu", "sigmoid", "tanh", "relu", "erf", "softplus", "mish", "hardswish")


def _name(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_function" else ""


def _attention_role(node: fx.Node) -> str | None:
    """For a saved tensor of an attention op: "data" for its q, k, v and output (kept in FP8 like
    any activation), "statistics" for the rest it saves (the softmax's logsumexp, an attention mask,
    random seeds: kept exact, backward recomputes the softmax from them); None elsewhere."""
    root = _source(node)
    if root.target is operator.getitem and any(k in _name(root.args[0]) for k in _ATTENTION):
        return "data" if root.args[1] == 0 else "statistics"
    _, readers = _readers(_storage_root(node))
    roles = []
    for r in readers:
        if any(k in _name(r) for k in _ATTENTION):
            given = [*enumerate(r.args), *r.kwargs.items()]  # q, k, v come first; a mask may come by name
            roles += ["data" if where in (0, 1, 2) else "statistics" for where, arg in given if _reads(arg, node)]
    if not roles:
        return None
    return "data" if all(r == "data" for r in roles) else "statistics"


def _broadcast(node: fx.Node) -> bool:
    """Whether forward reads `node`, or an elementwise function of it (a rotary table's cos and sin),
    broadcast against a larger tensor: a position table, a mask, a norm's statistics."""
    numel = _numel(node.meta["val"])
    frontier = [_storage_root(node)]
    for _ in range(3):
        following = []
        for n in frontier:
            for r in _readers(n)[1]:
                out = r.meta.get("val")
                if not isinstance(out, torch.Tensor) or torch.Tag.pointwise not in getattr(r.target, "tags", ()):
                    continue
                size = _numel(out)
                if numel is not None and size is not None and size > numel:
                    return True
                following.append(r)
        frontier = following
    return False


def _reads(arg, node: fx.Node) -> bool:
    return isinstance(arg, fx.Node) and _source(arg) is _source(node)


def classify(node: fx.Node) -> str:
    """Which kind of op forward made `node` for, by what reads it in forward: attention (an input or
    output of an attention op), norm (a normalisation reads it, directly or squared), activation (an
    activation function reads it, or multiplies by one's output: a gated MLP's up projection), other."""
    if _attention_role(node) is not None:
        return "attention"
    family, readers = _readers(_storage_root(node))
    squares = [r2 for r in readers if _name(r).startswith(("aten.pow", "aten.mul")) for r2 in _readers(r)[1]]
    if any(k in _name(n) for n in readers + squares for k in _NORM):
        return "norm"
    gated = [_source(a) for r in readers if _name(r).startswith("aten.mul") for a in r.all_input_nodes if a not in family]
    if any(k in _name(n) for n in readers + gated for k in _ACTIVATION):
        return "activation"
    return "other"


def _numel(val: torch.Tensor) -> int | None:
    """Elements of `val`, from the compile's hints where a size is symbolic (no guard: the graph stays
    dynamic); None where a size has no hint."""
    sizes = [dim_hint(d) for d in val.shape]
    return None if None in sizes else math.prod(sizes)


def _fp8_bytes(val: torch.Tensor, block: list[int]) -> int:
    """Bytes of `val` in FP8 with an fp32 scale per `block` of its rows (sizes hinted)."""
    numel, cols = _numel(val), dim_hint(val.shape[-1])
    return numel + 4 * (numel // cols) * -(-cols // (block[1] or cols))


def keep_saved_in_fp8(
    forward: fx.GraphModule, backward: fx.GraphModule, num_fwd_outputs: int, policy: SavedActivations, default: Precision
) -> list[SavedTensor]:
    """Rewrite a partitioned forward and backward pair so that the saved tensors the policy puts in
    FP8 are kept as FP8 (see the module's docstring); returns a `SavedTensor` for every saved tensor
    of at least `_MIN_NUMEL` elements that is not a graph input. `default`: the precision where the
    policy sets none."""
    outs = list(forward.graph.output_node().args[0])
    saved = [n for n in outs[num_fwd_outputs:] if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]
    user_outputs = {_storage_root(n) for n in outs[:num_fwd_outputs] if isinstance(n, fx.Node)}
    by_root: dict[fx.Node, list[fx.Node]] = {}
    for node in saved:
        by_root.setdefault(_storage_root(node), []).append(node)

    records: dict[fx.Node, SavedTensor] = {}
    casts: dict[fx.Node, tuple] = {}  # node cast to FP8 -> (format, blocks of its scales, saved views of it)
    for root, nodes in by_root.items():
        numel = _numel(root.meta["val"])
        if root.op == "placeholder" or (numel is not None and numel < _MIN_NUMEL):
            continue  # parameters and inputs (alive anyway); scales and a norm's statistics
        module, kind = module_fqn(root), classify(root)
        precision, fmt, granularity, source = policy.resolve(module, kind, default)
        block = list(SAVED_BLOCKS[granularity])
        high = numel * root.meta["val"].element_size() if numel is not None else 0
        # Views of one storage go to FP8 together, or stay together: one kept high keeps it alive.
        why = next((w for w in (_why_high(n, root in user_outputs) for n in nodes) if w), None)
        if why is None and precision is Precision.HIGH:
            why = f"the policy's {source}"
        # Each view cast alone, or the storage cast once and viewed again in backward (an expanded
        # K or V of grouped-query attention is larger than its storage): the fewer bytes.
        plan = {n: (fmt, block, [n]) for n in nodes}
        whole = why is None and nodes != [root] and _replayable(root, nodes) and _why_high(root, False) is None
        if whole and _fp8_bytes(root.meta["val"], block) < sum(_fp8_bytes(n.meta["val"], block) for n in nodes):
            plan = {root: (fmt, block, nodes)}
        kept = sum(_fp8_bytes(n.meta["val"], block) for n in plan) if why is None else high
        if why is None and kept > _MAX_KEPT_FRACTION * high:
            why = "too small for FP8 to save bytes (its scales)"
        total = sum(_numel(n.meta["val"]) or 0 for n in nodes) or 1
        for node in nodes:
            v = node.meta["val"]
            dtype = str(v.dtype).removeprefix("torch.")
            share = high * (_numel(v) or 0) // total
            if why is None:
                kept_as, mine, reason = f"{fmt.value} {granularity.value}", kept * _numel(v) // total, f"the policy's {source}"
            else:
                kept_as, mine, reason = dtype, share, why
            records[node] = SavedTensor(node.name, module, kind, tuple(v.shape), dtype, kept_as, share, mine, reason)
        if why is None:
            casts.update(plan)
    if casts:
        _rewrite(forward, backward, outs, num_fwd_outputs, casts)
    return [records[n] for n in saved if n in records]


def _view_chain(root: fx.Node, node: fx.Node) -> list[fx.Node]:
    """The views that make `node` from `root`, first to last."""
    chain = []
    while node is not root:
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def _replayable(root: fx.Node, nodes: list[fx.Node]) -> bool:
    """Whether backward can take each of `nodes` from `root` again (views of constant arguments)."""
    return all(
        not any(isinstance(a, fx.Node) for a in (*v.args[1:], *v.kwargs.values())) for n in nodes for v in _view_chain(root, n)
    )


def _why_high(node: fx.Node, forward_output: bool) -> str | None:
    """Why a saved tensor cannot be kept in FP8, or None."""
    val = node.meta["val"]
    if val.dtype in FP8_DTYPES:
        return "already FP8 (an FP8 GEMM's operand)"
    if val.dtype not in _WIDE_DTYPES:
        return f"not floating point ({str(val.dtype).removeprefix('torch.')})"
    if forward_output:
        return "a forward output too: alive anyway"
    if _attention_role(node) == "statistics":
        return "attention's softmax statistics or mask: backward recomputes the softmax from them exactly"
    if _numel(val) is None or not isinstance(val.shape[-1], int):
        return "a size without a hint, or a dynamic last dimension"
    if _broadcast(node):
        return "a table forward broadcasts over larger tensors (rotary embeddings, a mask): one error would reach every row"
    if val.dim() < 2:
        return "one dimension: no rows to scale"
    return None


def _fresh_name(graph: fx.Graph, base: str) -> str:
    """A name no node of `graph` has: a placeholder's code takes its target as the argument's name,
    which must not be any other node's variable."""
    names = {n.name for n in graph.nodes}
    name, i = base, 0
    while name in names:
        name, i = f"{base}_{i}", i + 1
    return name


def _rewrite(forward: fx.GraphModule, backward: fx.GraphModule, outs: list, num_fwd_outputs: int, casts: dict) -> None:
    """Forward casts each node of `casts` and saves the FP8 tensor and its scale inverses in place of
    the saved views of it; backward widens it and takes the views again."""
    saved = [n for n in outs[num_fwd_outputs:] if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]
    inputs = {p.name: p for p in backward.graph.find_nodes(op="placeholder")}
    missing = [n.name for n in saved if n.name not in inputs]
    if missing:  # (min-cut names backward's inputs after the forward values they receive)
        raise RuntimeError(f"fp8fx: saved_activations: backward has no input named for the saved tensors {missing}")
    # Backward receives the saved tensors in forward's order, after the saved symbolic sizes (which
    # forward returns last): the scale inverses go after the last saved tensor, in both graphs.
    anchor = inputs[saved[-1].name]
    first_op = next(n for n in backward.graph.nodes if n.op != "placeholder")
    fw_mode = fake_mode_of(forward.graph)
    replaced: dict[fx.Node, fx.Node | None] = {}  # saved node -> what forward returns instead (None: nothing)
    inverses = []
    for node, (fmt, block, views) in casts.items():
        with forward.graph.inserting_before(node.next):
            amax = add_node(forward.graph, fw_mode, fp8fx_ops.amax.default, (node, block), tag_from=node)
            scale = add_node(forward.graph, fw_mode, fp8fx_ops.amax_to_scale.default, (amax, fmt.max, 0, False), tag_from=node)
            q = add_node(forward.graph, fw_mode, fp8fx_ops.cast.default, (node, scale, fmt.dtype, block), tag_from=node)
            inverse = add_node(forward.graph, fw_mode, fp8fx_ops.scale_inverse.default, (scale,), tag_from=node)
        inverses.append(inverse)
        first = min(views, key=saved.index)
        replaced.update({v: None for v in views})
        replaced[first] = q

        with backward.graph.inserting_before(inputs[first.name]):
            q_in = backward.graph.placeholder(_fresh_name(backward.graph, f"{node.name}_fp8"))
        with backward.graph.inserting_after(anchor):
            inverse_in = anchor = backward.graph.placeholder(_fresh_name(backward.graph, f"{node.name}_scale_inv"))
        q_in.meta["val"], inverse_in.meta["val"] = q.meta["val"], inverse.meta["val"]
        with backward.graph.inserting_before(first_op):  # (moved to its first reader by recompute_at_first_use)
            dtype = node.meta["val"].dtype
            widened = add_node(backward.graph, fw_mode, fp8fx_ops.widen.default, (q_in, inverse_in, dtype, block), tag_from=node)
            for view in views:
                value = widened
                for step in _view_chain(node, view):
                    value = backward.graph.node_copy(step, lambda a, prev=value, src=step.args[0]: prev if a is src else a)
                wide = inputs[view.name]
                wide.replace_all_uses_with(value)
                backward.graph.erase_node(wide)
    kept = [replaced.get(n, n) for n in outs[num_fwd_outputs:]]
    kept = [n for n in kept if n is not None]
    last = max(i for i, n in enumerate(kept) if isinstance(n.meta.get("val"), torch.Tensor)) + 1
    forward.graph.output_node().args = ((*outs[:num_fwd_outputs], *kept[:last], *inverses, *kept[last:]),)
    for gm in (forward, backward):
        gm.graph.lint()
        gm.recompile()
