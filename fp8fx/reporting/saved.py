"""What forward keeps for backward besides FP8 GEMM operands, as the report lists it: one
`SavedTensor` per tensor (fp8fx.passes.saved_activations decides how each is kept and makes the
records), and their bytes per layer."""

from __future__ import annotations

import re

from fp8fx.passes.saved_activations import SavedTensor


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
