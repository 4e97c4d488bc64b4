"""The `torch.compile` backend.

Training graphs go through aot_autograd; the FP8 passes run on the *joint* forward+backward graph
before it is partitioned, so a site's output, grad_input and grad_weight GEMMs are rewritten
together and backward can consume the FP8 tensors forward made. Inference graphs (no grad) are
rewritten alone. With `inner="eager"` fp8fx drives aot_autograd itself (partition_fn and
inference_compiler hooks); with `inner="inductor"` it runs as Inductor's joint-graph pre-pass,
which Inductor calls on training joint graphs and inference graphs alike. The stages a graph goes
through, and their passes in order, are listed in `fp8fx.compiler.pipeline`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
import weakref
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._guards import CompileContext, CompileId, TracingContext
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomPartitionerFn

import fp8fx.ops  # noqa: F401  (registers the fp8fx::* operators)
from fp8fx.codegen.dispatch import triton_available
from fp8fx.codegen.variants import device_target
from fp8fx.compiler import cache
from fp8fx.compiler.memory_passes import MemoryPassCounts
from fp8fx.compiler.pipeline import (
    BEFORE_AOT,
    EAGER_AFTER_PARTITION,
    EAGER_JOINT,
    JOINT,
    REWRITE,
    StageContext,
    compile_partitioned,
)
from fp8fx.compiler.state import Fp8State, StateInstance, instance_keys, locate
from fp8fx.core.patterns import BY_TARGET, OPAQUE
from fp8fx.core.policy import Policy
from fp8fx.ops import delayed as delayed_ops
from fp8fx.passes import PassContext, run_passes
from fp8fx.passes.annotation import annotations
from fp8fx.passes.graph_utils import DelayedInputs, Taps
from fp8fx.passes.options import INNER_COMPILERS, BackendOptions  # noqa: F401  (INNER_COMPILERS: re-exported)
from fp8fx.passes.saved_activations import SavedTensor, keep_saved_in_fp8
from fp8fx.reporting.op_record import OpRecord
from fp8fx.reporting.records import Report
from fp8fx.reporting.traffic import non_gemm_bytes, saved_activation_bytes
from fp8fx.reporting.uncaptured import find_uncaptured
from fp8fx.runtime.monitor import Monitor
from fp8fx.runtime.numerics import NumericsCollector
from fp8fx.runtime.shadow import ShadowChecks


@dataclass
class DynamoGraph:
    """The Dynamo compile a graph came from (`compile_id` "frame/compile": 0/1 is the second
    compile of frame 0), and whether a recompile superseded it.

    A graph is superseded when Dynamo compiled the same frame again, for the same parameters and
    the same kind (training | inference), because this graph's guards failed (`recompile_reason`:
    Dynamo's guard failure), and the graph has not run since. Dynamo keeps every compile of a
    frame and tries the newest first, so a superseded graph runs again only when its guards pass
    and the newer graphs' fail (e.g. two static shapes taking turns); it is then back in use. A
    graph break makes graphs of different frames, which never supersede each other."""

    compile_id: CompileId
    superseded_by: str | None = None  # compile id of the graph that replaced it
    recompile_reason: str | None = None

    def replaced_by(self, newer: CompileId) -> bool:
        """`newer` is a later compile of the same frame."""
        old = self.compile_id
        same_frame = (old.frame_id, old.compiled_autograd_id) == (newer.frame_id, newer.compiled_autograd_id)
        return same_frame and old.frame_compile_id < newer.frame_compile_id


def _recompile_reasons() -> dict[str, str]:
    """Dynamo's guard failures that made it compile the current frame again: {compile id of the
    graph whose guards failed: first line of the reason}."""
    from torch._dynamo.utils import guard_failures

    code = (TracingContext.get_traced_code() or [None])[0]
    reasons = {}
    for text in guard_failures.get(code, ()) if code is not None else ():
        compile_id, _, reason = text.partition(": ")
        reasons[compile_id] = " ".join(reason.partition("\n")[0].split())  # the latest failure wins
    return reasons


@dataclass
class GraphRecord:
    """One graph this backend compiled: its GEMM records, the parameters it takes, the
    delayed-scaling state it reads (if any), and the Dynamo compile it came from."""

    index: int
    kind: str  # training | inference
    ops: list[OpRecord]
    params: list[weakref.ref] = field(default_factory=list)
    state: Fp8State | None = None
    non_gemm_bytes: dict[str, int] = field(default_factory=dict)  # per module FQN (fp8fx.reporting.traffic)
    delayed_states: dict[str, int] = field(default_factory=dict)  # the delayed-scaling states it uses: key -> history length
    # Training graphs partitioned by fp8fx (eager inner): bytes saved for backward per module FQN.
    saved_bytes: dict[str, int] | None = None
    # With saved activations in FP8 (fp8fx.passes.saved_activations): each tensor forward saves, as kept.
    saved_tensors: list[SavedTensor] = field(default_factory=list)
    dynamo: DynamoGraph | None = None  # None: compiled outside Dynamo
    memory_pass_counts: MemoryPassCounts | None = None  # inner="inductor": the memory passes of the kernels Inductor made

    @property
    def superseded(self) -> bool:
        return self.dynamo is not None and self.dynamo.superseded_by is not None

    def same_params(self, other: GraphRecord) -> bool:
        return len(self.params) == len(other.params) and all(a() is b() for a, b in zip(self.params, other.params))

    def belongs_to(self, param_ids: set[int]) -> bool:
        alive = [p() for p in self.params]
        return bool(alive) and all(p is not None and id(p) in param_ids for p in alive)


def _refuse_dtensors(example_inputs: list[Any]) -> None:
    """Tensor and sequence parallelism hand the graph DTensors (FSDP2 hands it plain unsharded
    parameters): their FP8 scales would need reductions across the model-parallel group."""
    from torch.distributed.tensor import DTensor

    found = next((x for x in example_inputs if isinstance(x, DTensor)), None)
    if found is not None:
        raise NotImplementedError(
            f"fp8fx: a graph input is a DTensor sharded as {found.placements} on {found.device_mesh}: tensor and sequence "
            "parallelism are not supported; fp8fx composes with DistributedDataParallel and FSDP2 (fully_shard) only"
        )


def _amax_group_name(state: Fp8State | None) -> str | None:
    """The process group that delayed-scaling amaxes are reduced over, when there is more than one rank."""
    import torch.distributed as dist

    if state is None or not dist.is_available() or not dist.is_initialized():
        return None
    group = state.amax_group if state.amax_group is not None else dist.group.WORLD
    return group.group_name if dist.get_world_size(group) > 1 else None


def _graph_kind(gm: fx.GraphModule) -> str:
    is_joint = any(n.op == "placeholder" and str(n.target).startswith("tangents") for n in gm.graph.nodes)
    return "training" if is_joint else "inference"


FUSABLE_ACTIVATIONS = (torch.ops.aten.gelu.default, torch.ops.aten.silu.default)
# Ops that reach the FP8 passes whole under Inductor: activations, to fuse them into epilogues, and
# matrix products, which Inductor's table turns into elementwise code when a dimension is 1 (mv,
# dot, a GEMM of a single row: products without a row otherwise). The joint pass decomposes what
# is left of them, as Inductor would have.
KEPT_WHOLE = (*FUSABLE_ACTIVATIONS, *BY_TARGET, *OPAQUE)


class Fp8fxBackend:
    """A `torch.compile` backend that runs matmuls in FP8 by policy and records every decision."""

    def __init__(self, options: BackendOptions | None = None, **kwargs: Any):
        """Built from `options`, or from `BackendOptions`'s keyword arguments (those of `fp8fx.backend`)."""
        if options is not None and kwargs:
            raise TypeError("Fp8fxBackend: give a BackendOptions or its keyword arguments, not both")
        self.options = options if options is not None else BackendOptions(**kwargs)
        policy = self.options.policy
        self.graphs: list[GraphRecord] = []
        # With inner="eager" and keep_graphs, the rewritten graphs as they run, for inspection:
        # ("forward" | "backward" | "inference", GraphModule).
        self.kept_graphs: list[tuple[str, fx.GraphModule]] = []
        # Set by fp8fx.analyze with numerics: the collector its probes register with.
        self.numerics: NumericsCollector | None = None
        # The runtime monitor (fp8fx.stats): every cast sampled every `monitor_every` calls.
        self.monitor = Monitor(self.options.monitor_every) if self.options.monitor_every else None
        # Shadow checks (policy `shadow`), the GEMMs they switched to high precision, and a
        # counter of switches that tells compiled graphs to rebuild.
        self.shadow = ShadowChecks(policy.shadow, self._switch) if policy.shadow is not None else None
        self.overrides: dict[tuple[str, str], str] = {}
        self.generation = 0
        # Every parameter a compiled graph was called with. One graph serves every instance of a
        # module Dynamo compiled alone (each block of a stack it graph-broke around), so the
        # parameters of the first compile are not all of them.
        # (id -> parameter, weakly: tensors compare elementwise, so no WeakSet.)
        self.params_seen: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __repr__(self) -> str:
        return f"Fp8fxBackend(inner={self.inner!r}, policy={self.policy.source or 'built-in'}, graphs={len(self.graphs)})"

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]):
        compile_id = CompileContext.current_compile_id()
        origin = DynamoGraph(compile_id) if compile_id is not None and compile_id.frame_id is not None else None
        if self.shadow is None:
            first = len(self.graphs)
            return self._in_use(self._build(gm, example_inputs), origin, self.graphs[first:])
        # Shadow checks may switch GEMMs to high precision: keep the graph to rebuild it then, and
        # drop the previous build's records from the report.
        pristine = copy.deepcopy(gm)
        current = {"generation": self.generation}

        def build() -> None:
            first = len(self.graphs)
            current["fn"] = self._build(copy.deepcopy(pristine), example_inputs)
            stale = current.get("records", [])
            current["records"] = self.graphs[first:]
            for record in current["records"]:
                record.dynamo = origin
            self.graphs = [g for g in self.graphs if all(g is not r for r in stale)]

        build()

        def run(*args):
            if current["generation"] != self.generation:
                current["generation"] = self.generation
                build()
            return current["fn"](*args)

        return self._in_use(run, origin, current["records"])

    def _in_use(self, fn, origin: DynamoGraph | None, records: list[GraphRecord]):
        """Tag `records` (the graphs of one Dynamo compile) with `origin`, mark the older graphs
        they replace superseded (see DynamoGraph), and return `fn`, which puts its graphs back in
        use whenever it runs."""
        if origin is None:
            return fn
        for record in records:
            record.dynamo = origin
        replaced = [
            old.dynamo
            for old in self.graphs
            for new in records
            if old.dynamo is not None
            and not old.superseded
            and old.dynamo.replaced_by(origin.compile_id)
            and old.kind == new.kind
            and old.same_params(new)
        ]
        reasons = _recompile_reasons() if replaced else {}
        for old in replaced:
            old.superseded_by, old.recompile_reason = str(origin.compile_id), reasons.get(str(old.compile_id))

        def run(*args):
            if origin.superseded_by is not None:  # its guards passed again
                origin.superseded_by = origin.recompile_reason = None
            return fn(*args)

        run._boxed_call = getattr(fn, "_boxed_call", False)  # called as fn was: boxed, inputs freed early
        return run

    def cache_key(self) -> str | None:
        """The key of this backend's rewrite for Inductor's caches (`fp8fx.compiler.cache`); None
        when its graphs call back into this process (monitor, shadow checks, numerics probes)."""
        if self.monitor is not None or self.shadow is not None or self.numerics is not None:
            return None
        # Kernel choices also depend on whether Triton imports here and on the GPUs' measured tables
        # (selftest's, and those measured at compile: a compile that changes them is not cached,
        # see _InductorJointHook.uuid).
        o = self.options
        options = {
            "policy": o.policy.to_dict(),
            "fuse_epilogues": o.fuse_epilogues,
            "kernels": o.kernels,
            "measure_gemms": o.measure_gemms,
            "saved_outputs": o.saved_outputs,
            "saved_activations": o.saved_activations,
            "weight_fp8": o.weight_fp8,
            "cublas_devices": list(o.cublas_devices),  # what the lowering after partitioning gives cuBLAS
            "overrides": sorted(self.overrides.items()),
            "triton": triton_available(),
            "tables": cache.tables_digest(),
        }
        return cache.pass_key(options)

    def _switch(self, site: str, role: str, reason: str) -> None:
        """A shadow check's verdict: this GEMM runs in high precision from the next call on."""
        self.overrides[(site, role)] = reason
        self.generation += 1

    def _build(self, gm: fx.GraphModule, example_inputs: list[Any]):
        _refuse_dtensors(example_inputs)
        for device in {x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.device.type == "cuda"}:
            device_target(device)  # one clear error for a ROCm GPU or one without FP8 tensor cores
        gm = BEFORE_AOT(gm, StageContext(options=self.options))  # (with delayed scaling, a copy taking the handle too)
        positions = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.nn.Parameter)]
        param_objs = [example_inputs[i] for i in positions]
        rewrite = _Rewrite(self, [weakref.ref(p) for p in param_objs], frozenset(positions))
        compile_fn = self._compile_eager if self.options.inner == "eager" else self._compile_inductor
        if self.options.policy.uses_delayed_scaling:
            compiled = self._build_delayed(gm, example_inputs, rewrite, compile_fn, param_objs, positions)
        else:
            compiled = compile_fn(gm, example_inputs, rewrite)
        return self._recording_params(compiled, positions)

    def _build_delayed(self, gm, example_inputs, rewrite: _Rewrite, compile_fn, param_objs, positions: list[int]):
        """Compile with delayed scaling: the graph takes one more input, the handle its state ops
        find the states by (`fp8fx.ops.delayed`). Which states it uses comes from its own rewrite
        (or, served from Inductor's cache, from the records kept beside it). Dynamo runs one graph
        for every instance of a module compiled alone (each block), so the handle is chosen per
        call by the parameters the graph receives."""
        found = locate(param_objs)
        rewrite.state = found[0] if found is not None else None
        first = len(self.graphs)
        handle = torch.zeros(1, dtype=torch.int64)
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        example = fake_mode.from_tensor(handle, static_shapes=True) if fake_mode else handle
        compiled = compile_fn(gm, [*example_inputs, example], rewrite)
        needed = {key: length for g in self.graphs[first:] for key, length in g.delayed_states.items()}
        if not needed:  # no GEMM of this graph casts with delayed scaling
            return lambda *args: compiled(*args, handle)
        keys = list(needed)
        device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
        handles: dict[tuple[int, ...], tuple[StateInstance, torch.Tensor]] = {}

        def handle_for(params: list[torch.Tensor]) -> torch.Tensor:
            ids = tuple(id(p) for p in params)
            if ids not in handles:
                located = locate(params)
                if located is None:
                    raise RuntimeError(
                        "fp8fx: delayed scaling keeps its amax histories and scales in the model: call "
                        "fp8fx.prepare(model) before torch.compile(model, ...)"
                    )
                owner, prefix = located
                names = dict(zip(keys, instance_keys(keys, prefix)))
                for key, name in names.items():
                    owner.ensure(name, needed[key], device)
                instance = StateInstance(owner, names)
                handles[ids] = (instance, delayed_ops.register(instance))  # the entry keeps the instance alive
            return handles[ids][1]

        handle_for(param_objs)  # the states exist from the compile on (a state_dict before the first step has them)
        return lambda *args: compiled(*args, handle_for([args[i] for i in positions]))

    def _recording_params(self, fn, positions: list[int]):
        """`fn`, adding the parameters each call passes (at `positions`) to `params_seen`."""
        seen = self.params_seen

        def run(*args):
            boxed = len(args) == 1 and isinstance(args[0], list)  # (a boxed call passes one list, which fn clears)
            given = args[0] if boxed else args
            for i in positions:
                seen[id(given[i])] = given[i]
            return fn(*args)

        run._boxed_call = getattr(fn, "_boxed_call", False)
        return run

    def rewrite(
        self,
        gm: fx.GraphModule,
        params: list[weakref.ref],
        state: Fp8State | None = None,
        param_inputs: frozenset[int] | None = None,
    ) -> fx.GraphModule:
        """Run the FP8 passes on an ATen graph (joint or inference) and record the decisions.

        With delayed scaling the graph's last input (before the tangents) is the handle its state
        ops take (`_build_delayed` adds it to every graph this backend compiles)."""
        kind = _graph_kind(gm)
        traffic = non_gemm_bytes(gm.graph)
        taps = Taps(
            monitor=self.monitor.tap_handler if self.monitor is not None else None,
            shadow=self.shadow.tap_handler if self.shadow is not None else None,
            numerics=self.numerics,
            graph_index=len(self.graphs),
        )
        delayed = None
        if self.options.policy.uses_delayed_scaling:
            handle = [n for n in gm.graph.nodes if n.op == "placeholder" and not str(n.target).startswith("tangents")][-1]
            delayed = DelayedInputs(handle, _amax_group_name(state))
        ctx = PassContext(
            options=self.options,
            overrides=dict(self.overrides),
            param_inputs=param_inputs,
            taps=taps,
            delayed=delayed,
            inference=kind == "inference",
        )
        gm = run_passes(gm, ctx, REWRITE.passes, stage=REWRITE.name)
        index = len(self.graphs)
        ops = [OpRecord.make(index, kind, ann) for ann in annotations(gm.graph)]
        self.graphs.append(GraphRecord(index, kind, ops, params, state, traffic, delayed_states=ctx.delayed_states))
        return gm

    def keep_saved(self, forward: fx.GraphModule, backward: fx.GraphModule, num_fwd_outputs: int) -> None:
        """A partitioned training graph's saved activations, kept in FP8 where the policy says
        (`fp8fx.passes.saved_activations`), recorded on the joint graph's record."""
        if self.options.saves_fp8:
            saved = self.options.policy.saved_activations
            self.graphs[-1].saved_tensors = keep_saved_in_fp8(
                forward, backward, num_fwd_outputs, saved, self.options.saved_precision
            )

    def _keep(self, kind: str, gm: fx.GraphModule) -> None:
        if self.options.keep_graphs:
            self.kept_graphs.append((kind, gm))

    def _compile_eager(self, gm: fx.GraphModule, example_inputs: list[Any], rewrite: _Rewrite):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        ctx = StageContext(options=self.options, rewrite=rewrite)

        def partition_fn(joint_gm, joint_inputs, **kwargs):
            EAGER_JOINT(joint_gm, ctx)
            forward, backward = min_cut_rematerialization_partition(joint_gm, joint_inputs, **kwargs)
            self.keep_saved(forward, backward, kwargs["num_fwd_outputs"])
            self.graphs[-1].saved_bytes = saved_activation_bytes(forward, kwargs["num_fwd_outputs"])
            return forward, backward

        def boxed(kind: str):
            def compiler(gm, _inputs):
                graph_ctx = replace(ctx, graph=kind)
                gm = EAGER_JOINT(gm, graph_ctx) if kind == "inference" else gm
                gm = EAGER_AFTER_PARTITION(gm, graph_ctx)
                self._keep(kind, gm)
                return make_boxed_func(gm)

            return compiler

        return aot_autograd(
            fw_compiler=boxed("forward"),
            bw_compiler=boxed("backward"),
            inference_compiler=boxed("inference"),
            partition_fn=partition_fn,
        )(gm, example_inputs)

    def _compile_inductor(self, gm: fx.GraphModule, example_inputs: list[Any], rewrite: _Rewrite):
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        key = rewrite.pass_key()
        records_key = cache.graph_key(key, gm, example_inputs) if key is not None else None
        first = len(self.graphs)
        passes = MemoryPassCounts()
        with cache.kept_whole(KEPT_WHOLE) as decompositions:
            ctx = StageContext(options=self.options, rewrite=rewrite, kept_whole=decompositions, memory_pass_counts=passes)
            hook = _InductorJointHook(ctx, key)
            partitioner = _SavedFp8Partitioner(self, key) if self.options.saves_fp8 else None
            with inductor_config.patch(joint_custom_pre_pass=hook, custom_partitioner_fn=partitioner):
                compiled = compile_fx(gm, example_inputs, inner_compile=functools.partial(compile_partitioned, ctx=ctx))
        made = self.graphs[first:]
        if made and hook.refused:  # Inductor cached nothing of this compile: no records either
            records_key = None
        for g in made:  # (a backward Inductor compiles later is counted when it does: the report reads the counts)
            g.memory_pass_counts = passes
        if records_key is not None and made:

            def save() -> None:  # now, and again once a backward compiled later is counted
                kept = [
                    {
                        "kind": g.kind,
                        "ops": [op.with_memory_pass_counts(passes) for op in g.ops],
                        "non_gemm_bytes": g.non_gemm_bytes,
                        "delayed_states": g.delayed_states,
                        "saved_tensors": [t.to_dict() for t in g.saved_tensors],
                    }
                    for g in made
                ]
                cache.save_records(records_key, kept)

            save()
            passes.after_compile = save
        elif records_key is not None:  # served from Inductor's cache: the pass did not run
            for g in cache.load_records(records_key):
                index = len(self.graphs)
                ops = [replace(op, graph=index) for op in g["ops"]]
                params, state = rewrite.params, rewrite.state
                saved = [SavedTensor.from_dict(t) for t in g.get("saved_tensors", [])]
                record = GraphRecord(
                    index, g["kind"], ops, params, state, g["non_gemm_bytes"], g["delayed_states"], saved_tensors=saved
                )
                self.graphs.append(record)
        return compiled


