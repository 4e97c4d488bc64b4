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
        self.cache: dict[tuple, Quantized] = {}
        self.views: dict[tuple, fx.Node] = {}  # high-precision operand views rebuilt from their root

    def add(self, target, args, kwargs=None, *, tag_from: fx.Node) -> fx.Node:
        return add_node(self.graph, self.fake_mode, target, args, kwargs, tag_from=tag_from)

    def quantize(self, x: fx.Node, fmt: Fp8Format, block: tuple, power_of_two: bool, gemm: fx.Node) -> Quantized:
        key = (x, fmt, block, power_of_two)
        if key in self.cache:
            return self.cache[key]
        # Right after the producer, so every GEMM that needs it is dominated; placeholders stay first.
        at = next(n for n in self.graph.nodes if n.op != "placeholder") if x.op == "placeholder" else x.next
        tag_from = gemm if x.op == "placeholder" else x
        with self.graph.inserting_before(at):
            amax = self.add(fp8fx_ops.amax.default, (x, list(block)), tag_from=tag_from)
            scale = self.add(fp8fx_ops.amax_to_scale.default, (amax, fmt.max, 0, power_of_two), tag_from=tag_from)
            fp8 = self.add(fp8fx_ops.cast.default, (x, scale, fmt.dtype, list(block)), tag_from=tag_from)
            scale_inv = self.add(aten.reciprocal.default, (scale,), tag_from=tag_from)
        self.cache[key] = q = Quantized(fp8, scale_inv)
        return q

    def replay(self, x: fx.Node, chain: list[fx.Node], gemm: fx.Node) -> fx.Node:
        with self.graph.inserting_before(gemm):
            for view in chain:
                x = self.add(view.target, (x, *view.args[1:]), dict(view.kwargs), tag_from=gemm)
        return x

    def operand(self, x: fx.Node, fmt: Fp8Format, block: tuple, power_of_two: bool, gemm: fx.Node) -> tuple[fx.Node, fx.Node]:
        root, chain = strip_layout(x)
        if not block:  # tensorwise: cast the root once, replay the views on FP8
            q = self.quantize(root, fmt, block, power_of_two, gemm)
            return self.replay(q.fp8, chain, gemm), q.scale_inv
        # Per-row / per-block scales follow the GEMM's layout: cast the operand as the GEMM sees
        # it, rebuilt from the root so dtype casts (autocast's bf16 copies) are skipped.
        key = (root, tuple((v.target, repr(v.args[1:]), repr(v.kwargs)) for v in chain))
        if key not in self.views:  # e.g. q, k and v projections share one cast of their input
            self.views[key] = self.replay(root, chain, gemm)
        q = self.quantize(self.views[key], fmt, block, power_of_two, gemm)
        return q.fp8, q.scale_inv

    def rewrite(self, gemm: fx.Node) -> fx.Node:
        decision = gemm.meta[META_KEY]["decision"]
        left, right, bias = matmul_operands(gemm)
        (block_a, block_b), pow2 = decision.blocks, decision.power_of_two
        a, a_scale_inv = self.operand(left, decision.formats[0], block_a, pow2, gemm)
        b, b_scale_inv = self.operand(right, decision.formats[1], block_b, pow2, gemm)
        out_dtype = gemm.meta["val"].dtype
        args = (a, b, a_scale_inv, b_scale_inv, bias, out_dtype, list(block_a), list(block_b))
        with self.graph.inserting_before(gemm):
            new = self.add(fp8fx_ops.scaled_mm.default, args, tag_from=gemm)
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
