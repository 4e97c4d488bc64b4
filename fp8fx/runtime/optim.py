"""AdamW with low-precision moments (MS-AMP's O2 optimizer): the first moment in FP8 (E4M3), the
second in FP16, each with a per-tensor scale, so the two states take 3 bytes per parameter instead
of 8 (62.5% less optimizer memory).

Each step dequantizes the moments, applies the usual AdamW update in fp32, and quantizes them
again with fresh scales: `m_fp8 = saturate(m * scale)` with `scale = 448 / amax(m)` (fp8fx's scale
convention, 1 for a zero or non-finite amax), and the second moment likewise onto FP16's largest
value 65504 with a margin of one binade. A scale keeps the second moment, which is the square of
gradients, clear of FP16's underflow.

The step is fused across parameters, as `torch.optim.AdamW(foreach=True)` is: with hundreds of
parameters a loop launching a dozen kernels per parameter costs far more than the arithmetic. The
parameters of a group are bucketed by (device, dtype, step count), the bias corrections being
scalars then, and each bucket runs one pass of a fixed number of kernels whatever its number of
tensors: gradients and moments are concatenated into flat fp32 buffers, the AdamW arithmetic runs
on those, and parameters and states are updated with `torch._foreach_*`. On a GPU the per-tensor
scales are expanded over the flat buffer with `repeat_interleave` (torch's multi-tensor kernels
fuse a list only with one scalar or with equally shaped tensors, not with a device scalar per
tensor) and every tensor's amax comes from one `torch._foreach_norm(inf)`; no step syncs with the
host. On the CPU, whose `_foreach_*` ops are loops over tensors anyway, the scales are applied per
tensor and amaxes come from aminmax. Buckets are cut into chunks of at most `_CHUNK_NUMEL`
elements, which bounds the fp32 temporaries (on a CPU, of `_CPU_CHUNK_NUMEL`: cache-sized buffers,
or streaming them through memory would make the step slower than the per-tensor loop it replaces).
The arithmetic is the per-parameter loop's, operation for operation, and the results bit-identical
(tests/runtime/test_optim.py keeps that loop as the reference and runs both paths).

A state_dict() holds the live state tensors, as torch's optimizers' do (the step updates them in
place): copy it to keep a snapshot past the next step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import NamedTuple

import torch

from fp8fx.core.formats import upcast
from fp8fx.core.scaling import amax_to_scale, tensor_amax

_FP16_MAX = torch.finfo(torch.float16).max
_CHUNK_NUMEL = 1 << 25  # elements per fused pass: its fp32 temporaries take ~20 bytes per element
_CPU_CHUNK_NUMEL = 1 << 18  # on a CPU, passes over cache-sized buffers (2 cores: 2**16 to 2**18 best, 2**20+ slower)


class _Moment(NamedTuple):
    """How one moment is stored: its state keys, dtype, the format's largest value and the scale's
    margin (binades of headroom)."""

    key: str
    scale_key: str
    dtype: torch.dtype
    max: float
    margin: int


# The first moment onto E4M3's full range; the second with a binade of headroom for the next step's growth.
_MOMENTS = (
    _Moment("exp_avg", "exp_avg_scale", torch.float8_e4m3fn, 448.0, 0),
    _Moment("exp_avg_sq", "exp_avg_sq_scale", torch.float16, _FP16_MAX, 1),
)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage: in-place updates reach the parameter): the moments and
    their scales are per shard, so no step needs a collective."""
    return t.to_local() if hasattr(t, "to_local") else t


def _multi_tensor(device: torch.device) -> bool:
    """Whether `device` has torch's fused multi-tensor kernels. The CPU's `_foreach_*` ops loop over
    the tensors (in C++): there a loop of per-tensor ops beats expanding per-tensor values over a
    flat buffer, and aminmax beats the inf-norm (~10x faster on a CPU)."""
    return device.type not in _LOOPING_DEVICES


_LOOPING_DEVICES = ("cpu",)  # (tests empty it to run the GPU's path on CPU tensors)


