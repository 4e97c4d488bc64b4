"""The order of a joint graph's backward GEMMs, which min-cut's partitioner keeps."""

from __future__ import annotations

import collections

from torch import fx

from fp8fx.passes.annotation import annotation, fp8_gemm_nodes


def input_gradients_first(graph: fx.Graph) -> int:
    """Move each weight-gradient GEMM, with what only it reads, to just after its layer's
    input-gradient GEMM where the joint graph had it first; returns how many moved.

    The partitioner orders backward as the joint graph does and recomputes a forward value just
    before its first reader. A weight gradient first (the order autograd traces `mm`'s backward in)
    has its operand recomputed there (a gated MLP's product, from the gate and up outputs), ahead
    of the input gradient and apart from the activation's backward, which reads the same values:
    Inductor keeps what the two share alive across the input-gradient GEMM (on a CPU, SiLU's
    sigmoid in fp32). Input gradient first, as torchao's and the autograd engine's order is, the
    recompute sits beside the activation's backward, which lowers a BF16 Llama step's peak under
    both rowwise and tensorwise scaling (docs/results.md, "Peak memory of a BF16 step as a GPU
    runs it")."""
    gemms: dict[str, dict[str, list[fx.Node]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for gemm in fp8_gemm_nodes(graph):
        ann = annotation(gemm)
        if ann is not None:
            gemms[ann.site][ann.role].append(gemm)
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved = 0
    for roles in gemms.values():
        if len(roles["grad_weight"]) != 1 or len(roles["grad_input"]) != 1:
            continue
        weight, grad_input = roles["grad_weight"][0], roles["grad_input"][0]
        if order[weight] > order[grad_input]:
            continue
        group = _private_inputs(weight) | _readers_before(weight, grad_input, order)
        if group & _inputs_after(grad_input, min(map(order.__getitem__, group)), order):
            continue
        anchor = grad_input
        for node in sorted(group, key=order.__getitem__):
            anchor.append(node)
            anchor = node
        moved += 1
        order = {n: i for i, n in enumerate(graph.nodes)}
    return moved


def _private_inputs(node: fx.Node) -> set[fx.Node]:
    """`node` and the computed nodes that feed only it (through one another)."""
    group, todo = {node}, list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in group or n.op != "call_function" or not all(u in group for u in n.users):
            continue
        group.add(n)
        todo += n.all_input_nodes
    return group


def _readers_before(node: fx.Node, end: fx.Node, order: dict) -> set[fx.Node]:
    """What reads `node`, directly or not, before `end`."""
    found, todo = set(), list(node.users)
    while todo:
        n = todo.pop()
        if n not in found and order[n] < order[end]:
            found.add(n)
            todo += n.users
    return found


def _inputs_after(node: fx.Node, start: int, order: dict) -> set[fx.Node]:
    """What `node` reads, directly or not, from position `start` of the graph on."""
    found, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in found and order[n] >= start:
            found.add(n)
            todo += n.all_input_nodes
    return found
