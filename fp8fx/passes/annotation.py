"""`GemmAnnotation`: what fp8fx keeps in node meta about each GEMM, under `META_KEY`.

`assign_precision` writes it on each GEMM found by `find_matmuls`: where the GEMM is (site,
module, source line, role, dimensions) and its `Decision`. Later passes never decide again: they
read it, and when they replace the GEMM node they carry it to the new node with what they added
(`insert_casts`: the delayed-scaling states its operands use; `fuse_epilogues`: its `Fusion` and
the measurement that chose its kernel).
The report, the cost model, export, folding in analysis and the FP8 all-gather read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from fp8fx.core.formats import Fp8Format
from fp8fx.core.recipes import AmaxComputeAlgo, Granularity, Precision, ScaleRounding, Scaling

if TYPE_CHECKING:
    from fp8fx.codegen.dispatch import Timing
    from fp8fx.codegen.variants import GemmVariant
    from fp8fx.core.epilogue import Epilogue

# The GEMM annotations' node-meta key. fp8fx writes these others too: `val` (the fake value of each
# node it adds), PyTorch's provenance keys copied to a node from the one it replaces or serves
# (fp8fx.passes.graph_utils.copy_meta), `recompute` (a CheckpointPolicy telling min-cut to compute
# again in backward: weight casts, fp8fx.passes.insert_casts; the copies let_backward_cast_again adds),
# and the lowering's own (fp8fx.compiler.lowering: fp8fx_charged_to, fp8fx_lowered_from, fp8fx_partition_copy).
META_KEY = "fp8fx"


class ReasonKind(str, Enum):
    """Why a GEMM got its precision; the report groups fallbacks by these."""

    POLICY = "policy"  # the policy's defaults or a rule said so
    OP_KIND = "op_kind"  # op kind not enabled for FP8 (batched matmuls by default)
    SHAPE = "shape"  # dimensions FP8 GEMMs cannot take
    DTYPE = "dtype"  # operands are not fp32/bf16/fp16
    PATTERN = "pattern"  # a form of the op fp8fx does not rewrite
    OPAQUE = "opaque"  # an op that multiplies matrices inside, which fp8fx cannot rewrite
    CONV = "conv"  # a convolution: fp8fx runs convolutions in high precision
    UNLINKED = "unlinked"  # a backward GEMM with no forward site to take a policy from
    SHADOW = "shadow"  # a shadow high-precision check found its FP8 result too far off
    MEASURED = "measured"  # measured slower in FP8 than in BF16 on the GPU that runs it (fp8fx.passes.prefer_bf16)


@dataclass(frozen=True)
class DelayedSpec:
    history_len: int
    algo: AmaxComputeAlgo
    interval: int


@dataclass(frozen=True)
class Decision:
    precision: Precision
    reason_kind: ReasonKind
    reason: str
    operand_roles: tuple[str, str]  # left, right: input | weight | grad_output
    formats: tuple[Fp8Format, Fp8Format] | None = None  # left, right when FP8
    scaling: Scaling | None = None
    granularity: Granularity | None = None
    blocks: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # left, right scale blocks (see fp8fx.core.scaling)
    power_of_two: bool = False
    margin: int = 0
    scale_rounding: ScaleRounding | None = None  # mx: how its E8M0 block scales are rounded (floor | rceil)
    delayed: DelayedSpec | None = None  # set when scaling is delayed
    fast_accum: bool = False  # Hopper's unpromoted FP8 accumulator for the whole K loop (policy fast_accum)
    stochastic_rounding: bool = False  # NVFP4: its grad_output operands are rounded stochastically
    hadamard: bool = False  # NVFP4: both operands take the random Hadamard transform along K
    source: str = ""  # the policy's part that settled it: "defaults", "rules[1] (match 'layers.0')"; "" when no rule could

    @property
    def fp8(self) -> bool:
        return self.precision is Precision.FP8


@dataclass(frozen=True)
class Fusion:
    """How an FP8 GEMM runs on a GPU: the kernel, its fused epilogue and why fusion stopped."""

    kernel: str | None = None  # "triton" (the generated kernel) | "scaled_mm" (torch._scaled_mm, the epilogue as torch ops)
    # | "nvfp4" (the generated NVFP4 kernel, the epilogue as torch ops) | "scaled_grouped_mm"
    # (torch._scaled_grouped_mm) | "emulated" (the reference in torch ops) for grouped GEMMs
    kernel_reason: str | None = None
    stop: str | None = None  # why fusion stopped where it did
    epilogue: Epilogue | None = None  # the fused epilogue (None: not fused)
    absorbed: tuple[str, ...] = ()  # the graph nodes the fused kernel replaced
    variant: GemmVariant | None = None  # the generated kernel's variant
    memory_passes: tuple[int, int] | None = None  # full-tensor passes FP8 adds over BF16, and the epilogue saves
    transposed_copies: int = 0  # of those added, the operand copies the GEMM makes (not K-contiguous)


Dim = Any  # int, a SymInt when dynamic, None when the op's shapes do not tell it


@dataclass(frozen=True)
class GemmAnnotation:
    index: int  # position among the graph's GEMMs, in the order find_matmuls lists them
    site: str  # module FQN, or "fqn:op#i" when a module holds several matrix products
    fqn: str
    op: str  # the pattern kind (fp8fx.core.patterns) or an opaque op's name
    role: str  # output | grad_input | grad_weight
    source: str  # file:line of the model code
    m: Dim
    n: Dim
    k: Dim
    batch: Dim
    flops: int  # from the shape hints where a dimension is symbolic; 0 when one is unknown
    decision: Decision
    state_keys: tuple[str | None, str | None] | None = None  # delayed scaling: the operands' states
    fusion: Fusion | None = None
    groups: Dim = None  # a grouped GEMM's number of groups (None: not grouped)
    flops_hinted: bool = False  # flops counts the compile's hint of a symbolic dimension
    # The measurement that chose its GPU kernel (fuse_epilogues) or kept it high (prefer_bf16).
    measured: Timing | None = None

    @property
    def fp8(self) -> bool:
        return self.decision.fp8


def state_key(site: str, gemm_role: str, operand_role: str) -> str:
    """The name of one operand's delayed-scaling state (and its monitor series): `site.role.operand`."""
    return f"{site}.{gemm_role}.{operand_role}"


