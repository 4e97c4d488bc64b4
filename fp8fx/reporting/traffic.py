"""Bytes a compiled graph moves outside its GEMMs, and bytes forward keeps for backward; both per
module FQN, so an analysis that traced one of N identical blocks can copy them.

Read by the cost model (non-GEMM time of a step) and the report's memory summary."""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch import fx

from fp8fx.core.formats import FP8_DTYPES
from fp8fx.passes.find_matmuls import is_matrix_product, module_fqn
from fp8fx.passes.graph_utils import LAYOUT_OPS, TRANSPARENT_OPS, strip_layout

_NOT_TRAFFIC = {*LAYOUT_OPS, *TRANSPARENT_OPS, operator.getitem} - {torch.ops.aten.clone.default}


def non_gemm_bytes(graph: fx.Graph) -> dict[str, int]:
    """Per module FQN: bytes the graph's non-GEMM ops move, each result written once and read once
    in 2-byte precision (what a BF16 step with elementwise chains fused moves); every result of an
    op with several (a layer norm's output, mean and rstd; its backward's three gradients). Views
    and GEMMs (attention and convolutions included) are not counted."""
    found: dict[str, int] = defaultdict(int)
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op != "call_function" or node.target in _NOT_TRAFFIC or is_matrix_product(node):
            continue
        for result in val if isinstance(val, (tuple, list)) else (val,):
            if not isinstance(result, torch.Tensor) or result.dtype in FP8_DTYPES:
                continue
            numel = result.numel()
            if not isinstance(numel, int):  # dynamic shapes: no size to count
                continue
            itemsize = 2 if result.dtype.is_floating_point else result.element_size()
            found[_owner(node)] += 2 * numel * itemsize
    return dict(found)


def _owner(node: fx.Node) -> str:
    """The node's module; autograd's gradient-accumulating adds have none: take their inputs'."""
    fqn = module_fqn(node)
    for arg in node.all_input_nodes:
        fqn = fqn or module_fqn(arg)
    return fqn


def saved_activation_bytes(forward: fx.GraphModule, num_fwd_outputs: int) -> dict[str, int]:
    """From a partitioned forward graph, per module FQN: bytes of the tensors saved for backward,
    graph inputs (parameters) excepted."""
    output = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
    saved: dict[str, int] = defaultdict(int)
    for node in output.args[0][num_fwd_outputs:]:
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not isinstance(val.numel(), int):
            continue
        root, _ = strip_layout(node)
        if root.op != "placeholder":
            saved[module_fqn(root)] += val.numel() * val.element_size()
    return dict(saved)