def _read_option(name: str) -> property:
    return property(lambda self: getattr(self.options, name), doc=f"`options.{name}`, read-only")


for _option in fields(BackendOptions):  # each option reads as an attribute of the backend too: backend.policy, .inner, ...
    if _option.name not in vars(Fp8fxBackend):
        setattr(Fp8fxBackend, _option.name, _read_option(_option.name))


class _Rewrite:
    """The rewrite bound to one Dynamo graph (its parameters and, with delayed scaling, the model's state)."""

    def __init__(self, backend: Fp8fxBackend, params: list[weakref.ref], param_inputs: frozenset[int]):
        self.backend, self.params, self.param_inputs = backend, params, param_inputs
        self.state: Fp8State | None = None  # delayed scaling: the model's state

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        return self.backend.rewrite(gm, self.params, self.state, self.param_inputs)

    def pass_key(self) -> str | None:
        """The backend's cache key with what this graph's rewrite adds (parameter inputs, amax group)."""
        key = self.backend.cache_key()
        group = _amax_group_name(self.state)  # None without delayed scaling (no state) or with one process
        return cache.pass_key({"backend": key, "params": sorted(self.param_inputs), "group": group}) if key else None


class _InductorJointHook(CustomGraphPass):
    """Inductor's joint-graph pre-pass: the `JOINT` stage (`fp8fx.compiler.pipeline`), in place.
    `key`: the rewrite's key when the compile began (`_Rewrite.pass_key`)."""

    def __init__(self, ctx: StageContext, key: str | None):
        self.ctx, self.key = ctx, key
        self.refused = False  # a key was refused: the tables changed during the compile

    def uuid(self) -> str | None:
        # With a key, a cached compile skips the pass; the backend then reads its records back.
        # AOTAutograd's cache asks before the pass runs, the FX graph cache after it. When the
        # measured tables changed in between (the pass measured GEMMs, or another process wrote),
        # the choices may follow tables the first key does not name: no key then, so the FX graph
        # cache bypasses the graphs and AOTAutograd's cache, lacking their keys, stores nothing.
        if self.key is None or self.ctx.rewrite.pass_key() == self.key:
            return self.key
        self.refused = True
        return None

    def __call__(self, graph: fx.Graph) -> None:
        JOINT(graph.owning_module, self.ctx)


