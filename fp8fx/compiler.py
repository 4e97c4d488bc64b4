"""The `torch.compile` backend.

Training graphs go through aot_autograd; the FP8 passes run on the *joint* forward+backward graph
before it is partitioned, so a site's output, grad_input and grad_weight GEMMs are rewritten
together and backward can consume the FP8 tensors forward made. Inference graphs (no grad) are
rewritten alone. With `inner="eager"` fp8fx drives aot_autograd itself (partition_fn and
inference_compiler hooks); with `inner="inductor"` it runs as Inductor's joint-graph pre-pass,
which Inductor calls on training joint graphs and inference graphs alike.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import fp8fx.ops  # noqa: F401  (registers the fp8fx::* operators)
from fp8fx.passes import REWRITE_PASSES, PassContext, run_passes
from fp8fx.policy import GEMM_ROLES, Policy, load_policy
from fp8fx.reporting import OpRecord, Report

INNER_COMPILERS = ("inductor", "eager")


@dataclass
class GraphRecord:
    """One graph this backend compiled: its GEMM records and the parameters it takes."""

    index: int
    kind: str  # training | inference
    ops: list[OpRecord]
    params: list[weakref.ref] = field(default_factory=list)

    def belongs_to(self, param_ids: set[int]) -> bool:
        alive = [p() for p in self.params]
        return bool(alive) and all(p is not None and id(p) in param_ids for p in alive)


def _graph_kind(gm: fx.GraphModule) -> str:
    is_joint = any(n.op == "placeholder" and str(n.target).startswith("tangents") for n in gm.graph.nodes)
    return "training" if is_joint else "inference"


class Fp8fxBackend:
    """A `torch.compile` backend that runs matmuls in FP8 by policy and records every decision."""

    def __init__(self, policy: Policy | str | Path | None = None, inner: str = "inductor"):
        if inner not in INNER_COMPILERS:
            raise ValueError(f"fp8fx.backend: inner must be one of {', '.join(INNER_COMPILERS)}, got {inner!r}")
        if policy is None:
            policy = Policy()
        elif isinstance(policy, (str, Path)):
            policy = load_policy(policy)
        elif not isinstance(policy, Policy):
            raise TypeError(f"fp8fx.backend: policy must be a Policy, a path to a YAML file or None, got {type(policy).__name__}")
        self.policy = policy
        self.inner = inner
        self.graphs: list[GraphRecord] = []

    def __repr__(self) -> str:
        return f"Fp8fxBackend(inner={self.inner!r}, policy={self.policy.source or 'built-in'}, graphs={len(self.graphs)})"

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]):
        params = [weakref.ref(p) for p in example_inputs if isinstance(p, torch.nn.Parameter)]
        rewrite = _Rewrite(self, params)
        if self.inner == "eager":
            return self._compile_eager(gm, example_inputs, rewrite)
        return self._compile_inductor(gm, example_inputs, rewrite)

    def rewrite(self, gm: fx.GraphModule, params: list[weakref.ref]) -> fx.GraphModule:
        """Run the FP8 passes on an ATen graph (joint or inference) and record the decisions."""
        kind = _graph_kind(gm)
        ctx = PassContext(self.policy)
        gm = run_passes(gm, ctx, REWRITE_PASSES)
        index = len(self.graphs)
        ops = [
            OpRecord.make(index, kind, site, site.gemms[role], ctx.decisions[(site.name, role)])
            for site in ctx.sites
            for role in GEMM_ROLES
            if role in site.gemms
        ]
        self.graphs.append(GraphRecord(index, kind, ops, params))
        return gm

    @staticmethod
    def _compile_eager(gm: fx.GraphModule, example_inputs: list[Any], rewrite: _Rewrite):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        def partition_fn(joint_gm, joint_inputs, **kwargs):
            rewrite(joint_gm)
            return min_cut_rematerialization_partition(joint_gm, joint_inputs, **kwargs)

        def inference_compiler(gm, _inputs):
            return make_boxed_func(rewrite(gm))

        def boxed(gm, _inputs):
            return make_boxed_func(gm)

        return aot_autograd(
            fw_compiler=boxed, bw_compiler=boxed, inference_compiler=inference_compiler, partition_fn=partition_fn
        )(gm, example_inputs)

    @staticmethod
    def _compile_inductor(gm: fx.GraphModule, example_inputs: list[Any], rewrite: _Rewrite):
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        with inductor_config.patch(joint_custom_pre_pass=_InductorJointPass(rewrite)):
            return compile_fx(gm, example_inputs)


class _Rewrite:
    """The rewrite bound to one Dynamo graph (and the parameters it takes)."""

    def __init__(self, backend: Fp8fxBackend, params: list[weakref.ref]):
        self.backend, self.params = backend, params

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        return self.backend.rewrite(gm, self.params)


class _InductorJointPass(CustomGraphPass):
    def __init__(self, rewrite: _Rewrite):
        self.rewrite = rewrite

    def __call__(self, graph: fx.Graph) -> None:
        self.rewrite(graph.owning_module)

    def uuid(self) -> None:
        # No cache key: a cached compile would skip the pass and leave the report empty.
        return None


DEFAULT_BACKEND = Fp8fxBackend()  # what `backend="fp8fx"` resolves to (entry point)


def backend(policy: Policy | str | Path | None = None, inner: str = "inductor") -> Fp8fxBackend:
    """A configured backend: `torch.compile(model, backend=fp8fx.backend(policy="p.yaml"))`."""
    return Fp8fxBackend(policy=policy, inner=inner)


def _find_backend(compiled: Any) -> Fp8fxBackend | None:
    from torch._dynamo.eval_frame import _TorchDynamoContext

    ctx = getattr(compiled, "dynamo_ctx", None)  # OptimizedModule
    if ctx is None:  # a compiled function keeps its context in its closure
        for cell in getattr(compiled, "__closure__", None) or ():
            if isinstance(cell.cell_contents, _TorchDynamoContext):
                ctx = cell.cell_contents
    fn = getattr(ctx, "callback", None)
    for _ in range(16):  # walk Dynamo's wrappers down to the backend
        if isinstance(fn, Fp8fxBackend) or fn is None:
            return fn
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
    return None


def report(compiled: Any) -> Report:
    """The precision report of a model compiled with an fp8fx backend (or of a backend itself).

    Graphs are added as they compile, so call it after the first forward (and backward). For the
    shared `backend="fp8fx"` instance, a compiled module's report holds the graphs that take its
    parameters."""
    if isinstance(compiled, Fp8fxBackend):
        return Report([op for g in compiled.graphs for op in g.ops])
    found = _find_backend(compiled)
    if found is None:
        raise ValueError(
            "fp8fx.report: this object was not compiled with an fp8fx backend; "
            "use torch.compile(model, backend='fp8fx') or backend=fp8fx.backend(...)"
        )
    graphs = found.graphs
    orig = getattr(compiled, "_orig_mod", None)
    if found is DEFAULT_BACKEND and isinstance(orig, torch.nn.Module):
        param_ids = {id(p) for p in orig.parameters()}
        graphs = [g for g in graphs if g.belongs_to(param_ids)]
    return Report([op for g in graphs for op in g.ops])
