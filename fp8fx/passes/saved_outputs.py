"""saved_outputs: keep FP8 GEMMs' outputs for backward in BF16, not fp32.

An fp32 model's FP8 GEMM still writes an fp32 output (and a fused epilogue's aux value), and the
elementwise ops after it (a gated MLP's SiLU and product, an unfused activation) read it again in
backward: autograd keeps the fp32 tensor alive from forward to backward. Here backward reads a
copy instead, `convert(fp8fx::saved_copy(y, bf16), fp32)`, and replicas of those elementwise ops
computed from it, so the partitioner (min-cut) saves the BF16 tensor and recomputes the rest in
backward: half the bytes. (The narrowing is an op of its own: as a plain dtype conversion min-cut
would fuse both conversions into backward and save the fp32 value.) Backward then sees the
outputs rounded to BF16 (8 significant bits), far finer than the FP8 gradients they meet (E5M2:
3); forward reads them unchanged. Backend option `saved_outputs="high"` turns this off.
"""

from __future__ import annotations

import itertools
import operator

import torch
from torch import fx

from fp8fx.passes.annotation import annotation, fp8_gemm_nodes
from fp8fx.passes.fuse_epilogues import RESHAPES
from fp8fx.passes.graph_utils import PassContext, PassResult, add_node, fake_mode_of, is_backward

_CONVERT = torch.ops.prims.convert_element_type.default


def _outputs(gemm: fx.Node) -> list[fx.Node]:
    """The GEMM's output values and the reshapes of them (fp8_gemm: its output and the aux value
    its fused epilogue keeps for backward, getitems 0 and 1)."""
    if gemm.target == torch.ops.fp8fx.fp8_gemm.default:
        first = [u for u in gemm.users if u.target is operator.getitem and u.args[1] in (0, 1)]
    else:
        first = [gemm]
    found, todo = [], list(first)
    while todo:
        node = todo.pop()
        found.append(node)
        todo += [u for u in node.users if u.target in RESHAPES and not is_backward(u)]
    return found


def _pointwise(node: fx.Node) -> bool:
    """An elementwise op that gives the same result when recomputed (not a random one)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in node.target.tags and torch.Tag.nondeterministic_seeded not in node.target.tags


def _small_or_kept(node, size: int) -> bool:
    """Whether backward may read `node` itself: a scalar or parameter-sized tensor, or a graph input."""
    if not isinstance(node, fx.Node):
        return True
    val = node.meta.get("val")
    return node.op == "placeholder" or not isinstance(val, torch.Tensor) or val.numel() * 8 <= size


def saved_outputs(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.options.saved_outputs == "high":
        return PassResult(gm, modified=False)
    graph, fake_mode = gm.graph, fake_mode_of(gm.graph)
    wide: dict[fx.Node, fx.Node] = {}  # forward value -> what backward reads instead
    for gemm in fp8_gemm_nodes(graph):
        if is_backward(gemm) or annotation(gemm).role != "output":
            continue
        for value in _outputs(gemm):
            val = value.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
                continue
            with graph.inserting_after(value):
                low = add_node(graph, fake_mode, torch.ops.fp8fx.saved_copy.default, (value, torch.bfloat16), tag_from=value)
            with graph.inserting_after(low):
                wide[value] = add_node(graph, fake_mode, _CONVERT, (low, torch.float32), tag_from=value)
    if not wide:
        return PassResult(gm, modified=False)
    # Forward elementwise functions of those outputs and reshapes of them that backward reads (a
    # gated MLP's SiLU and product, a bias add Inductor fuses, GELU's input) are recomputed for
    # backward from the widened copies, so that nothing fp32 of the chain stays alive: backward
    # reads replicas of them (those it does not read are erased below).
    for node in list(graph.nodes):
        if node in wide or is_backward(node) or not (_pointwise(node) or node.target in RESHAPES):
            continue
        inputs = node.all_input_nodes
        size = node.meta["val"].numel() if isinstance(node.meta.get("val"), torch.Tensor) else 0
        if not any(a in wide for a in inputs) or not all(a in wide or _small_or_kept(a, size) for a in inputs):
            continue
        with graph.inserting_after(node):
            replica = graph.node_copy(node, lambda a: wide.get(a, a))
        wide[node] = replica
    modified = False
    for value, replacement in wide.items():
        for user in list(value.users):
            if is_backward(user) and user is not replacement:
                user.replace_input_with(value, replacement)
                modified = True
    for value, replacement in reversed(list(wide.items())):  # copies no backward reads go, replicas first
        if not replacement.users:
            low = replacement.args[0] if replacement.target == _CONVERT else None
            graph.erase_node(replacement)  # (which clears its args)
            if low is not None and not low.users:
                graph.erase_node(low)
    graph.lint()
    gm.recompile()
    return PassResult(gm, modified=modified)


def _constant(node: fx.Node) -> bool:
    """A node that makes a tensor from nothing and the same each time (a `full`), which may move."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded not in target.tags


def recompute_at_first_use(gm: fx.GraphModule) -> None:
    """Move the forward ops a backward graph recomputes from saved values (the replicas above,
    min-cut's own recomputation) to just before their first use, and recompile `gm`.

    The partitioner emits them in the joint graph's order, all at the start of backward, where
    every layer's recomputed fp32 values would be alive at once (with `inner="eager"` a step's
    peak memory exceeded fp32's). Inductor keeps fp8fx's opaque ops in graph order, so the backend
    runs this on the backward graphs it gives Inductor too."""
    graph = gm.graph
    saved = {n for n in graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")}
    lazy: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "call_function" and not node.is_impure() and all(a in saved or a in lazy for a in node.all_input_nodes):
            if node.all_input_nodes or _constant(node):
                lazy.add(node)
    order: list[fx.Node] = []
    emitted: set[fx.Node] = set()
    for node in list(graph.nodes):
        if node in lazy:
            continue
        stack = [node]  # the node, after the lazy values it reads that are not out yet (depth first)
        while stack:
            top = stack[-1]
            pending = [a for a in top.all_input_nodes if a in lazy and a not in emitted and a not in stack]
            if pending:
                stack.append(pending[0])
            else:  # each node is pushed once: pending skips what is out or on the stack
                stack.pop()
                emitted.add(top)
                order.append(top)
    for before, node in itertools.pairwise(order):
        before.append(node)
    graph.lint()
    gm.recompile()
