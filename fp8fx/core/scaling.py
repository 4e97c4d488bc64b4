"""amax -> scale math for every granularity (pure functions on tensors).

Convention, used everywhere in fp8fx:
    x_fp8 = saturate(x * scale)        x ~= x_fp8 * scale_inv
    scale = fp8_max / amax / 2**margin
An amax of 0, inf or NaN gives scale 1: a scale is never 0, inf or NaN.

Granularity is described by a block over the last two dimensions of a GEMM operand:
`()` is one scale for the whole tensor (tensorwise, a 0-d scale); `(b0, b1)` gives one scale per
b0 x b1 block, where 0 means "the whole dimension". Rowwise is (1, 0) for the left operand and
(0, 1) for the right one (one scale per row / column, along the contraction dimension); DeepSeek-V3's
blockwise recipe is (1, 128) for activations and gradients, (128, 128) for weights. Scales of a
blocked operand have shape [..., ceil(rows / b0), ceil(cols / b1)]; partial blocks at the edges
take the amax of what they hold.

MX (OCP Microscaling) scales are powers of two stored as E8M0 (an 8-bit biased exponent, 2**-127 to
2**127): `e8m0_exponent` rounds an amax to one with torchao's FLOOR or RCEIL rule, `mx_scale` turns
it into the multiplier of the convention above (`2**-exponent`; scale_inv is the E8M0 value).

NVFP4 scales in two levels: one fp32 scale per tensor, `amax / (448 * 6)`, and one E4M3 scale per
block (1x16 along K; 16x16 for weights) of the block's `amax / 6` over the per-tensor one
(`nvfp4_scales`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_FP32_MAX = torch.finfo(torch.float32).max
_FP32_TINY = torch.finfo(torch.float32).tiny  # smallest normal: 1 / scale stays finite

Block = tuple[int, ...]  # () or (b0, b1)


def tensor_amax(x: Tensor) -> Tensor:
    """Largest magnitude of `x` as an fp32 scalar (NaN if `x` holds a NaN; 0 if it is empty)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x.detach())  # one pass, no |x| temporary
    return torch.maximum(-lo, hi).to(torch.float32)


def block_dims(shape: torch.Size | tuple, block: Block) -> tuple[int, int]:
    """The concrete block size for an operand of `shape` (0 -> the whole dimension)."""
    rows, cols = shape[-2], shape[-1]
    return (block[0] or rows, block[1] or cols)


def scale_shape(shape: torch.Size | tuple, block: Block) -> tuple:
    """Shape of the scales of an operand of `shape` with `block` (() for tensorwise)."""
    if not block:
        return ()
    b0, b1 = block_dims(shape, block)
    return (*shape[:-2], _blocks(shape[-2], b0), _blocks(shape[-1], b1))


def _blocks(size: int, block: int) -> int:
    """Blocks along a dimension of `size`; a whole dimension of size 0 is one empty block, so an
    empty tensor's scales have the shape they have at any other size (one per column: [1, cols])."""
    return math.ceil(size / block) if block else 1


def block_amax(x: Tensor, block: Block) -> Tensor:
    """amax per block of the last two dims: [..., ceil(rows/b0), ceil(cols/b1)] in fp32."""
    if not block:
        return tensor_amax(x)
    if x.numel() == 0:  # no values: every block's amax is 0 (scale 1)
        return torch.zeros(scale_shape(x.shape, block), dtype=torch.float32, device=x.device)
    rows, cols = x.shape[-2], x.shape[-1]
    b0, b1 = block_dims(x.shape, block)
    n0, n1 = math.ceil(rows / b0), math.ceil(cols / b1)
    x = x.detach().abs()
    if (b0, b1) == (1, cols):  # rowwise: one reduction along the rows
        return x.amax(dim=-1, keepdim=True).to(torch.float32)
    if (b0, b1) == (rows, 1):  # per column
        return x.amax(dim=-2, keepdim=True).to(torch.float32)
    if n0 * b0 != rows or n1 * b1 != cols:  # zeros never raise an amax: pad partial blocks
        x = torch.nn.functional.pad(x, (0, n1 * b1 - cols, 0, n0 * b0 - rows))
    return x.reshape(*x.shape[:-2], n0, b0, n1, b1).amax(dim=(-3, -1)).to(torch.float32)


