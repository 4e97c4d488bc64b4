"""FP8 element formats and the saturating cast into them."""

from __future__ import annotations

from enum import Enum

import torch


class Fp8Format(str, Enum):
    """An FP8 element format (OCP names; `fn` = finite-only E4M3)."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self]

    @property
    def max(self) -> float:
        """Largest finite magnitude: 448 for E4M3, 57344 for E5M2."""
        return torch.finfo(self.dtype).max


_DTYPES = {Fp8Format.E4M3: torch.float8_e4m3fn, Fp8Format.E5M2: torch.float8_e5m2}
FP8_DTYPES = frozenset(_DTYPES.values())


class FormatRecipe(str, Enum):
    """Which format each operand gets. HYBRID: E4M3 forward operands, E5M2 gradients (TE's HYBRID)."""

    HYBRID = "hybrid"
    E4M3 = "e4m3"
    E5M2 = "e5m2"

    def operand_format(self, operand_role: str) -> Fp8Format:
        """Format of an operand by its role: `input`, `weight` or `grad_output`."""
        if self is FormatRecipe.E4M3:
            return Fp8Format.E4M3
        if self is FormatRecipe.E5M2:
            return Fp8Format.E5M2
        return Fp8Format.E5M2 if operand_role == "grad_output" else Fp8Format.E4M3


def fp8_format_of(dtype: torch.dtype) -> Fp8Format:
    for fmt, d in _DTYPES.items():
        if d == dtype:
            return fmt
    raise ValueError(f"{dtype} is not an FP8 dtype fp8fx supports (float8_e4m3fn, float8_e5m2)")


def saturating_cast(x_scaled: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Round an already-scaled tensor to `fmt`, clamping to +-max first.

    The clamp is explicit: older torch releases turn out-of-range values into NaN, and
    E5M2 would overflow to inf. NaN stays NaN (clamp propagates it)."""
    return x_scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)