class _SavedFp8Partitioner(CustomPartitionerFn):
    """Inductor's partitioner (min-cut) followed by `Fp8fxBackend.keep_saved`. `key`: the rewrite's
    key when the compile began, which the saved tensors' choices follow (the policy is in it)."""

    def __init__(self, backend: Fp8fxBackend, key: str | None):
        self.backend, self.key = backend, key

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        forward, backward = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        self.backend.keep_saved(forward, backward, kwargs["num_fwd_outputs"])
        return forward, backward

    def uuid(self) -> str | None:
        return self.key

    def __reduce__(self):  # Inductor pickles its config into cache keys: this partitioner is its key
        return (str, (f"fp8fx.saved_activations:{self.key}",))


DEFAULT_BACKEND = Fp8fxBackend()  # what `backend="fp8fx"` resolves to (entry point)


def backend(policy: Policy | str | Path | None = None, **options: Any) -> Fp8fxBackend:
    """A configured backend: `torch.compile(model, backend=fp8fx.backend(policy="p.yaml"))`.

    `fuse_epilogues` plans each FP8 GEMM with its elementwise neighbours (its epilogue); False
    leaves every GEMM an `fp8fx::scaled_mm` and its neighbours as graph ops. `kernels` picks what
    runs each FP8 GEMM on CUDA (docs/kernels.md, "Which kernel runs each GEMM"): "auto" decides per
    GEMM (`fp8fx.codegen.dispatch`): the faster of the generated kernel with the epilogue and
    cuBLAS's bare GEMM as measured on this GPU model, by `fp8fx selftest` or by the first compile
    that met the GEMM (`measure_gemms`: the seconds per process that compiles may spend timing
    GEMMs no measurement covers, cached per GPU model and versions, `fp8fx.codegen.autotune`;
    0 measures none); without a measurement, under Inductor cuBLAS with the epilogue left to
    Inductor's kernels (`epilogue_to_inductor`), and with inner="eager" the generated kernel where
    its fused epilogue saves memory passes, cuBLAS otherwise. "triton" always runs the generated kernel, "scaled_mm"
    cuBLAS (`torch._scaled_mm`) with the epilogue after it. Either way a GEMM only the generated
    kernel can run (MX scale blocks) runs it. CPU tensors run the exact reference, except that
    under Triton's interpreter (TRITON_INTERPRET=1) the GEMMs given to the generated kernel run it,
    through the launcher a GPU uses.

    `monitor_every=N` samples every FP8 cast's input every N calls (amax, scale, saturated,
    underflowed and non-finite values; `fp8fx.stats(compiled)`); 0 leaves the monitor out.

    `saved_outputs` is what fp32 FP8-GEMM outputs that backward reads are kept as between forward
    and backward: "bf16" (half the bytes; backward reads them rounded to BF16) or "high" (as
    computed); see `fp8fx.passes.saved_outputs`.

    `saved_activations` is what the other tensors backward reads are kept as: "fp8" (E4M3 with a
    scale per row, or as the policy's `saved_activations` section says), "high", or None (the
    policy's section decides; high where it sets nothing); see `fp8fx.passes.saved_activations`.

    `weight_fp8` is what backward's GEMMs read of a weight: "keep" (the FP8 copy forward made,
    saved for backward) or "recompute" (cast again in backward from the weight, which is alive
    anyway, with the scale forward computed: fewer saved bytes for one more cast per weight;
    dynamic scaling only). "auto" (the default) is "recompute" under dynamic scaling and "keep"
    under delayed scaling: a kept copy holds every layer's FP8 weights from forward to backward
    (all of them unsharded under FSDP), which put a Llama step's peak above BF16's for a step only
    slightly faster than recomputing (docs/results.md, "On a GPU").

    `cublas_devices` are the device types on which, under Inductor, a GEMM the graph gives to cuBLAS
    becomes `aten._scaled_mm` in Inductor's code (`fp8fx.compiler.lowering`): ("cuda",), or with
    "cpu" too the graph a GPU runs, run on CPU tensors by torch's CPU `_scaled_mm`.
    `epilogues_to_inductor` plans epilogues for Inductor's fusion (None: when `inner` is "inductor").

    The options are the fields of `fp8fx.passes.options.BackendOptions` (validated there); the
    backend keeps them as `options` and reads each as an attribute too (`backend.policy`, ...)."""
    return Fp8fxBackend(BackendOptions(policy=policy, **options))


