"""Every stage of an fp8fx compile, in the order a graph meets them.

A stage is a named tuple of passes, each `(GraphModule, StageContext) -> PassResult`, run by
`fp8fx.passes.run_passes`: a pass that fails raises a `PassError` naming it, its stage and the
passes before it. What a pass needs beyond the graph it reads from the context (the options, the
FP8 rewrite bound to the Dynamo graph, the ops kept whole, which partitioned graph this is), and a
pass that does not apply to a graph (`recompute_at_first_use` outside backward) returns it as it is.

1. `BEFORE_AOT`: Dynamo's graph, before AOTAutograd derives its backward.
2. The joint graph (forward and backward together, or an inference graph): the FP8 rewrite
   (`REWRITE`: `fp8fx.passes.REWRITE_PASSES`, given a `PassContext`), then under Inductor the
   lowering that lets the partitioner weigh FP8 casts (`JOINT`, Inductor's joint-graph pre-pass).
   With inner="eager" only the rewrite runs (`EAGER_JOINT`, from aot_autograd's partition_fn, or
   its inference compiler).
3. After partitioning, each of the forward, backward and inference graphs: under Inductor,
   `AFTER_PARTITION` before Inductor compiles it; with inner="eager", `EAGER_AFTER_PARTITION`.
4. `AFTER_FUSION`: under Inductor, on the kernels it fused each graph into (its post-fusion
   scheduler pass, while `fp8fx.compiler.memory_passes.counting` is active).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from torch import fx

from fp8fx.compiler import lowering, ordering
from fp8fx.compiler.memory_passes import MemoryPassCounts, counting
from fp8fx.passes import gathered_experts, saved_outputs
from fp8fx.passes.graph_utils import PassResult, decompose_nodes
from fp8fx.passes.options import BackendOptions
from fp8fx.passes.pipeline import REWRITE_PASSES, run_passes


@dataclass(kw_only=True)
class StageContext:
    """What the passes of the compile stages are given beside the graph, and hand on."""

    options: BackendOptions
    # The FP8 rewrite bound to the Dynamo graph the compile came from (its parameters, delayed
    # scaling's state): runs `REWRITE` on a joint or inference graph and records its decisions.
    rewrite: Callable[[fx.GraphModule], fx.GraphModule] | None = None
    # The ops the compile took out of Inductor's decomposition table for the FP8 passes
    # (`fp8fx.compiler.cache.kept_whole`): decomposed after the rewrite, and with the lowered ops.
    kept_whole: dict = field(default_factory=dict)
    graph: str = "joint"  # joint | forward | backward | inference
    memory_pass_counts: MemoryPassCounts | None = None  # Inductor: what the graphs' kernels are counted into
    # Handed on: elements of each tensor the graph casts to FP8 (`count_operands`, which sizes the
    # count after fusion), and the kernels Inductor fused the graph into (`AFTER_FUSION`).
    operand_numels: list[int] = field(default_factory=list)
    fused: list = field(default_factory=list)


@dataclass(frozen=True)
class Stage:
    """A named tuple of passes; calling it runs them (`run_passes`) and returns the graph module."""

    name: str
    passes: tuple[Callable[[fx.GraphModule, Any], PassResult], ...]

    def __call__(self, gm: fx.GraphModule, ctx: Any) -> fx.GraphModule:
        return run_passes(gm, ctx, self.passes, stage=self.name)


# ---------------------------------------------------------------------------- before AOTAutograd


def rewrite_gathered_experts(gm: fx.GraphModule, ctx: StageContext) -> PassResult:
    """Gathered-weight expert `bmm`s become grouped GEMMs, so their backward is derived as grouped GEMMs."""
    return PassResult(gm, gathered_experts.rewrite_gathered_experts(gm, ctx.options.policy) > 0)


def add_delayed_handle(gm: fx.GraphModule, ctx: StageContext) -> PassResult:
    """With delayed scaling, a copy of the graph that takes one more input at the end: the handle
    its state ops find the states by (`fp8fx.ops.delayed`)."""
    if not ctx.options.policy.uses_delayed_scaling:
        return PassResult(gm, False)
    gm = copy.deepcopy(gm)
    last = [p for p in gm.graph.nodes if p.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        gm.graph.placeholder("fp8fx_delayed_handle")._dynamo_source = None
    gm.recompile()
    return PassResult(gm, True)


# ------------------------------------------------------------------------------- the joint graph


def fp8_rewrite(gm: fx.GraphModule, ctx: StageContext) -> PassResult:
    """The FP8 rewrite (`REWRITE`) of a joint or inference graph, recorded by the backend."""
    return PassResult(ctx.rewrite(gm), True)


def decompose_kept_whole(gm: fx.GraphModule, ctx: StageContext) -> PassResult:
    """What is left of the ops kept whole for the FP8 passes is decomposed, as Inductor would have."""
    return PassResult(gm, decompose_nodes(gm.graph, ctx.kept_whole) > 0)


def lower_casts(gm: fx.GraphModule, ctx: StageContext) -> PassResult:
    """Amaxes, scales and casts become ATen ops, which the partitioner may recompute in backward."""
    return PassResult(gm, lowering.lower_casts(gm.graph, ctx.kept_whole) > 0)


def let_backward_cast_again(gm: fx.GraphModule, ctx: StageContext) -> PassResult:
    """Backward GEMMs read forward's FP8 activations through copies min-cut may recompute."""
    return PassResult(gm, lowering.let_backward_cast_again(gm.graph) > 0)