@functools.lru_cache(maxsize=256)
def _repeats(numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`numels` on `device`, made once per chunk (the same at every step): copying a list from the
    host's pageable memory to a GPU waits for the GPU's queue to drain."""
    return torch.tensor(numels, device=device)


def _scale_(flat: torch.Tensor, scales: torch.Tensor, numels: list[int], divide: bool) -> torch.Tensor:
    """`flat` (a run of elements per tensor) multiplied or divided in place by each tensor's scale
    (`scales`, 1-D fp32). On a GPU the scales are expanded over the elements, without a host sync."""
    if _multi_tensor(flat.device):
        expanded = torch.repeat_interleave(scales, _repeats(tuple(numels), flat.device), output_size=flat.numel())
        return flat.div_(expanded) if divide else flat.mul_(expanded)
    (torch._foreach_div_ if divide else torch._foreach_mul_)(list(flat.split(numels)), list(scales.unbind()))
    return flat


def _amax(flat: torch.Tensor, numels: list[int]) -> torch.Tensor:
    """Each tensor's largest magnitude (NaN if it holds one), fp32: one multi-tensor reduction on a GPU."""
    if _multi_tensor(flat.device):
        return torch.stack(torch._foreach_norm(flat.split(numels), ord=float("inf")))
    return torch.stack([tensor_amax(part) for part in flat.split(numels)])


def _dequantize(states: list[dict], moment: _Moment, numels: list[int]) -> torch.Tensor:
    """The moment of every tensor, flat, in fp32: `stored / scale`."""
    flat = upcast(torch.cat([s[moment.key].reshape(-1) for s in states]))
    return _scale_(flat, torch.stack([s[moment.scale_key] for s in states]), numels, divide=True)


def _quantize(x: torch.Tensor, numels: list[int], moment: _Moment) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (flat, fp32) saturated onto `moment`'s format with a fresh scale per tensor, in place of
    `x`'s values: (stored, scales)."""
    scales = amax_to_scale(_amax(x, numels), moment.max, moment.margin)
    return _scale_(x, scales, numels, divide=False).clamp_(-moment.max, moment.max).to(moment.dtype), scales


def _chunks(params: list, numel: int) -> list[list]:
    """`params` in order, cut into runs of at most `numel` elements (a larger tensor alone)."""
    chunks, size = [[]], 0
    for p in params:
        n = _local(p).numel()
        if chunks[-1] and size + n > numel:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += n
    return chunks


class Fp8AdamW(torch.optim.Optimizer):
    """`torch.optim.AdamW`'s update with the first moment stored in FP8 E4M3 and the second in FP16,
    each with a per-tensor fp32 scale (state keys `exp_avg`, `exp_avg_scale`, `exp_avg_sq`,
    `exp_avg_sq_scale`, `step`). Parameters and gradients keep their own dtype. For a sharded
    (FSDP2, DTensor) parameter the state holds this rank's shard, scaled on its own. One step is a
    few fused multi-tensor passes per parameter group (see the module's docstring)."""

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
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Fp8AdamW does not support sparse gradients")
            buckets: dict[tuple, list] = {}  # one fused pass per (device, dtype, step): bias corrections are scalars
            for p in params:
                state, weight = self.state[p], _local(p)
                if not state:  # zero moments stored with scale 1 dequantize to exact zeros
                    state["step"] = 0
                    for m in _MOMENTS:
                        state[m.key] = torch.zeros(weight.shape, dtype=m.dtype, device=weight.device)
                        state[m.scale_key] = torch.ones((), device=weight.device)
                state["step"] += 1
                if weight.numel():  # an FSDP2 shard may be empty
                    buckets.setdefault((weight.device, weight.dtype, state["step"]), []).append(p)
            for (_, _, step), bucket in buckets.items():
                device = _local(bucket[0]).device
                for chunk in _chunks(bucket, _CHUNK_NUMEL if _multi_tensor(device) else _CPU_CHUNK_NUMEL):
                    self._fused_step(chunk, group, step)
        return loss

    def _fused_step(self, params: list, group: dict, step: int) -> None:
        """The AdamW update of `params` (same device, dtype and step count) as flat fp32 buffers."""
        beta1, beta2 = group["betas"]
        lr, weight_decay = group["lr"], group["weight_decay"]
        weights = [_local(p) for p in params]
        states = [self.state[p] for p in params]
        numels = [w.numel() for w in weights]
        grad = torch.cat([_local(p.grad).reshape(-1) for p in params]).float()
        m, v = (_dequantize(states, moment, numels) for moment in _MOMENTS)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        del grad
        denom = (v / (1 - beta2**step)).sqrt_().add_(group["eps"])
        update = (m / (1 - beta1**step)).div_(denom).to(weights[0].dtype)
        del denom
        if lr * weight_decay:
            torch._foreach_mul_(weights, 1 - lr * weight_decay)
        torch._foreach_add_(weights, [u.view_as(w) for u, w in zip(update.split(numels), weights)], alpha=-lr)
        del update
        for moment, x in zip(_MOMENTS, (m, v)):
            stored, scales = _quantize(x, numels, moment)
            stored = [q.view_as(w) for q, w in zip(stored.split(numels), weights)]
            torch._foreach_copy_([s[moment.key] for s in states], stored)
            torch._foreach_copy_([s[moment.scale_key] for s in states], list(scales.unbind()))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, except that the moments and scales keep their dtypes: torch casts every
        floating-point state to its parameter's dtype (for a bf16 parameter that would round the
        FP16 second moment and the fp32 scales)."""
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for key, value in state_dict["state"].get(i, {}).items():
                if torch.is_tensor(value):
                    self.state[p][key] = value.to(device=_local(p).device)
