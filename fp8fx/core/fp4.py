"""NVFP4's element format and transform: FP4 E2M1 casts (round-to-nearest-even and stochastic) and
the 16x16 random Hadamard transform of TransformerEngine's NVFP4 recipe.

E2M1 has one sign, two exponent and one mantissa bit: the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
(max 6), no inf and no NaN. Every E2M1 value is exactly an E4M3 value, so fp8fx carries FP4 data in
`float8_e4m3fn` tensors holding only E2M1 values: the GEMMs and their checks take them unchanged,
and the bytes a GPU would use are `e2m1_codes` of them. The casts here take already-scaled values;
they clamp to +-6 first (saturate), keep NaN as NaN (the carrier can hold it; a GPU's
`cvt.satfinite` cannot) and keep the sign of zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes, by code (sign is bit 3)
CARRIER = torch.float8_e4m3fn  # the dtype that holds FP4 values in graphs (exactly)

HADAMARD_SIZE = 16
HADAMARD_SEED = 1234  # the random sign diagonal's seed: fixed, so every process builds the same transform


def _step(magnitude: Tensor) -> Tensor:
    """The spacing of E2M1 values at `magnitude` (<= 6): 0.5 below 2, 1 below 4, 2 from 4 on."""
    return torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))


def round_e2m1(x: Tensor) -> Tensor:
    """`x` (fp32, already scaled) rounded to the nearest E2M1 value, ties to even, saturating at +-6.

    Within each binade the values are multiples of one power-of-two step, and an even multiple is
    an even mantissa (0 -> 0, 0.5 -> 1, 1 -> 2, 1.5 -> 3, ...): `torch.round`'s ties-to-even on the
    exact quotient is the format's. Returns fp32."""
    magnitude = x.abs().clamp(max=E2M1_MAX)
    step = _step(magnitude)
    return torch.copysign(torch.round(magnitude / step) * step, x)


def stochastic_round_e2m1(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """`x` (fp32, already scaled) rounded to one of its two neighbouring E2M1 values, up with
    probability equal to its distance from the lower one over their spacing, so the expectation is
    `x` (saturating at +-6 first). Uniforms come from `generator` (torch's default one when None),
    one per element. Returns fp32."""
    magnitude = x.abs().clamp(max=E2M1_MAX)
    step = _step(magnitude)
    low = torch.floor(magnitude / step) * step
    u = torch.rand(x.shape, generator=generator, dtype=torch.float32, device=x.device)
    up = u < (magnitude - low) / step
    return torch.copysign(torch.where(up, low + step, low), x)


def e2m1_codes(values: Tensor) -> Tensor:
    """The 4-bit E2M1 codes (uint8, sign in bit 3) of tensors holding E2M1 values (any float dtype)."""
    v = values.to(torch.float32)
    magnitude = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for i, value in enumerate(E2M1_VALUES):
        code = torch.where(magnitude == value, i, code)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def _code_of_carrier_byte() -> Tensor:
    """The E2M1 code of each of the 256 carrier (E4M3) bytes; bytes that are not E2M1 values map to
    the code of their value clamped to +-6 and truncated to the grid below 2 (never produced by
    fp8fx's casts, which write E2M1 values only)."""
    values = torch.arange(256, dtype=torch.uint8).view(CARRIER).to(torch.float32)
    return e2m1_codes(torch.nan_to_num(round_e2m1(values)))


_CARRIER_TO_CODE = _code_of_carrier_byte()


def pack_e2m1(values: Tensor) -> Tensor:
    """Carrier tensor [R, K] (E2M1 values in E4M3) -> uint8 [R, ceil(K / 32) * 16]: two E2M1 codes per
    byte along K, the even element in the low nibble (how Blackwell's FP4 MMA and Triton's
    `dot_scaled` read `e2m1`), K zero-padded to a multiple of 32. One table lookup per element."""
    if values.dtype != CARRIER or values.dim() != 2:
        raise ValueError(
            f"fp8fx pack_e2m1: needs a 2-D {CARRIER} tensor of E2M1 values, got {values.dtype} {tuple(values.shape)}"
        )
    k = values.shape[1]
    codes = _CARRIER_TO_CODE.to(values.device)[values.view(torch.uint8).long()]
    codes = torch.nn.functional.pad(codes, (0, -k % 32))
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def hadamard_matrix(seed: int = HADAMARD_SEED) -> Tensor:
    """The 16x16 random Hadamard transform `D @ H16 / 4` (fp32): Sylvester's Hadamard matrix
    normalized to be orthogonal, rows multiplied by a random sign diagonal `D` drawn from `seed`.
    Its entries are +-1/4, so it is exact in every float format."""
    h = torch.ones(1, 1)
    while h.shape[0] < HADAMARD_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (HADAMARD_SIZE,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return signs.to(torch.float32)[:, None] * h / 4.0


def hadamard_transform(x: Tensor, dim: int, matrix: Tensor) -> Tensor:
    """Every 16 consecutive elements `v` of `x` along `dim` replaced by `v @ matrix` (fp32), `dim`
    zero-padded to a multiple of 16 first. Along the contraction dim of both operands of a GEMM,
    `(A R)(R^T B) = A B` for the block-diagonal orthogonal `R`: the left operand takes `dim=-1`,
    the right one `dim=-2`. In fp32 (fp64 for fp64 inputs), contiguous."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    x = x.to(dtype).movedim(dim, -1)
    n = x.shape[-1]
    padded = -(-n // HADAMARD_SIZE) * HADAMARD_SIZE
    if padded != n:
        x = torch.nn.functional.pad(x, (0, padded - n))
    out = (x.reshape(*x.shape[:-1], padded // HADAMARD_SIZE, HADAMARD_SIZE) @ matrix.to(x.device, dtype)).reshape(x.shape)
    return out.movedim(-1, dim).contiguous()