def expand_blocks(scale: Tensor, block: Block, shape: torch.Size | tuple) -> Tensor:
    """Per-block values broadcastable to an operand of `shape` (tensorwise: unchanged).

    Dimensions with blocks of 1 or of the whole dimension broadcast as they are; only blocks
    strictly in between are repeated out."""
    if not block:
        return scale
    for dim, b in zip((-2, -1), block_dims(shape, block)):
        if 1 < b < shape[dim]:
            scale = scale.repeat_interleave(b, dim=dim).narrow(dim, 0, shape[dim])
    return scale


E8M0_BIAS = 127
E8M0_MIN, E8M0_MAX = -127, 127  # exponents an E8M0 scale holds (255 is its NaN)


def e8m0_exponent(amax: Tensor, fp8_max: float, rounding: str) -> Tensor:
    """Unbiased exponent (int32) of the E8M0 scale_inv of an MX block with largest magnitude `amax`
    (finite, >= 0), clamped to [-127, 127]; `rounding` is "floor" or "rceil" (torchao's modes).

    floor (the OCP MX spec): `floor(log2(amax)) - emax`, emax = floor(log2(fp8_max)) (8 for E4M3),
    read from the fp32 exponent field (a subnormal amax counts as 2**-127). rceil (cuBLAS, TE):
    `ceil(log2(amax / fp8_max))` of the fp32 quotient, taken exactly from its bits as the
    `cvt.rp.satfinite.ue8m0x2.f32` instruction does (torchao's CPU fallback takes it through fp32
    `log2`, which can round a quotient a few ulps above a power of two down to it)."""
    amax = amax.to(torch.float32)
    if rounding == "floor":
        field = (amax.view(torch.int32) >> 23) & 0xFF
        exponent = field - 127 - math.floor(math.log2(fp8_max))
    elif rounding == "rceil":
        bits = (amax / fp8_max).view(torch.int32)
        field, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        # A normal quotient: its exponent, plus one unless it is a power of two. A subnormal one
        # (field 0) is at most 2**-127 and clamps there.
        exponent = torch.where(field > 0, field - 127 + (mantissa != 0).to(torch.int32), torch.full_like(field, E8M0_MIN))
    else:
        raise ValueError(f"fp8fx: MX scale rounding must be floor or rceil, got {rounding!r}")
    return exponent.clamp(E8M0_MIN, E8M0_MAX).to(torch.int32)


def mx_scale(amax: Tensor, fp8_max: float, rounding: str) -> Tensor:
    """MX scale (fp32, a power of two: `2**-e8m0_exponent`) for each block's `amax`; 1 where amax
    is non-finite. A block of zeros gets 2**127 (its scale_inv is E8M0's smallest, 2**-127, as in
    torchao); its data stays zero."""
    usable = torch.isfinite(amax)
    exponent = e8m0_exponent(torch.where(usable, amax, torch.zeros_like(amax)).to(torch.float32), fp8_max, rounding)
    scale = ((E8M0_BIAS - exponent) << 23).view(torch.float32)  # 2**-exponent: a normal fp32 for |exponent| <= 127
    return torch.where(usable, scale, torch.ones_like(scale))


def amax_to_scale(
    amax: Tensor, fp8_max: float, margin: int = 0, power_of_two: bool = False, rounding: str | None = None
) -> Tensor:
    """Scale that maps `amax` onto `fp8_max / 2**margin`; 1 where amax is 0 or non-finite.

    `power_of_two` rounds the scale down to a power of two, so scaling changes only exponents.
    `rounding` ("floor" | "rceil") gives MX's E8M0 scales instead (`mx_scale`; no margin). MX's
    rceil equals `power_of_two` with margin 0 for every nonzero amax above `fp8_max * 2**-127`
    (both are `2**floor(log2(fp8_max / amax))`); below that, and for zero, this returns 2**127
    where `power_of_two` clamps or returns 1."""
    if rounding is not None:
        if margin:
            raise ValueError(f"fp8fx: MX scales take no margin, got margin={margin}")
        return mx_scale(amax, fp8_max, rounding)
    # In fp64, then rounded once to fp32: the same scale in eager and compiled code (and torchao's).
    amax = amax.to(torch.float64)
    # Finite and positive: NaN fails both comparisons, inf the second. (Fewer ops than isfinite's
    # three: Inductor lowers and generates code for each op of every scale of a graph.)
    usable = (amax > 0) & (amax < math.inf)
    # Tiny amax would give an inf scale, a huge one (with a margin) a zero or subnormal scale whose
    # inverse is inf: clamp to the finite normal fp32 range. An unusable amax gives inf or NaN
    # here, which the `where` below replaces.
    top = fp8_max / (2.0**margin)
    # (The floor binds only with a margin: without one, fp32's largest amax still gives a normal scale.)
    floor = _FP32_TINY if top / _FP32_MAX < _FP32_TINY else None
    scale = (top / amax).to(torch.float32).clamp(min=floor, max=_FP32_MAX)
    if power_of_two:  # drop the mantissa bits (as the kernels do): log2/exp2 would round 2**128 - eps up to inf
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return torch.where(usable, scale, 1.0)


