"""One `OpRecord` per GEMM of a compiled graph: what fp8fx decided for it and why, read from its
annotation. The rows of the report (`fp8fx.reporting.records.Report`), which the cost model and
the uncaptured-weights finder read too."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fp8fx.passes.annotation import GemmAnnotation


def has_values(t: torch.Tensor) -> bool:
    """False for shape-only tensors (meta device, or fake tensors of an analysis)."""
    return not (t.is_meta or isinstance(t, FakeTensor))


def _dim(d: Any) -> int | str:
    """A dimension: an integer, a symbol's name when dynamic, "?" when the op's shapes do not tell it."""
    return d if isinstance(d, int) else "?" if d is None else str(d)


@dataclass(frozen=True)
class OpRecord:
    """What fp8fx decided for one GEMM, and why."""

    graph: int  # index of the compiled graph (recompiles and graph breaks add graphs)
    graph_kind: str  # training | inference
    site: str  # site name: module FQN, or "fqn:op#i" when a module holds several matmuls
    fqn: str
    op: str  # mm | addmm | bmm | baddbmm | addbmm | grouped_mm | sdpa | conv, or an opaque op (_scaled_grouped_mm, ns::name, ...)
    role: str  # output | grad_input | grad_weight
    source: str  # file:line of the model code
    m: int | str
    n: int | str
    k: int | str
    batch: int | str
    flops: int  # from the compile's shape hints where a dimension is dynamic; 0 when one is unknown (flops_known)
    precision: str  # fp8 | high
    reason_kind: str
    reason: str
    operands: tuple[str, str]  # roles of the left and right operand
    formats: tuple[str, str] | None  # FP8 format of the left and right operand
    scaling: str | None
    granularity: str | None
    blocks: tuple[tuple[int, ...], tuple[int, ...]] | None  # scale blocks of the left and right operand (0 = whole dim)
    power_of_two_scales: bool | None
    margin: int | None
    amax_history_len: int | None  # delayed scaling only, as are the next fields
    amax_compute_algo: str | None
    interval: int | None
    state_keys: tuple[str | None, str | None] | None  # the states the operands' scales come from
    # Code generation: the generated kernel, the fused epilogue (fp8fx.core.epilogue.Epilogue
    # spec), why fusion stopped where it did, and full-tensor memory passes FP8 adds over BF16
    # (amax, cast, transposing copies) and the epilogue saves (each fused elementwise op / amax).
    kernel: str | None = None
    # What runs the GEMM on a GPU ("triton": the generated kernel; "scaled_mm": torch._scaled_mm
    # with the epilogue as torch ops) and why (fp8fx.codegen.dispatch), and whether Hopper keeps
    # its reduced-precision FP8 accumulator for the whole K loop (policy fast_accum).
    gpu_kernel: str | None = None
    gpu_kernel_reason: str | None = None
    # The measurement on the GPU that chose that kernel, or kept the GEMM high (reason kind
    # "measured"), in ms: the generated kernel and torch._scaled_mm, each with the epilogue it runs,
    # and BF16 torch.mm (addmm with a bias; None: the table has no BF16 time).
    measured_generated_ms: float | None = None
    measured_scaled_mm_ms: float | None = None
    measured_bf16_ms: float | None = None
    fast_accum: bool | None = None
    # NVFP4: whether the GEMM's gradient operand rounds stochastically, and whether both operands
    # take the random Hadamard transform along K (the weight gradient's).
    stochastic_rounding: bool | None = None
    hadamard: bool | None = None
    scale_rounding: str | None = None  # mx: how its E8M0 block scales are rounded (floor | rceil)
    epilogue: str | None = None
    fusion: str | None = None
    memory_passes_added: int | None = None
    memory_passes_saved: int | None = None
    transposed_copies: int | None = None  # of the passes added, the operand copies the GEMM makes
    # "inductor": the casts' passes counted from the kernels Inductor made (fp8fx.compiler.memory_passes);
    # "ops": as the ops run one by one (inner="eager", or a graph served from Inductor's cache).
    memory_passes_from: str | None = None
    # Delayed scaling, read from the model when the report is made:
    scale: tuple[float, float] | None = None  # x_fp8 = saturate(x * scale)
    scale_inv: tuple[float, float] | None = None  # x ~= x_fp8 * scale_inv
    non_finite: tuple[int, int] | None = None  # steps whose amax was inf or NaN (the scale was kept)
    # Analysis extras: measured numerics (fp8fx.runtime.numerics.GemmNumerics) and predicted time on a
    # target GPU (fp8fx.reporting.costmodel.Prediction).
    numerics: Any = None
    predicted: Any = None
    # The Dynamo compile of the graph ("frame/compile"; None outside Dynamo) and its state:
    # "in_use", or "superseded" by a recompile of the same frame (the compile id that replaced it
    # and Dynamo's guard failure; see fp8fx.compiler.backend.DynamoGraph). Superseded rows are kept as
    # history and counted nowhere.
    compile_id: str | None = None
    groups: int | str | None = None  # a grouped GEMM's number of groups (op grouped_mm)
    flops_hinted: bool = False  # a dimension is dynamic, and flops counts the size the graph was compiled for
    graph_state: str = "in_use"
    superseded_by: str | None = None
    recompile_reason: str | None = None

    @property
    def backward(self) -> bool:
        return self.role != "output"

    @property
    def flops_known(self) -> bool:
        return self.flops_hinted or all(isinstance(d, int) for d in (self.m, self.n, self.k, self.batch))

    @property
    def slower(self) -> bool:
        """Predicted slower in FP8 than in BF16 on the report's target (a "red cell")."""
        return self.precision == "fp8" and self.predicted is not None and self.predicted.speedup < 1

    @classmethod
    def make(cls, graph: int, graph_kind: str, ann: GemmAnnotation) -> OpRecord:
        decision, fusion = ann.decision, ann.fusion
        fp8 = decision.fp8
        delayed = decision.delayed if fp8 else None
        return cls(
            graph=graph,
            graph_kind=graph_kind,
            site=ann.site,
            fqn=ann.fqn,
            op=ann.op,
            role=ann.role,
            source=ann.source,
            m=_dim(ann.m),
            n=_dim(ann.n),
            k=_dim(ann.k),
            batch=_dim(ann.batch),
            flops=ann.flops,
            precision=decision.precision.value,
            reason_kind=decision.reason_kind.value,
            reason=decision.reason,
            operands=decision.operand_roles,
            formats=tuple(f.value for f in decision.formats) if decision.formats else None,
            scaling=decision.scaling.value if decision.scaling else None,
            granularity=decision.granularity.value if decision.granularity else None,
            blocks=decision.blocks if fp8 else None,
            power_of_two_scales=decision.power_of_two if fp8 else None,
            margin=decision.margin if fp8 else None,
            amax_history_len=delayed.history_len if delayed else None,
            amax_compute_algo=delayed.algo.value if delayed else None,
            interval=delayed.interval if delayed else None,
            state_keys=ann.state_keys if fp8 else None,
            kernel=fusion.variant.name if fusion and fusion.variant else None,
            gpu_kernel=fusion.kernel if fusion else None,
            gpu_kernel_reason=fusion.kernel_reason if fusion else None,
            measured_generated_ms=ann.measured.generated_ms if ann.measured else None,
            measured_scaled_mm_ms=ann.measured.scaled_mm_ms if ann.measured else None,
            measured_bf16_ms=ann.measured.bf16_ms if ann.measured else None,
            fast_accum=decision.fast_accum if fp8 else None,
            stochastic_rounding=decision.stochastic_rounding if fp8 else None,
            hadamard=decision.hadamard if fp8 else None,
            scale_rounding=decision.scale_rounding.value if fp8 and decision.scale_rounding else None,
            epilogue=fusion.epilogue.spec() if fusion and fusion.epilogue else None,
            fusion=fusion.stop if fusion else None,
            memory_passes_added=fusion.memory_passes[0] if fusion and fusion.memory_passes else None,
            memory_passes_saved=fusion.memory_passes[1] if fusion and fusion.memory_passes else None,
            transposed_copies=fusion.transposed_copies if fusion and fusion.memory_passes else None,
            memory_passes_from="ops" if fusion and fusion.memory_passes else None,
            groups=_dim(ann.groups) if ann.groups is not None else None,
            flops_hinted=ann.flops_hinted,
        )

    def with_memory_pass_counts(self, counts) -> OpRecord:
        """This record with the passes counted from Inductor's kernels, where they were counted
        (`fp8fx.compiler.memory_passes.MemoryPassCounts`)."""
        if self.memory_passes_added is None or not counts.counted(self.role):
            return self
        copies = 0 if (self.site, self.role) in counts.laid_out else self.transposed_copies
        added = counts.counts[(self.site, self.role)] + (copies or 0)
        return replace(self, memory_passes_added=added, transposed_copies=copies, memory_passes_from="inductor")

    def with_state(self, state) -> OpRecord:
        """This record with the current scale, scale_inv and non-finite counts of its delayed states."""
        if state is None or not self.state_keys or not any(self.state_keys):
            return self
        found = [state.get(key) if key else None for key in self.state_keys]
        if any(f is None for f in found) or not has_values(found[0].scale):  # shape-only analysis
            return self
        scales = tuple(f.scale.item() for f in found)
        return replace(
            self,
            scale=scales,
            scale_inv=tuple(1.0 / s for s in scales),
            non_finite=tuple(int(f.non_finite.item()) for f in found),
        )


def repeated_site(site: str) -> str:
    """`layers.3.mlp` -> `layers.*.mlp`: the name a site shares with its copies in repeated blocks."""
    return re.sub(r"(?<=\.)\d+(?=[.:]|$)", "*", site)
