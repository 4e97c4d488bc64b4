"""insert_casts: make every FP8 decision explicit in the graph.

For each FP8 GEMM, each operand gets `fp8fx::amax -> fp8fx::amax_to_scale -> fp8fx::cast` (and
the scale's inverse), and the GEMM becomes `fp8fx::scaled_mm`. Casts are made on the operand's
root tensor (before transposes, views and dtype casts) and cached per (root, format), so the
weight's E4M3 copy serves both output and grad_input, and the input's E4M3 copy serves output and
grad_weight: after partitioning, backward consumes the FP8 tensors forward made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from fp8fx.formats import Fp8Format
from fp8fx.passes.find_matmuls import matmul_operands
from fp8fx.passes.graph_utils import META_KEY, PassContext, PassResult, add_node, fake_mode_of, strip_layout

fp8fx_ops = torch.ops.fp8fx
aten = torch.ops.aten

# Meta that identifies the replaced GEMM; carried over to the scaled_mm node.
_CARRIED_META = ("seq_nr", "autograd_backward", "nn_module_stack", "fwd_nn_module_stack", "source_fn_stack", "stack_trace", META_KEY)


@dataclass
class Quantized:
    fp8: fx.Node
    scale_inv: fx.Node


class _Inserter:
    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.fake_mode = fake_mode_of(graph)
        self.cache: dict[tuple[fx.Node, Fp8Format], Quantized] = {}

    def add(self, target, args, kwargs=None, *, tag_from: fx.Node) -> fx.Node:
        return add_node(self.graph, self.fake_mode, target, args, kwargs, tag_from=tag_from)

    def quantize(self, root: fx.Node, fmt: Fp8Format, gemm: fx.Node) -> Quantized:
        key = (root, fmt)
        if key in self.cache:
            return self.cache[key]
        # Right after the producer, so every GEMM that needs it is dominated; placeholders stay first.
        at = next(n for n in self.graph.nodes if n.op != "placeholder") if root.op == "placeholder" else root.next
        tag_from = gemm if root.op == "placeholder" else root
        with self.graph.inserting_before(at):
            amax = self.add(fp8fx_ops.amax.default, (root,), tag_from=tag_from)
            scale = self.add(fp8fx_ops.amax_to_scale.default, (amax, fmt.max, 0), tag_from=tag_from)
            fp8 = self.add(fp8fx_ops.cast.default, (root, scale, fmt.dtype), tag_from=tag_from)
            scale_inv = self.add(aten.reciprocal.default, (scale,), tag_from=tag_from)
        self.cache[key] = q = Quantized(fp8, scale_inv)
        return q

    def operand(self, x: fx.Node, fmt: Fp8Format, gemm: fx.Node) -> tuple[fx.Node, fx.Node]:
        root, chain = strip_layout(x)
        q = self.quantize(root, fmt, gemm)
        out = q.fp8
        with self.graph.inserting_before(gemm):
            for view in chain:  # same views, now on the FP8 tensor
                out = self.add(view.target, (out, *view.args[1:]), dict(view.kwargs), tag_from=gemm)
        return out, q.scale_inv

    def rewrite(self, gemm: fx.Node) -> fx.Node:
        decision = gemm.meta[META_KEY]["decision"]
        left, right, bias = matmul_operands(gemm)
        a, a_scale_inv = self.operand(left, decision.formats[0], gemm)
        b, b_scale_inv = self.operand(right, decision.formats[1], gemm)
        out_dtype = gemm.meta["val"].dtype
        with self.graph.inserting_before(gemm):
            new = self.add(fp8fx_ops.scaled_mm.default, (a, b, a_scale_inv, b_scale_inv, bias, out_dtype), tag_from=gemm)
        for key in _CARRIED_META:
            if key in gemm.meta:
                new.meta[key] = gemm.meta[key]
        gemm.replace_all_uses_with(new)
        self.graph.erase_node(gemm)
        return new


def insert_casts(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    fp8_gemms = [
        n for n in gm.graph.nodes if META_KEY in n.meta and n.meta[META_KEY].get("decision") is not None and n.meta[META_KEY]["decision"].fp8
    ]
    if not fp8_gemms:
        return PassResult(gm, modified=False)
    inserter = _Inserter(gm.graph)
    for gemm in fp8_gemms:  # graph order: forward GEMMs make the casts backward reuses
        inserter.rewrite(gemm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return PassResult(gm, modified=True)