NVFP4_E4M3_MAX = 448.0  # the block scales' format (E4M3)
NVFP4_E2M1_MAX = 6.0  # the elements' format (E2M1)
_E4M3_TINY = 2.0**-6  # E4M3's smallest normal: block scales are clamped to normal E4M3 values (as torchao)


def nvfp4_tensor_scale_inv(amax: Tensor) -> Tensor:
    """NVFP4's per-tensor (second-level) scale inverse, fp32: `amax / (448 * 6)`, so that a block
    holding the tensor's amax gets the largest E4M3 block scale. 1 for an amax of 0 or non-finite
    (TransformerEngine's 1 for 0), and at least the smallest normal fp32 so its inverse is finite."""
    amax = amax.to(torch.float32)
    usable = torch.isfinite(amax) & (amax > 0)
    scale_inv = (amax / (NVFP4_E4M3_MAX * NVFP4_E2M1_MAX)).clamp(min=_FP32_TINY)
    return torch.where(usable, scale_inv, torch.ones_like(scale_inv))


def nvfp4_block_scales(block_amax: Tensor, tensor_scale_inv: Tensor) -> Tensor:
    """The E4M3 block scales (decode factors, `float8_e4m3fn`) of blocks with largest magnitude
    `block_amax` under the per-tensor `tensor_scale_inv`: `block_amax / 6 / tensor_scale_inv`
    rounded to E4M3, clamped to [2**-6, 448] (torchao's `nvfp4_quantize`). A non-finite block amax
    counts as 0 (the block gets the smallest scale)."""
    block_amax = torch.where(torch.isfinite(block_amax), block_amax, torch.zeros_like(block_amax)).to(torch.float32)
    return (block_amax / NVFP4_E2M1_MAX / tensor_scale_inv).clamp(min=_E4M3_TINY, max=NVFP4_E4M3_MAX).to(torch.float8_e4m3fn)


def nvfp4_scales(block_amax: Tensor) -> tuple[Tensor, Tensor]:
    """(scale, scale_inv) per block, fp32, of an NVFP4 cast from its blocks' amaxes.

    The per-tensor amax is the largest finite block amax. `scale` multiplies the data before the
    E2M1 cast: `(1 / tensor_scale_inv) / e4m3_block_scale` (torchao's and the MSLK kernel's order,
    clamped to the fp32 range); `scale_inv` = `tensor_scale_inv * e4m3_block_scale` is what a
    dequantized element is `e2m1 * scale_inv` with (torchao's `get_hp_scales`)."""
    finite = torch.where(torch.isfinite(block_amax), block_amax, torch.zeros_like(block_amax)).to(torch.float32)
    tensor_scale_inv = nvfp4_tensor_scale_inv(finite.amax() if finite.numel() else finite.new_zeros(()))
    block = nvfp4_block_scales(finite, tensor_scale_inv).to(torch.float32)
    scale = ((1.0 / tensor_scale_inv) / block).clamp(max=_FP32_MAX)
    return scale, tensor_scale_inv * block


def storage_order(x: Tensor) -> list[int]:
    """The dims of `x` from the outermost in memory to the innermost (a permutation that makes a
    dense `x` contiguous)."""
    return sorted(range(x.dim()), key=lambda d: (-x.stride(d), -d))
