"""insert_probes: with numerics on (`ctx.taps.numerics`), put a probe (`fp8fx::tap(left, [right],
collector, key)`) in front of every GEMM so an analysis run measures what FP8 does to its operands
(see `fp8fx.runtime.numerics`).

Runs after assign_precision and before insert_casts, so the probes see the high-precision
operands; the GEMM takes the probe's copy of its left operand, which keeps the probe alive
through partitioning. Without numerics the graph is unchanged."""

from __future__ import annotations

import torch
from torch import fx

from fp8fx.core.policy import Policy
from fp8fx.core.recipes import RECIPES
from fp8fx.passes.annotation import annotation
from fp8fx.passes.assign_precision import decide
from fp8fx.passes.find_matmuls import matmul_operands
from fp8fx.passes.graph_utils import PassContext, PassResult, add_node, fake_mode_of
from fp8fx.passes.options import BackendOptions
from fp8fx.runtime.numerics import ProbeSpec


def insert_probes(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    numerics = ctx.taps.numerics
    if numerics is None:
        return PassResult(gm, modified=False)
    fake_mode = fake_mode_of(gm.graph)
    recipes = {name: PassContext(options=BackendOptions(policy=Policy.from_recipe(name))) for name in RECIPES}
    probes = []  # decide every what-if first: decisions read the operands the probes replace
    for site in ctx.sites:
        # Fused attention, convolutions and opaque ops have no FP8 form to measure; grouped GEMMs'
        # per-group scales are not emulated by the probes.
        if site.op in ("sdpa", "conv", "grouped_mm") or site.opaque:
            continue
        for role, gemm in site.gemms.items():
            left, right, _ = matmul_operands(gemm.node)
            if all(x.meta["val"].dtype.is_floating_point for x in (left, right)):
                what_if = {name: decide(site, gemm, rctx) for name, rctx in recipes.items()}
                probes.append(
                    (
                        gemm.node,
                        left,
                        right,
                        ProbeSpec(ctx.taps.graph_index, site.name, role, annotation(gemm.node).decision, what_if),
                    )
                )
    for node, left, right, spec in probes:
        with gm.graph.inserting_before(node):
            args = (left, [right], numerics.tap_handler, numerics.register(spec))
            probe = add_node(gm.graph, fake_mode, torch.ops.fp8fx.tap.default, args, tag_from=node)
        node.replace_input_with(left, probe)
    gm.recompile()
    return PassResult(gm, modified=True)
