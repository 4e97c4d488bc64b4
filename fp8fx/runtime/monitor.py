"""The runtime precision monitor: per FP8 cast (site, GEMM role, operand), sampled every N steps,
the amax, the scale, how many values saturated, underflowed to zero or were not finite.

`fp8fx.backend(monitor_every=N)` puts an `fp8fx::tap(scale, [x], monitor, key)` (`fp8fx.ops.taps`)
between each cast's scale and the cast itself. The tap returns the scale (so it stays in the graph
through partitioning and Inductor at the cost of one tiny copy) and, on every N-th call for its
key, the `Monitor` measures `x` - one host sync per sampled cast, none in between.
`fp8fx.stats(compiled)` returns the `Monitor`.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from fp8fx.core.formats import Fp8Format
from fp8fx.core.scaling import expand_blocks
from fp8fx.ops import taps


@dataclass(frozen=True)
class Sample:
    key: str  # "site.gemm_role.operand_role" (the state key of delayed scaling)
    step: int  # calls of this cast so far (forward and backward casts count their own)
    amax: float  # of the finite values
    scale: float  # x_fp8 = x * scale (the smallest block scale for per-row / per-block scaling)
    saturated: int  # values beyond the format's range once scaled (clamped to its largest value)
    underflow: int  # non-zero values that become 0 in FP8
    non_finite: int  # inf or NaN values
    numel: int


def saturation_threshold(fmt: Fp8Format) -> float:
    """Scaled magnitudes above this lose more than rounding to the format's largest value would:
    halfway to the next step the format would have (464 for E4M3, 61440 for E5M2, 7 for NVFP4's E2M1)."""
    if fmt is Fp8Format.NVFP4:
        return fmt.max + 1.0
    return fmt.max + 2.0 ** math.floor(math.log2(fmt.max)) * torch.finfo(fmt.dtype).eps / 2


def underflow_threshold(fmt: Fp8Format) -> float:
    """Scaled magnitudes at or below this round to zero: half the smallest subnormal (E2M1's is 0.5)."""
    if fmt is Fp8Format.NVFP4:
        return 0.25
    return torch.finfo(fmt.dtype).smallest_normal * torch.finfo(fmt.dtype).eps / 2


def measure(key: str, step: int, x: Tensor, scale: Tensor, fmt: Fp8Format, block: list[int]) -> Sample:
    x = x.detach().float()
    finite = torch.isfinite(x)
    scaled = (x * expand_blocks(scale.float(), tuple(block), x.shape)).abs()
    values = torch.where(finite, x.abs(), torch.zeros_like(x))
    return Sample(
        key=key,
        step=step,
        amax=values.max().item() if x.numel() else 0.0,
        scale=scale.float().min().item(),
        saturated=int(((scaled > saturation_threshold(fmt)) & finite).sum()),
        underflow=int(((x != 0) & (scaled <= underflow_threshold(fmt))).sum()),
        non_finite=int((~finite).sum()),
        numel=x.numel(),
    )


class Monitor:
    """Samples of one backend's casts, and the writers they stream to."""

    def __init__(self, every: int):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"fp8fx monitor: every must be a positive integer, got {every!r}")
        self.every = every
        self.samples: dict[str, list[Sample]] = {}
        self.calls: dict[str, int] = {}
        self.writers: list = []
        self.tap_handler = taps.register(self)  # the `handler` of this monitor's taps

    @staticmethod
    def tap_key(state_key: str, fmt: Fp8Format, block: list[int]) -> str:
        """The tap's `key` for one cast: the cast's state key, format and scale blocks."""
        return f"{fmt.value}|{','.join(map(str, block))}|{state_key}"

    def tap(self, key: str, scale: Tensor, observed: list[Tensor]) -> None:
        """The tap in front of one cast: `scale` passes through, `observed` is the cast's input."""
        state_key, fmt, block = _parse_tap_key(key)
        self.observe(state_key, observed[0], scale, fmt, block)

    def observe(self, key: str, x: Tensor, scale: Tensor, fmt: Fp8Format, block: list[int]) -> None:
        step = self.calls.get(key, 0)
        self.calls[key] = step + 1
        if step % self.every:
            return
        sample = measure(key, step, x, scale, fmt, block)
        self.samples.setdefault(key, []).append(sample)
        for writer in self.writers:
            writer.write(sample)

    def series(self, key: str) -> list[Sample]:
        return list(self.samples.get(key, []))

    def summary(self) -> dict[str, dict]:
        """Per key: samples, last amax and scale, and totals of saturated, underflowed and non-finite values."""
        out = {}
        for key, samples in self.samples.items():
            numel = sum(s.numel for s in samples)
            out[key] = {
                "samples": len(samples),
                "amax": samples[-1].amax,
                "scale": samples[-1].scale,
                "saturated_pct": 100 * sum(s.saturated for s in samples) / max(numel, 1),
                "underflow_pct": 100 * sum(s.underflow for s in samples) / max(numel, 1),
                "non_finite": sum(s.non_finite for s in samples),
            }
        return out

    def add_writer(self, writer) -> None:  # anything with write(Sample)
        self.writers.append(writer)


class JsonlWriter:
    """Appends each sample as one JSON line to `path`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, sample: Sample) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(asdict(sample)) + "\n")


class TensorBoardWriter:
    """Writes each sample as scalars under `fp8fx/<key>/...` (needs the `tensorboard` package)."""

    def __init__(self, logdir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("fp8fx TensorBoardWriter needs the tensorboard package: pip install 'fp8fx[tensorboard]'") from e
        self.writer = SummaryWriter(str(logdir))

    def write(self, sample: Sample) -> None:
        for name in ("amax", "scale", "saturated", "underflow", "non_finite"):
            self.writer.add_scalar(f"fp8fx/{sample.key}/{name}", getattr(sample, name), sample.step)

    def flush(self) -> None:
        """Write the pending events to the event file."""
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file (writing after it opens a new one)."""
        self.writer.close()


@functools.cache
def _parse_tap_key(key: str) -> tuple[str, Fp8Format, tuple[int, ...]]:
    fmt, block, state_key = key.split("|", 2)
    return state_key, Fp8Format(fmt), tuple(int(b) for b in block.split(",") if b)
