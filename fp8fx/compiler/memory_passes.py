"""Memory passes FP8 adds, counted from the kernels Inductor makes of a graph.

A pass is one kernel's read or write of an operand-sized tensor in memory. After Inductor has
fused a graph's nodes into kernels, each kernel that computes part of a lowered amax, cast or
saved copy (`fp8fx.compiler.lowering`; a scale is scalar work) is charged, on that op's GEMM, with
- each operand-sized tensor it writes for FP8 (the FP8 copy, a saved copy) that outlives it, and
- each operand-sized tensor it reads only for FP8 work: an amax or cast that rides on the kernel
  producing or already reading its tensor reads nothing more, and costs nothing here.
GEMMs are not counted: on a GPU they are not kernels Inductor generates, and on CPU the kernels of
an emulated GEMM stand for one. The K-major copy of an operand that is not K-contiguous is a node
of the graph charged to its GEMM (`fp8fx.compiler.lowering.lay_out_operands`), counted like a cast.

Inductor calls `count_after_fusion` (its `_post_fusion_custom_pass`, in a form its FX graph cache
can key) while `counting` is active. A graph served from that cache is not scheduled again: it
gets no count, and the report keeps the count of the ops one by one (`memory_passes_from: "ops"`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch

from fp8fx.compiler.lowering import CHARGED_TO, EMULATED_GEMMS, LOWERED_FROM

_active: list[MemoryPassCounts] = []


class MemoryPassCounts:
    """Memory passes per charged GEMM ((site, role) -> count) over the graphs compiled while counting."""

    def __init__(self, charge=None) -> None:
        # Which GEMM a scheduled node's FP8 work is charged to (`_charge`; a benchmark counting
        # another library's kernels passes its own).
        self.charge = charge or _charge
        self.counts: Counter = Counter()
        # Which graphs Inductor scheduled: "forward" (or inference) and "backward"; a graph served
        # from its cache is not scheduled, and its GEMMs keep the passes' estimate.
        self.scheduled: set[str] = set()
        self.min_numel = 0  # the smallest operand-sized tensor of the graph being compiled
        self.graph = "forward"
        self.after_compile = None  # called after each graph counted (a backward compiles after the forward has run)
        # What runs on the fused kernels of the graph being compiled in place of `count` (fp8fx's
        # `AFTER_FUSION` stage, which counts them); None: `count`.
        self.after_fusion = None
        # The GEMMs (site, role) whose operands the graph lays out, so that their launchers copy
        # nothing (fp8fx.compiler.lowering.lay_out_operands).
        self.laid_out: set[tuple[str, str]] = set()

    def counted(self, role: str) -> bool:
        """Whether the kernels of a GEMM of `role` (and of the casts it is charged) were counted."""
        return ("forward" if role == "output" else "backward") in self.scheduled

    def count(self, kernels: list) -> None:
        from torch._inductor.virtualized import V

        self.scheduled.add(self.graph)
        outputs = set(V.graph.get_output_names())
        read_by = {k: {d.name for d in k.read_writes.reads} for k in kernels}
        kernels_reading = Counter(name for names in read_by.values() for name in names)

        def large(dep) -> bool:
            return V.graph.sizevars.optimization_hint(dep.get_numel(), fallback=0) >= self.min_numel

        for kernel in kernels:
            if kernel.is_extern():
                continue
            parts = kernel.get_nodes()
            charges = {part: self.charge(part) for part in parts}
            if not any(charges.values()):
                continue
            for part, charge in charges.items():
                for dep in part.read_writes.writes if charge else ():
                    outlives = dep.name in outputs or kernels_reading[dep.name] > (dep.name in read_by[kernel])
                    self.counts[charge] += large(dep) and outlives
            part_reads = {p: {d.name for d in p.read_writes.reads} for p in parts}
            # One pass per tensor a kernel reads, however many indices it reads it at (a rotary
            # embedding's gradient reads both halves of each row).
            for dep in {d.name: d for d in kernel.read_writes.reads}.values():
                readers = [p for p in parts if dep.name in part_reads[p]]
                if large(dep) and readers and all(charges[p] for p in readers):
                    self.counts[charges[readers[0]]] += 1


def _charge(part) -> tuple[str, str] | None:
    """The GEMM a scheduled node's FP8 work is charged to (None: it does none, or it computes part
    of an emulated GEMM, into which Inductor may inline the cast it reads)."""
    node = getattr(part, "node", None)
    origins = list(node.get_origins()) if node is not None else []
    if any(o.meta.get(LOWERED_FROM) in EMULATED_GEMMS and computes(o) for o in origins):
        return None
    # The GEMM most of its charged nodes serve: Inductor also names the scalar nodes a kernel inlines
    # (another cast's scale) among its origins.
    charges = Counter(o.meta[CHARGED_TO] for o in sorted(origins, key=lambda o: o.name) if CHARGED_TO in o.meta)
    return charges.most_common(1)[0][0] if charges else None


def computes(origin) -> bool:
    """Whether an FX node computes in a kernel it is an origin of. A view does not, nor does
    `aten._scaled_mm`: Inductor names it an origin of the cast kernel that writes its operand in
    the layout cuBLAS takes."""
    target = origin.target
    return not (
        getattr(target, "is_view", False) or target in (torch.ops.aten._unsafe_view.default, torch.ops.aten._scaled_mm.default)
    )


def count_after_fusion(kernels: list) -> list:
    if _active:
        active = _active[-1]
        (active.after_fusion or active.count)(kernels)
    return kernels


try:  # torch 2.13's FX graph cache keys a CustomSchedulerPass by its uuid, and bypasses any other callable
    from torch._inductor.custom_graph_pass import CustomSchedulerPass
except ImportError:  # torch 2.11 has no such class, and keys the (module-level) function by its name
    CustomSchedulerPass = None

if CustomSchedulerPass is not None:

    class CountAfterFusion(CustomSchedulerPass):  # module-level: the cache key pickles it
        def __call__(self, kernels: list) -> list:
            return count_after_fusion(kernels)

        def uuid(self) -> str:
            # Counting changes no generated code, but the graphs Inductor compiles while it runs are
            # fp8fx's lowering, whose meta (op tags, charges) the graph's code does not show.
            from fp8fx.compiler.cache import source_digest

            return f"fp8fx.compiler.memory_passes/{source_digest()}"

    SCHEDULER_HOOK = CountAfterFusion()
else:
    SCHEDULER_HOOK = count_after_fusion


@contextlib.contextmanager
def counting(counts: MemoryPassCounts, graph: str, min_numel: int, after_fusion=None) -> Iterator[None]:
    """Count the kernels of the `graph` ("forward" | "backward") Inductor compiles inside into
    `counts`; tensors of at least `min_numel` elements are operand-sized. `after_fusion(kernels)`,
    if given, runs on the fused kernels instead of `counts.count` (and counts them)."""
    from torch._inductor import config

    counts.graph, counts.min_numel, counts.after_fusion = graph, min_numel, after_fusion
    _active.append(counts)
    try:
        with config.patch(_post_fusion_custom_pass=SCHEDULER_HOOK):
            yield
    finally:
        _active.pop()
        counts.after_fusion = None
    if counts.after_compile is not None:
        counts.after_compile()