def input_gradients_first(gm: fx.GraphModule, ctx: StageContext) -> PassResult:
    """Each layer's input gradient runs before its weight gradient (`fp8fx.compiler.ordering`)."""
    return PassResult(gm, ordering.input_gradients_first(gm.graph) > 0)


# --------------------------------------------------------------------------- after partitioning


def drop_partition_copies(gm: fx.GraphModule, ctx: StageContext) -> PassResult:
    """The GEMMs read again the tensors `let_backward_cast_again`'s copies copied."""
    lowering.drop_partition_copies(gm)
    return PassResult(gm, True)


def recompute_at_first_use(gm: fx.GraphModule, ctx: StageContext) -> PassResult:
    """Backward only: values it recomputes move to their first use (`fp8fx.passes.saved_outputs`)."""
    if ctx.graph != "backward":
        return PassResult(gm, False)
    saved_outputs.recompute_at_first_use(gm)
    return PassResult(gm, True)


def count_operands(gm: fx.GraphModule, ctx: StageContext) -> PassResult:
    """Hands on the elements of each tensor the graph casts to FP8 (before layout copies are added)."""
    ctx.operand_numels = lowering.operand_numels(gm)
    return PassResult(gm, False)


def lay_out_operands(gm: fx.GraphModule, ctx: StageContext) -> PassResult:
    """GEMM operands get the K-major layout the tensor cores read."""
    laid_out = lowering.lay_out_operands(gm, ctx.options.cublas_devices)
    if ctx.memory_pass_counts is not None:
        ctx.memory_pass_counts.laid_out |= laid_out
    return PassResult(gm, True)


def lower_elementwise(gm: fx.GraphModule, ctx: StageContext) -> PassResult:
    """fp8fx's elementwise ops, emulated GEMMs and cuBLAS GEMMs become ATen ops Inductor fuses."""
    return PassResult(gm, lowering.lower_elementwise(gm, ctx.kept_whole, ctx.options.cublas_devices) > 0)


# ---------------------------------------------------------------------------- after fusion


def count_memory_passes(gm: fx.GraphModule, ctx: StageContext) -> PassResult:
    """The memory passes FP8 adds, counted from the kernels Inductor fused the graph into."""
    ctx.memory_pass_counts.count(ctx.fused)
    return PassResult(gm, False)


BEFORE_AOT = Stage("before_aot", (rewrite_gathered_experts, add_delayed_handle))
REWRITE = Stage("rewrite", REWRITE_PASSES)  # given a PassContext (`Fp8fxBackend.rewrite`)
JOINT = Stage("joint", (fp8_rewrite, decompose_kept_whole, lower_casts, let_backward_cast_again, input_gradients_first))
EAGER_JOINT = Stage("eager_joint", (fp8_rewrite,))
AFTER_PARTITION = Stage(
    "after_partition", (drop_partition_copies, recompute_at_first_use, count_operands, lay_out_operands, lower_elementwise)
)
EAGER_AFTER_PARTITION = Stage("eager_after_partition", (recompute_at_first_use,))
AFTER_FUSION = Stage("after_fusion", (count_memory_passes,))
STAGES = (BEFORE_AOT, REWRITE, JOINT, EAGER_JOINT, AFTER_PARTITION, EAGER_AFTER_PARTITION, AFTER_FUSION)


def compile_partitioned(gm: fx.GraphModule, example_inputs, *, ctx: StageContext, **kwargs):
    """Inductor's compile of one partitioned graph (its `inner_compile`): `AFTER_PARTITION`, then
    Inductor's own compile, with `AFTER_FUSION` on the kernels it makes when the graph casts to FP8
    and the compile counts passes.

    A backward graph first gets its recomputed values moved to their first use, as with
    inner="eager": Inductor keeps its opaque ops (the FP8 GEMMs) in graph order, so the
    partitioner's order made backward recompute every layer's values (and cast every weight again,
    weight_fp8="recompute") before its first GEMM. Then GEMM operands get the K-major layout the
    tensor cores read, and the amaxes, scales and casts become ATen ops for Inductor to fuse
    (`fp8fx.compiler.lowering`)."""
    from torch._inductor.compile_fx import compile_fx_inner

    ctx = replace(ctx, graph="backward" if kwargs.get("is_backward") else "forward", operand_numels=[], fused=[])
    gm = AFTER_PARTITION(gm, ctx)
    if ctx.memory_pass_counts is None or not ctx.operand_numels:
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def after_fusion(kernels: list) -> None:
        AFTER_FUSION(gm, replace(ctx, fused=kernels))

    with counting(ctx.memory_pass_counts, ctx.graph, max(1, min(ctx.operand_numels) // 4), after_fusion):
        return compile_fx_inner(gm, example_inputs, **kwargs)
