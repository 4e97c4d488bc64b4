"""Numerics of an analysis run on real tensors: per GEMM, what its FP8 operands lose.

`insert_probes` puts a probe, an `fp8fx::tap(left, [right], collector, key)` (`fp8fx.ops.taps`),
in front of every GEMM (before the casts are inserted), so it sees the high-precision operands the
GEMM is given; the GEMM takes the tap's copy of `left`. For the
decision fp8fx made, and as a what-if for every named recipe, the probe quantizes both operands
exactly as the cast ops do (`fp8fx.ops.reference`) and accumulates, over calibration batches:
per operand the amax, the scale, the share of non-zero values flushed to zero (underflow) and of
values beyond the format's range (saturation); per GEMM the SQNR of the FP8 product against the
fp64 product of the same operands. Delayed scaling is replayed as it runs: the first batch uses
the initial scale 1, later batches the scale the amax history gives.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fp8fx.core.formats import Fp8Format
from fp8fx.core.scaling import expand_blocks, nvfp4_scales
from fp8fx.ops import nvfp4, reference, taps
from fp8fx.runtime.monitor import saturation_threshold

EXACT_DB = 300.0  # SQNR reported when the FP8 product equals the fp64 one (no noise to measure)


def sqnr_db(reference: Tensor, approx: Tensor) -> float:
    """10 log10(signal / noise) in fp64: inf when `approx` is exact, -inf when it is not finite or
    the signal is zero."""
    reference, approx = reference.detach().double(), approx.detach().double()
    noise = (reference - approx).square().sum().item()
    signal = reference.square().sum().item()
    if noise == 0:
        return math.inf
    if not math.isfinite(noise) or signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


@dataclass(frozen=True)
class OperandStats:
    amax: float  # largest magnitude seen
    scale: float | None  # x_fp8 = x * scale (tensorwise; the smallest block scale otherwise)
    underflow_pct: float  # non-zero values that became 0 in FP8
    saturation_pct: float  # values beyond the format's largest finite value (clamped)


@dataclass(frozen=True)
class GemmNumerics:
    """One GEMM's numerics: the decided settings' SQNR and operand stats (None when it runs in high
    precision), and the SQNR each named recipe would give (None where that recipe keeps it high)."""

    sqnr_db: float | None
    operands: tuple[OperandStats, OperandStats] | None
    what_if: dict[str, float | None]
    batches: int


@dataclass
class ProbeSpec:
    """What a probe measures: the decision (`fp8fx.passes.assign_precision.Decision`) made for
    its GEMM, and the one each named recipe would make."""

    graph: int
    site: str
    role: str
    chosen: object
    what_if: dict[str, object]


@dataclass
class _Accumulator:
    """Running sums for one decision: product signal and noise, and per-operand counts."""

    signal: float = 0.0
    noise: float = 0.0
    amax: list[float] = field(default_factory=lambda: [0.0, 0.0])
    scale: list[float | None] = field(default_factory=lambda: [None, None])
    underflow: list[int] = field(default_factory=lambda: [0, 0])
    saturated: list[int] = field(default_factory=lambda: [0, 0])
    numel: list[int] = field(default_factory=lambda: [0, 0])
    delayed: list[tuple | None] = field(default_factory=lambda: [None, None])  # replayed state per operand

    @property
    def sqnr_db(self) -> float:
        if self.noise == 0:
            return EXACT_DB
        return min(EXACT_DB, 10 * math.log10(self.signal / self.noise)) if self.signal > 0 else -EXACT_DB


class NumericsCollector:
    """Probe specs and accumulated stats of one analysis run. Its probes record only inside
    `collecting(collector)`."""

    def __init__(self) -> None:
        self.specs: dict[str, ProbeSpec] = {}
        self.chosen: dict[str, _Accumulator] = {}
        self.what_if: dict[tuple[str, str], _Accumulator] = {}
        self.batches: dict[str, int] = {}
        self.active = 0  # nesting depth of `collecting(self)` blocks
        self.tap_handler = taps.register(self)  # the `handler` of this collector's probes

    def register(self, spec: ProbeSpec) -> str:
        """A probe's `key` for `spec`."""
        key = f"p{len(self.specs)}"
        self.specs[key] = spec
        return key

    def tap(self, key: str, left: Tensor, observed: list[Tensor]) -> None:
        """The probe in front of one GEMM: `left` passes through, `observed` is [right]."""
        if self.active and key in self.specs:
            self.observe(key, left, observed[0])

    def observe(self, key: str, left: Tensor, right: Tensor) -> None:
        spec = self.specs[key]
        reference_product = torch.matmul(left.double(), right.double())
        self.batches[key] = self.batches.get(key, 0) + 1
        if spec.chosen.fp8:
            _measure(self.chosen.setdefault(key, _Accumulator()), spec.chosen, left, right, reference_product, stats=True)
        for recipe, decision in spec.what_if.items():
            if decision.fp8:
                _measure(
                    self.what_if.setdefault((key, recipe), _Accumulator()), decision, left, right, reference_product, stats=False
                )

    def results(self) -> dict[tuple[int, str, str], GemmNumerics]:
        """(graph, site, role) -> numerics, for every probed GEMM that ran."""
        out = {}
        for key, spec in self.specs.items():
            if key not in self.batches:
                continue
            acc = self.chosen.get(key)
            operands = None
            if acc is not None:
                operands = tuple(
                    OperandStats(
                        amax=acc.amax[i],
                        scale=acc.scale[i],
                        underflow_pct=100 * acc.underflow[i] / max(acc.numel[i], 1),
                        saturation_pct=100 * acc.saturated[i] / max(acc.numel[i], 1),
                    )
                    for i in range(2)
                )
            what_if = {r: (self.what_if[(key, r)].sqnr_db if (key, r) in self.what_if else None) for r in spec.what_if}
            out[(spec.graph, spec.site, spec.role)] = GemmNumerics(
                acc.sqnr_db if acc else None, operands, what_if, self.batches[key]
            )
        return out


