"""The per-op precision report: `Report`, over one `OpRecord` per GEMM of every compiled graph
(`fp8fx.reporting.op_record`), with its summary, predictions (`costmodel`), JSON and text renderings."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, replace
from typing import Any

from fp8fx.reporting import costmodel, saved
from fp8fx.reporting.op_record import OpRecord
from fp8fx.reporting.uncaptured import Uncaptured, grouped

SCHEMA = "fp8fx.report/4"  # version of the to_dict()/JSON layout; bumped when a field changes meaning


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _gpu_text(op: OpRecord) -> str:
    """What runs an FP8 GEMM on a GPU, why, and how Hopper accumulates it (for the reason column)."""
    if op.gpu_kernel is None:
        return ""
    kernel = GPU_KERNELS.get(op.gpu_kernel, op.gpu_kernel)
    accumulation = "fast accumulation" if op.fast_accum else "split accumulation"
    return f"; GPU: {kernel} ({op.gpu_kernel_reason}), {accumulation}"


# What each `gpu_kernel` value names.
GPU_KERNELS = {
    "triton": "generated kernel",
    "scaled_mm": "torch._scaled_mm",
    "scaled_grouped_mm": "torch._scaled_grouped_mm",
    "emulated": "emulation in torch ops",
    "nvfp4": "generated NVFP4 kernel",
}


def op_text(op: OpRecord) -> str:
    """The op column: the op kind, and a grouped GEMM's number of groups."""
    return op.op if op.groups is None else f"{op.op} ({op.groups} groups)"


def _scaling_text(op: OpRecord) -> str:
    """e.g. "dynamic tensorwise", "dynamic nvfp4 sr rht", "delayed h1024 max scale=224,57344"."""
    if op.precision != "fp8":
        return "-"
    if op.amax_history_len is None:
        floor = " floor" * (op.scale_rounding == "floor")  # rceil is mx's default
        return f"{op.scaling} {op.granularity}{floor}" + " sr" * bool(op.stochastic_rounding) + " rht" * bool(op.hadamard)
    text = f"delayed h{op.amax_history_len} {op.amax_compute_algo}"
    return text + (f" scale={op.scale[0]:.4g},{op.scale[1]:.4g}" if op.scale else "")