def node_annotations(node: fx.Node) -> tuple[GemmAnnotation, ...]:
    """The annotations of the GEMMs a node computes: one, or one per gradient for an op computing
    several (a convolution's backward), or none."""
    found = node.meta.get(META_KEY)
    return found if isinstance(found, tuple) else ()


def annotation(node: fx.Node) -> GemmAnnotation | None:
    """The annotation of a node computing one GEMM (every FP8 GEMM does), None for other nodes."""
    found = node_annotations(node)
    if len(found) > 1:
        raise ValueError(f"{node.name} computes {len(found)} GEMMs; read node_annotations")
    return found[0] if found else None


def annotate(node: fx.Node, value: GemmAnnotation) -> None:
    """Set the annotation of the node's GEMM of `value.role`."""
    others = tuple(a for a in node_annotations(node) if a.role != value.role)
    node.meta[META_KEY] = (*others, value)


def annotations(graph: fx.Graph) -> list[GemmAnnotation]:
    """Every GEMM annotation of the graph, in find_matmuls' order."""
    return sorted((a for n in graph.nodes for a in node_annotations(n)), key=lambda a: a.index)


def update_fusion(node: fx.Node, **changes: Any) -> None:
    """Replace the node's annotation by one whose `fusion` has `changes`."""
    ann = annotation(node)
    annotate(node, replace(ann, fusion=replace(ann.fusion or Fusion(), **changes)))


def fp8_gemm_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The graph's FP8 GEMM nodes (`fp8fx::scaled_mm`, `fp8fx::fp8_gemm`, `fp8fx::fp8_grouped_mm`)."""
    ops = (torch.ops.fp8fx.scaled_mm.default, torch.ops.fp8fx.fp8_gemm.default, torch.ops.fp8fx.fp8_grouped_mm.default)
    return [n for n in graph.nodes if n.op == "call_function" and n.target in ops]
