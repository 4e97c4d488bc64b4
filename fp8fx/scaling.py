"""amax -> scale math (pure functions on tensors).

Convention, used everywhere in fp8fx:
    x_fp8 = saturate(x * scale)        x ~= x_fp8 * scale_inv
    scale = fp8_max / amax / 2**margin
An amax of 0, inf or NaN gives scale 1: a scale is never 0, inf or NaN.
"""

from __future__ import annotations

import torch

_FP32_MAX = torch.finfo(torch.float32).max


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of `x` as an fp32 scalar (NaN if `x` holds a NaN)."""
    lo, hi = torch.aminmax(x.detach())  # one pass, no |x| temporary
    return torch.maximum(-lo, hi).to(torch.float32)


def amax_to_scale(amax: torch.Tensor, fp8_max: float, margin: int = 0) -> torch.Tensor:
    """Scale that maps `amax` onto `fp8_max / 2**margin`; 1 where amax is 0 or non-finite."""
    amax = amax.to(torch.float32)
    usable = torch.isfinite(amax) & (amax > 0)
    safe_amax = torch.where(usable, amax, torch.ones_like(amax))
    # Tiny amax would give an inf scale; clamp to the largest finite fp32.
    scale = (fp8_max / (2.0**margin) / safe_amax).clamp(max=_FP32_MAX)
    return torch.where(usable, scale, torch.ones_like(scale))