def _signature_of_options() -> inspect.Signature:
    """`backend`'s signature as help() and editors show it: BackendOptions's fields, the one list of the options."""
    kinds = {"policy": inspect.Parameter.POSITIONAL_OR_KEYWORD}
    params = [
        inspect.Parameter(f.name, kinds.get(f.name, inspect.Parameter.KEYWORD_ONLY), default=f.default, annotation=f.type)
        for f in fields(BackendOptions)
    ]
    return inspect.Signature(params, return_annotation="Fp8fxBackend")


backend.__signature__ = _signature_of_options()


def _find_backend(compiled: Any) -> Fp8fxBackend | None:
    from torch._dynamo.eval_frame import _TorchDynamoContext

    if isinstance(compiled, torch.nn.Module) and getattr(compiled, "_compiled_call_impl", None) is not None:
        compiled = compiled._compiled_call_impl  # model.compile(backend=...): compiled in place
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
    parameters. Graphs a recompile superseded (see DynamoGraph) keep their rows in
    `Report.superseded` and are counted nowhere."""
    if isinstance(compiled, Fp8fxBackend):
        return _report(compiled)
    found = _find_backend(compiled)
    if found is None:
        raise ValueError(
            "fp8fx.report: this object was not compiled with an fp8fx backend; "
            "use torch.compile(model, backend='fp8fx') or backend=fp8fx.backend(...)"
        )
    graphs = found.graphs
    orig = getattr(compiled, "_orig_mod", compiled)
    if isinstance(orig, torch.nn.Module):
        param_ids = {id(p) for p in orig.parameters()}
        if found is DEFAULT_BACKEND:
            graphs = [g for g in graphs if g.belongs_to(param_ids)]
        if (
            orig is compiled
            and type(orig).__module__.startswith("torch.nn.")
            and not any(g.belongs_to(param_ids) for g in graphs)
        ):
            warnings.warn(
                f"fp8fx: {type(orig).__name__}.compile() captures no graph in torch {torch.__version__} (a torch.nn "
                f"built-in compiled in place is not traced), so its matrix products run in high precision; use "
                f"torch.compile(module, backend=...) or compile the model that contains it",
                stacklevel=2,
            )
    report = _report(found, graphs)
    if isinstance(orig, torch.nn.Module):
        report.uncaptured = find_uncaptured(orig, lambda name, p: found.params_seen.get(id(p)) is p)
    return report


def stats(compiled: Any) -> Monitor:
    """The runtime monitor of a model compiled with `fp8fx.backend(monitor_every=N)`."""
    found = compiled if isinstance(compiled, Fp8fxBackend) else _find_backend(compiled)
    if found is None or found.monitor is None:
        raise ValueError("fp8fx.stats: compile with backend=fp8fx.backend(monitor_every=N) to record FP8 cast statistics")
    return found.monitor


def _report(backend: Fp8fxBackend, graphs: list[GraphRecord] | None = None) -> Report:
    graphs = backend.graphs if graphs is None else graphs

    def summed(dicts) -> dict[str, int]:
        total: dict[str, int] = {}
        for d in dicts:
            for fqn, n in d.items():
                total[fqn] = total.get(fqn, 0) + n
        return total

    def rows(g: GraphRecord) -> list[OpRecord]:
        ops = [op.with_state(g.state) for op in g.ops]
        if g.memory_pass_counts is not None:
            ops = [op.with_memory_pass_counts(g.memory_pass_counts) for op in ops]
        if g.dynamo is None:
            return ops
        state = "superseded" if g.superseded else "in_use"
        d = g.dynamo
        return [
            replace(
                op,
                compile_id=str(d.compile_id),
                graph_state=state,
                superseded_by=d.superseded_by,
                recompile_reason=d.recompile_reason,
            )
            for op in ops
        ]

    in_use = [g for g in graphs if not g.superseded]
    training = [g for g in in_use if g.saved_bytes is not None]
    report = Report(
        [op for g in graphs for op in rows(g)],
        non_gemm_bytes=summed(g.non_gemm_bytes for g in in_use),
        saved_bytes=summed(g.saved_bytes for g in training) if training else None,
        saved_tensors=[t for g in in_use for t in g.saved_tensors],
    )
    report.monitor = backend.monitor
    return report
