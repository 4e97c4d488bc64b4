"""The ops `fp8fx.tools.export` puts in a model's `torch.export` graph, each written to ONNX as
standard QuantizeLinear / DequantizeLinear (the translations are the exporter's): the CPU
emulation of what onnxruntime then runs."""

from __future__ import annotations

import torch
from torch import Tensor

from fp8fx.core.formats import Fp8Format
from fp8fx.ops import reference


@torch.library.custom_op("fp8fx::export_qdq", mutates_args=())
def export_qdq(x: Tensor, scale_inv: Tensor, fmt: str) -> Tensor:
    """Static per-tensor quantize -> dequantize (ONNX: QuantizeLinear, DequantizeLinear)."""
    f = Fp8Format(fmt)
    return reference.cast(x, scale_inv.float().reciprocal(), f.dtype, []).to(x.dtype) * scale_inv


@export_qdq.register_fake
def _(x: Tensor, scale_inv: Tensor, fmt: str) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("fp8fx::export_dequantize", mutates_args=())
def export_dequantize(w: Tensor, scale_inv: Tensor, axis: int, block_size: int) -> Tensor:
    """FP8 weight times its scale_inv, in the scale's dtype: per tensor, per `axis`, or in blocks of
    `block_size` along `axis`."""
    w = w.to(scale_inv.dtype)
    if scale_inv.dim() == 0:
        return w * scale_inv
    if block_size:
        return w * scale_inv.repeat_interleave(block_size, dim=axis).narrow(axis, 0, w.shape[axis])
    return w * scale_inv.reshape([-1 if d == axis else 1 for d in range(w.dim())])


@export_dequantize.register_fake
def _(w: Tensor, scale_inv: Tensor, axis: int, block_size: int) -> Tensor:
    return torch.empty(w.shape, dtype=scale_inv.dtype, device=w.device)
