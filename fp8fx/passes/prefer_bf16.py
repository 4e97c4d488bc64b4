"""prefer_bf16: a GEMM measured slower in FP8 than in BF16 on the GPU that runs it stays high.

The kernel that runs an FP8 GEMM, and so the time it was measured at, is known only once the
GEMM's casts are in the graph and its epilogue is planned (`insert_casts`, `fuse_epilogues`), after
its precision was decided. So where a GPU's measurements may choose kernels, this pass runs those
two passes on a copy of the graph, takes each FP8 GEMM's measurement (`Timing`: the chosen kernel
with the epilogue it runs, against BF16's `torch.mm` at the same shape), and decides the GEMMs again
(`assign_precision`) knowing which were slower: those stay high, unless a policy rule sets one's
precision to fp8 (`policy_decision`). Only annotations change here, so the rewrite that
follows casts none of the GEMMs kept high. Without a measurement (CPU tensors, another `kernels`,
a table without BF16 times) nothing changes.

Decided once: a GEMM next to one kept high may then get another epilogue, and another kernel, than
on the copy, and is not decided again.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import fx

from fp8fx.ops import gemm_bench
from fp8fx.passes.annotation import annotations, node_annotations
from fp8fx.passes.assign_precision import assign_precision
from fp8fx.passes.fuse_epilogues import fuse_epilogues
from fp8fx.passes.graph_utils import PassContext, PassResult
from fp8fx.passes.insert_casts import insert_casts


def _measured_here(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Whether a GPU's measurements may choose the kernel of one of the graph's FP8 GEMMs."""
    o = ctx.options
    if o.kernels != "auto" or not o.fuse_epilogues:
        return False
    devices = {
        n.meta["val"].device
        for n in gm.graph.nodes
        if any(a.fp8 for a in node_annotations(n)) and isinstance(n.meta.get("val"), torch.Tensor)
    }
    return any(gemm_bench.device_tables(d, o.measure_gemms) is not None for d in devices)


def _trial(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """A copy of `gm` (its nodes' meta shared) rewritten by insert_casts and fuse_epilogues, with a
    context of its own: the states it uses and the sites are not handed on."""
    graph, nodes = fx.Graph(), {}
    graph.output(graph.graph_copy(gm.graph, nodes))
    delayed = replace(ctx.delayed, handle=nodes[ctx.delayed.handle]) if ctx.delayed is not None else None
    trial_ctx = replace(ctx, delayed=delayed, sites=[], delayed_states={})
    trial = fx.GraphModule(gm, graph)
    for rewrite in (insert_casts, fuse_epilogues):
        trial = rewrite(trial, trial_ctx).graph_module
    return trial


def prefer_bf16(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if not _measured_here(gm, ctx):
        return PassResult(gm, modified=False)
    measured = [a for a in annotations(_trial(gm, ctx).graph) if a.fp8 and a.measured is not None]
    ctx.bf16_faster = {(a.site, a.role): a.measured for a in measured if a.measured.bf16_faster()}
    if ctx.bf16_faster:
        assign_precision(gm, ctx)
    return PassResult(gm, modified=False)
