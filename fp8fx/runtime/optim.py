"""AdamW with low-precision moments (MS-AMP's O2 optimizer): the first moment in FP8 (E4M3), the
second in FP16, each with a per-tensor scale, so the two states take 3 bytes per parameter instead
of 8 (62.5% less optimizer memory).

Each step dequantizes the moments, applies the usual AdamW update in fp32, and quantizes them
again with fresh scales: `m_fp8 = saturate(m * scale)` with `scale = 448 / amax(m)` (fp8fx's scale
convention), and the second moment likewise onto FP16's largest value 65504. A scale keeps the
second moment, which is the square of gradients, clear of FP16's underflow.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from fp8fx.core.formats import Fp8Format
from fp8fx.core.scaling import amax_to_scale, tensor_amax
from fp8fx.ops import reference

_FP16_MAX = torch.finfo(torch.float16).max


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage: in-place updates reach the parameter): the moments and
    their scales are per shard, so no step needs a collective."""
    return t.to_local() if hasattr(t, "to_local") else t


def _quantize_fp16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = amax_to_scale(tensor_amax(x), _FP16_MAX, margin=1)  # margin: headroom for the next step's growth
    return (x * scale).clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16), scale


def _quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = Fp8Format.E4M3
    scale = reference.amax_to_scale(reference.amax(x, []), fmt.max, 0, False)
    return reference.cast(x, scale, fmt.dtype, []), scale


class Fp8AdamW(torch.optim.Optimizer):
    """`torch.optim.AdamW`'s update with the first moment stored in FP8 E4M3 and the second in FP16,
    each with a per-tensor fp32 scale (state keys `exp_avg`, `exp_avg_scale`, `exp_avg_sq`,
    `exp_avg_sq_scale`, `step`). Parameters and gradients keep their own dtype. For a sharded
    (FSDP2, DTensor) parameter the state holds this rank's shard, scaled on its own."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        for name, value, low in (("lr", lr, 0.0), ("eps", eps, 0.0), ("weight_decay", weight_decay, 0.0)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= low):
                raise ValueError(f"Fp8AdamW: {name} must be a finite number >= {low}, got {value!r}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"Fp8AdamW: betas must be two numbers in [0, 1), got {betas!r}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch.optim's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Fp8AdamW does not support sparse gradients")
                state = self.state[p]
                grad = _local(p.grad).float()
                p = _local(p)
                if not state:
                    state["step"] = 0
                    m, v = torch.zeros_like(grad), torch.zeros_like(grad)
                else:
                    m = state["exp_avg"].float() / state["exp_avg_scale"]
                    v = state["exp_avg_sq"].float() / state["exp_avg_sq_scale"]
                state["step"] += 1
                step = state["step"]
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (v / (1 - beta2**step)).sqrt_().add_(group["eps"])
                update = (m / (1 - beta1**step)).div_(denom)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"])
                state["exp_avg"], state["exp_avg_scale"] = _quantize_fp8(m)
                state["exp_avg_sq"], state["exp_avg_sq_scale"] = _quantize_fp16(v)
        return loss