def _quantize(x: Tensor, fmt, block: tuple, decision, acc: _Accumulator, i: int) -> tuple[Tensor, Tensor]:
    """(fp8, scale) of one operand, as the cast ops make them; delayed scaling replays its state."""
    block = list(block)
    amax = reference.amax(x, block)
    if fmt is Fp8Format.NVFP4:  # round to nearest, no Hadamard transform: what the output GEMM does
        scale, _ = nvfp4_scales(amax)
        return nvfp4.cast_nvfp4(x, scale, block, False), scale
    if decision.delayed is None:
        scale = reference.amax_to_scale(amax, fmt.max, decision.margin, decision.power_of_two)
    else:
        d = decision.delayed
        state = acc.delayed[i] or (
            torch.zeros(d.history_len),
            torch.ones(()),
            torch.zeros((), dtype=torch.int64),
            torch.zeros((), dtype=torch.int64),
        )
        scale = state[1]
        acc.delayed[i] = reference.delayed_scale_update(
            *state, amax, fmt.max, decision.margin, decision.power_of_two, d.algo.value == "most_recent", d.interval
        )
    return reference.cast(x, scale, fmt.dtype, block), scale


def _measure(acc: _Accumulator, decision, left: Tensor, right: Tensor, reference_product: Tensor, stats: bool) -> None:
    quantized = []
    for i, (x, fmt, block) in enumerate(zip((left, right), decision.formats, decision.blocks)):
        fp8, scale = _quantize(x, fmt, block, decision, acc, i)
        quantized.append((fp8, scale))
        if stats:
            x32 = x.float()
            acc.amax[i] = max(acc.amax[i], x32.abs().max().item() if x32.numel() else 0.0)
            acc.scale[i] = scale.min().item()
            acc.underflow[i] += int(((x32 != 0) & (fp8.float() == 0)).sum())
            scaled = x32 * expand_blocks(scale, tuple(block), x.shape)
            acc.saturated[i] += int((scaled.abs() > saturation_threshold(fmt)).sum())
            acc.numel[i] += x.numel()
    (qa, sa), (qb, sb) = quantized
    product = reference.scaled_mm(qa, qb, sa.reciprocal(), sb.reciprocal(), None, torch.float64, *map(list, decision.blocks))
    acc.signal += float(reference_product.square().sum())
    acc.noise += float((reference_product - product).square().sum())


@contextlib.contextmanager
def collecting(collector: NumericsCollector):
    """Record what the probes of compiled code run inside this block measure in `collector`."""
    collector.active += 1
    try:
        yield collector
    finally:
        collector.active -= 1
