"""What forward keeps for backward besides FP8 GEMM operands, as the report lists it: one
`SavedTensor` per tensor (fp8fx.passes.saved_activations decides how each is kept), and their
bytes per layer."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SavedTensor:
    """One tensor forward saves for backward: what it is, and how it is kept."""

    name: str  # the forward graph's node
    module: str  # module FQN of the op that made it
    kind: str  # attention | norm | activation | other (fp8fx.core.policy.SAVED_KINDS)
    shape: tuple[int, ...]
    dtype: str  # as produced
    kept_as: str  # "e4m3 rowwise", "e5m2 1x128", ..., or the dtype it stays in
    bytes_high: int  # bytes of its storage in the precision it was made in
    bytes_kept: int  # bytes kept for backward (FP8 values and scales, or bytes_high)
    reason: str  # the policy entry that chose FP8, or why it stays

    @property
    def fp8(self) -> bool:
        return self.kept_as.startswith(("e4m3 ", "e5m2 "))

    def to_dict(self) -> dict:
        return {**asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict) -> SavedTensor:
        return cls(**{**d, "shape": tuple(d["shape"])})


def layer(module: str) -> str:
    """The block a module belongs to: `model.layers.3.mlp` -> `model.layers.3` (else the module)."""
    found = re.match(r"(.*?\.\d+)(\.|$)", module)
    return found.group(1) if found else module or "(top level)"


def bytes_per_layer(tensors: list[SavedTensor]) -> dict[str, tuple[int, int]]:
    """Per layer: (bytes its saved tensors take in their own precision, bytes kept)."""
    out: dict[str, tuple[int, int]] = {}
    for t in tensors:
        high, kept = out.get(layer(t.module), (0, 0))
        out[layer(t.module)] = (high + t.bytes_high, kept + t.bytes_kept)
    return out


def summary(tensors: list[SavedTensor]) -> dict | None:
    """Counts and bytes for the report's summary; None when no graph kept saved tensors in FP8."""
    if not tensors:
        return None
    fp8 = [t for t in tensors if t.fp8]
    return {
        "tensors": len(tensors),
        "fp8_tensors": len(fp8),
        "bytes_high": sum(t.bytes_high for t in tensors),
        "bytes_kept": sum(t.bytes_kept for t in tensors),
        "per_layer": {name: {"bytes_high": h, "bytes_kept": k} for name, (h, k) in bytes_per_layer(tensors).items()},
    }


COLUMNS = ("saved tensor", "module", "kind", "shape", "dtype", "kept as", "KiB", "kept KiB", "reason")


def rows(tensors: list[SavedTensor]) -> list[tuple[str, ...]]:
    return [
        (
            t.name,
            t.module,
            t.kind,
            "x".join(map(str, t.shape)),
            t.dtype,
            t.kept_as,
            f"{t.bytes_high / 1024:.1f}",
            f"{t.bytes_kept / 1024:.1f}",
            t.reason,
        )
        for t in tensors
    ]
