"""The NVFP4 operators: the random Hadamard transform, the two-level scales and the FP4 cast, with
their reference (CPU) implementations and fakes.

An NVFP4 operand is `fp8fx::amax` (per block) -> `fp8fx::nvfp4_scale` -> `fp8fx::cast_nvfp4`, after
`fp8fx::hadamard` for the weight gradient's operands; its GEMM is the ordinary `fp8fx::scaled_mm`
on the E4M3 tensors carrying E2M1 values, with per-block scale inverses (1x16, 16x16 for weights):
each 16 of K is one exactly scaled partial product added in fp32 (fp8fx.ops.reference). The math
lives in fp8fx.core.fp4 and fp8fx.core.scaling. On a GPU these ops run as the same torch code (no
fused cast kernel yet) and the GEMMs in the generated NVFP4 kernel (fp8fx.codegen.nvfp4_kernel).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.library import custom_op

from fp8fx.core import fp4, scaling
from fp8fx.ops.reference import check_block


@functools.cache
def _matrix() -> Tensor:
    return fp4.hadamard_matrix()


def _padded(size, multiple: int = fp4.HADAMARD_SIZE):
    return -(-size // multiple) * multiple  # SymInt-friendly ceil to a multiple


@custom_op("fp8fx::hadamard", mutates_args=())
def hadamard(x: Tensor, dim: int) -> Tensor:
    """`x` (fp32 out) with every 16 elements along `dim` multiplied by the fixed 16x16 random
    Hadamard matrix, `dim` zero-padded to a multiple of 16 (fp8fx.core.fp4.hadamard_transform)."""
    return fp4.hadamard_transform(x, dim, _matrix())


@custom_op("fp8fx::nvfp4_scale", mutates_args=())
def nvfp4_scale(block_amax: Tensor) -> tuple[Tensor, Tensor]:
    """(scale, scale_inv) per block from the blocks' amaxes: fp8fx.core.scaling.nvfp4_scales."""
    return scaling.nvfp4_scales(block_amax)


@custom_op("fp8fx::cast_nvfp4", mutates_args=())
def cast_nvfp4(x: Tensor, scale: Tensor, block: list[int], stochastic: bool) -> Tensor:
    """`x * scale` (per block) rounded to E2M1, saturating at +-6, in its E4M3 carrier. `stochastic`
    rounds with uniforms from torch's default generator (`torch.manual_seed` makes it repeat)."""
    check_block(block, "cast_nvfp4")
    scaled = x.to(torch.float32) * scaling.expand_blocks(scale, tuple(block), x.shape)
    rounded = fp4.stochastic_round_e2m1(scaled) if stochastic else fp4.round_e2m1(scaled)
    return torch.empty_like(x, dtype=fp4.CARRIER).copy_(rounded)  # x's layout, as the fake says


@hadamard.register_fake
def _(x: Tensor, dim: int) -> Tensor:
    shape = list(x.shape)
    shape[dim] = _padded(shape[dim])
    return x.new_empty(shape, dtype=torch.float32)


@nvfp4_scale.register_fake
def _(block_amax: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(block_amax, dtype=torch.float32), torch.empty_like(block_amax, dtype=torch.float32)


@cast_nvfp4.register_fake
def _(x: Tensor, scale: Tensor, block: list[int], stochastic: bool) -> Tensor:
    return torch.empty_like(x, dtype=fp4.CARRIER)