class Report:
    """All GEMM decisions of one model (or one backend), with a summary.

    `ops` holds the rows of graphs in use, which the summary, the FP8 shares and the tables count;
    `superseded` the rows of graphs a recompile replaced, kept for the JSON's history."""

    def __init__(
        self,
        ops: list[OpRecord],
        folded: dict[str, int] | None = None,
        non_gemm_bytes: dict[str, int] | None = None,
        saved_bytes: dict[str, int] | None = None,
        saved_tensors: list[saved.SavedTensor] | None = None,
    ):
        self.ops = [op for op in ops if op.graph_state != "superseded"]
        self.superseded = [op for op in ops if op.graph_state == "superseded"]
        # Analysis of repeated blocks: list FQN -> blocks whose records copy the first block's.
        self.folded = dict(folded or {})
        # Per module FQN (fp8fx.reporting.traffic): bytes moved by non-GEMM ops, and bytes saved for backward
        # (None: no training graph partitioned by fp8fx). fp8fx.analyze adds what the same step
        # saves with every GEMM in high precision.
        self.non_gemm_bytes = dict(non_gemm_bytes or {})
        self.saved_bytes = saved_bytes
        # With saved activations in FP8 (fp8fx.passes.saved_activations): every tensor forward
        # saves besides parameters and inputs, and how it is kept.
        self.saved_tensors = list(saved_tensors or [])
        self.saved_bytes_high_precision: int | None = None
        # Bytes of the trainable parameters a training step's optimizer updates (fp8fx.analyze sets
        # it with `train`); None: the predicted step has no optimizer step.
        self.param_bytes: int | None = None
        self.target = None  # fp8fx.reporting.costmodel.GpuSpec the predictions are for
        self.step = None  # its fp8fx.reporting.costmodel.StepPrediction
        self.monitor = None  # fp8fx.runtime.monitor.Monitor of the compiled model, if it has one
        # Modules of the reported model whose matrix weights no graph took: their products ran
        # outside fp8fx (eager code, a Python loop Dynamo does not trace) or not yet.
        self.uncaptured: list[Uncaptured] = []
        # Set by fp8fx.analyze when the shape-only trace stopped at a data-dependent op: why, and
        # that the shapes were traced on real tensors with random weights instead.
        self.traced_on_real_tensors: str | None = None

    def with_predictions(self, target) -> Report:
        """This report with each GEMM's predicted BF16 and FP8 time on `target` (see
        fp8fx.reporting.costmodel) and the predicted whole step."""
        spec = costmodel.gpu(target) if isinstance(target, str) else target
        new = Report(
            [replace(op, predicted=costmodel.predict(op, spec)) for op in self.history],
            self.folded,
            self.non_gemm_bytes,
            self.saved_bytes,
            self.saved_tensors,
        )
        new.saved_bytes_high_precision, new.param_bytes = self.saved_bytes_high_precision, self.param_bytes
        new.uncaptured, new.traced_on_real_tensors = list(self.uncaptured), self.traced_on_real_tensors
        new.target = spec
        new.step = costmodel.predict_step(self.ops, sum(self.non_gemm_bytes.values()), spec, self.param_bytes or 0)
        return new

    def __len__(self) -> int:
        return len(self.ops)

    @property
    def uncaptured_weights(self) -> list[str]:
        """Names of the matrix weights no compiled graph read (see `uncaptured`)."""
        return [w for u in self.uncaptured for w in u.weights]

    @property
    def history(self) -> list[OpRecord]:
        """Every row, superseded ones included, in the order the graphs compiled."""
        return sorted([*self.ops, *self.superseded], key=lambda op: op.graph)

    def superseded_graphs(self) -> dict[int, OpRecord]:
        """{graph index: its first row} of the superseded graphs."""
        return {op.graph: op for op in reversed(self.superseded)}

    @property
    def fp8_ops(self) -> list[OpRecord]:
        return [op for op in self.ops if op.precision == "fp8"]

    @property
    def high_ops(self) -> list[OpRecord]:
        return [op for op in self.ops if op.precision == "high"]

    def find(self, site: str | None = None, role: str | None = None) -> list[OpRecord]:
        return [op for op in self.ops if (site is None or op.site == site) and (role is None or op.role == role)]

    def summary(self) -> dict[str, Any]:
        def share(ops: list[OpRecord]) -> float | None:
            total = sum(op.flops for op in ops)
            return sum(op.flops for op in ops if op.precision == "fp8") / total if total else None

        return {
            "graphs": len({op.graph for op in self.ops}),
            "superseded_graphs": len({op.graph for op in self.superseded}),
            "gemms": len(self.ops),
            "fp8_gemms": len(self.fp8_ops),
            "fp8_flop_share_forward": share([op for op in self.ops if not op.backward]),
            "fp8_flop_share_backward": share([op for op in self.ops if op.backward]),
            "fallbacks_by_reason": dict(Counter(op.reason_kind for op in self.high_ops)),
            "gemms_without_flops": sum(not op.flops_known for op in self.ops),
            "gemms_flops_from_hints": sum(op.flops_hinted for op in self.ops),
            "folded_blocks": self.folded,
            "fused_epilogues": sum(bool(op.epilogue) for op in self.fp8_ops),
            "gpu_kernels": dict(Counter(op.gpu_kernel for op in self.fp8_ops if op.gpu_kernel)),
            "memory_passes_added": sum(op.memory_passes_added or 0 for op in self.fp8_ops),
            "memory_passes_saved": sum(op.memory_passes_saved or 0 for op in self.fp8_ops),
            "non_finite_amax_events": {
                op.site + "." + op.role: op.non_finite for op in self.ops if op.non_finite and any(op.non_finite)
            },
            "saved_for_backward_bytes": sum(self.saved_bytes.values()) if self.saved_bytes is not None else None,
            "fp8_saved_activation_bytes": (
                self.saved_bytes_high_precision - sum(self.saved_bytes.values())
                if self.saved_bytes_high_precision is not None
                else None
            ),
            "saved_activations": saved.summary(self.saved_tensors),
            "uncaptured_weights": self.uncaptured_weights,
            "uncaptured_modules": [asdict(u) for u in self.uncaptured],
            "traced_on_real_tensors": self.traced_on_real_tensors,
            "target": self.target.name if self.target else None,
            "predicted_step_speedup": self.step.speedup if self.step else None,
            "predicted_gemm_speedup": self.step.gemm_speedup if self.step else None,
            "predicted_step_ms": self._step_ms(),
            "slower_in_fp8": sum(op.slower for op in self.fp8_ops) if self.step else None,
            "numerics_batches": max((op.numerics.batches for op in self.ops if op.numerics), default=None),
            "min_sqnr_db": min(
                (op.numerics.sqnr_db for op in self.fp8_ops if op.numerics and op.numerics.sqnr_db is not None), default=None
            ),
        }

    def _step_ms(self) -> dict[str, float] | None:
        """The predicted step's parts in ms: GEMMs in BF16 and as decided (with FP8's passes), and the
        parts FP8 leaves alone (attention, optimizer, other ops)."""
        if not self.step:
            return None
        s = self.step
        parts = {
            "bf16": s.bf16_us,
            "fp8": s.fp8_us,
            "gemm_bf16": s.gemm_bf16_us,
            "gemm_fp8": s.gemm_fp8_us,
            "attention": s.attention_us,
            "optimizer": s.optimizer_us,
            "other": s.other_us,
        }
        return {key: us / 1e3 for key, us in parts.items()}

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data; its layout is `SCHEMA` (documented in docs/report.md)."""
        total = sum(op.flops for op in self.ops) or 1

        def op_dict(op: OpRecord) -> dict[str, Any]:
            d = {**asdict(op), "flop_share": op.flops / total if op.graph_state != "superseded" else None}
            if op.predicted is not None:
                d["predicted"]["speedup"] = op.predicted.speedup
            return d

        out = {"schema": SCHEMA, "summary": self.summary(), "ops": [op_dict(op) for op in self.history]}
        if self.saved_tensors:
            out["saved_tensors"] = [t.to_dict() for t in self.saved_tensors]
        if self.monitor is not None:
            out["monitor"] = {key: [asdict(sample) for sample in samples] for key, samples in self.monitor.samples.items()}
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    _COLUMNS = ("graph", "site", "op", "role", "M", "N", "K", "FLOP %", "prec", "formats", "scaling", "epilogue", "passes +/-")

    def columns(self) -> tuple[str, ...]:
        extra = (("fp8/bf16 x",) if self.step else ()) + (("SQNR dB",) if any(op.numerics for op in self.ops) else ())
        return (*self._COLUMNS, *extra, "reason")

    def rows(self) -> list[tuple[str, ...]]:
        total = sum(op.flops for op in self.ops) or 1
        rows = []
        for op in self.ops:
            row = [
                str(op.graph),
                op.site,
                op_text(op),
                op.role,
                str(op.m),
                str(op.n),
                str(op.k),
                f"{100 * op.flops / total:.1f}" if op.flops_known else "?",
                op.precision,
                "x".join(op.formats) if op.formats else "-",
                _scaling_text(op),
                op.epilogue or "-" if op.precision == "fp8" else "-",
                f"+{op.memory_passes_added}/-{op.memory_passes_saved}" if op.memory_passes_added is not None else "-",
            ]
            if self.step:  # "!": predicted slower in FP8 than BF16
                row.append("-" if op.predicted is None else f"{op.predicted.speedup:.2f}" + ("!" if op.slower else ""))
            if any(o.numerics for o in self.ops):
                sqnr = op.numerics.sqnr_db if op.numerics else None
                row.append("-" if sqnr is None else f"{sqnr:.1f}")
            rows.append((*row, op.reason + _gpu_text(op)))
        return rows

    def summary_lines(self) -> list[str]:
        s = self.summary()

        def pct(x: float | None) -> str:
            return "n/a" if x is None else f"{100 * x:.1f}%"

        superseded = f" ({s['superseded_graphs']} superseded graph(s) not counted)" if s["superseded_graphs"] else ""
        missing = f" (not counting the GEMMs of {len(self.uncaptured)} module(s) no graph captured)" if self.uncaptured else ""
        lines = [
            (
                f"{s['fp8_gemms']}/{s['gemms']} GEMMs in FP8 over {s['graphs']} graph(s){superseded}; "
                f"FP8 share of GEMM FLOPs: forward {pct(s['fp8_flop_share_forward'])}, backward "
                f"{pct(s['fp8_flop_share_backward'])}{missing}"
            )
        ]
        for index, op in sorted(self.superseded_graphs().items()):
            lines.append(
                f"superseded: graph {index} (Dynamo {op.compile_id}, recompiled as {op.superseded_by}: "
                f"{op.recompile_reason or 'reason not recorded'})"
            )
        if s["gpu_kernels"]:
            lines.append(
                "FP8 GEMMs on a GPU: " + ", ".join(f"{v} by {GPU_KERNELS.get(k, k)}" for k, v in sorted(s["gpu_kernels"].items()))
            )
        if s["fallbacks_by_reason"]:
            lines.append("kept high: " + ", ".join(f"{k} {v}" for k, v in sorted(s["fallbacks_by_reason"].items())))
        if s["gemms_flops_from_hints"]:
            lines.append(
                f"{s['gemms_flops_from_hints']} GEMM(s) of dynamic dimensions: FLOPs from the sizes the graph was compiled for"
            )
        if s["gemms_without_flops"]:
            lines.append(
                f"{s['gemms_without_flops']} GEMM(s) of dynamic or unknown dimensions (FLOP % '?') are not in the FP8 shares"
            )
        if self.uncaptured:
            lines += [f"not captured: {u.text(copies)}" for u, copies in grouped(self.uncaptured)]
        if self.traced_on_real_tensors:
            lines.append(f"shapes traced on real tensors with random weights: {self.traced_on_real_tensors}")
        if s["non_finite_amax_events"]:
            lines.append("non-finite amax (scale kept): " + ", ".join(f"{k} {v}" for k, v in s["non_finite_amax_events"].items()))
        if s["folded_blocks"]:
            lines.append("repeated blocks traced once: " + ", ".join(f"{k} x{v}" for k, v in s["folded_blocks"].items()))
        if s["saved_for_backward_bytes"]:
            line = f"activations saved for backward: {mib(s['saved_for_backward_bytes'])}"
            if s["fp8_saved_activation_bytes"] is not None:
                line += (
                    f" ({mib(s['saved_for_backward_bytes'] + s['fp8_saved_activation_bytes'])} with every GEMM in high precision)"
                )
            lines.append(line)
        if s["saved_activations"]:
            a = s["saved_activations"]
            layers = ", ".join(
                f"{name} {mib(b['bytes_high'])} -> {mib(b['bytes_kept'])}" for name, b in a["per_layer"].items()
            )
            lines.append(
                f"saved activations: {a['fp8_tensors']}/{a['tensors']} kept in FP8, {mib(a['bytes_high'])} -> "
                f"{mib(a['bytes_kept'])} (per layer: {layers})"
            )
        if self.step:
            ms = s["predicted_step_ms"]
            optimizer = f", optimizer {ms['optimizer']:.1f}" if self.param_bytes else ", no optimizer"
            lines.append(
                f"predicted on {s['target']}: step {s['predicted_step_speedup']:.2f}x faster than BF16 (GEMMs alone "
                f"{s['predicted_gemm_speedup']:.2f}x); {s['slower_in_fp8']} FP8 GEMM(s) predicted slower than BF16 (marked !)"
            )
            lines.append(
                f"predicted step, ms: BF16 {ms['bf16']:.1f}, FP8 {ms['fp8']:.1f}; GEMMs {ms['gemm_bf16']:.1f} -> "
                f"{ms['gemm_fp8']:.1f} "
                f"(FP8's casts included), unchanged: attention {ms['attention']:.1f}{optimizer}, other ops {ms['other']:.1f}"
            )
        if s["numerics_batches"]:
            worst = min(
                (op for op in self.fp8_ops if op.numerics and op.numerics.sqnr_db is not None),
                key=lambda op: op.numerics.sqnr_db,
                default=None,
            )
            if worst is not None:
                lines.append(
                    f"numerics over {s['numerics_batches']} batch(es): lowest FP8 SQNR {worst.numerics.sqnr_db:.1f} "
                    f"dB at {worst.site}.{worst.role}"
                )
        return lines

    def table(self) -> str:
        """A fixed-width table, one row per GEMM, then the saved tensors' (if any), then the summary."""
        lines = _fixed_width(self.columns(), self.rows())
        if self.saved_tensors:
            lines += ["", *_fixed_width(saved.COLUMNS, saved.rows(self.saved_tensors))]
        return "\n".join([*lines, "", *self.summary_lines()])

    def markdown(self) -> str:
        """A GitHub-flavoured Markdown table, one row per GEMM, then the summary as a list."""

        def cells(row) -> str:
            return "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"

        lines = ["# fp8fx precision report", "", *(f"- {line}" for line in self.summary_lines()), ""]
        columns = self.columns()
        lines += [cells(columns), "|" + "---|" * len(columns), *(cells(r) for r in self.rows())]
        return "\n".join(lines)

    def __str__(self) -> str:
        if self.ops:
            return self.table()
        if self.superseded:
            return "\n".join(["fp8fx report: no matmul in the graphs in use", *self.summary_lines()])
        return "fp8fx report: no matmul compiled yet (run the compiled model once)"


def _fixed_width(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """Lines of a fixed-width table, a rule under the header; the last column is left unpadded."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in [header, *rows]]
    return [lines[0], "-" * min(160, max(len(line) for line in lines)), *lines[1:]]

