"""Launchers for the generated kernels: check every argument, pick a config, run.

The kernels run on CUDA tensors (autotuned per architecture over M, N, K) or, for debugging and
CPU tests, on CPU tensors under Triton's interpreter. The interpreter is chosen when Triton
defines the kernels, so it has to be switched on before fp8fx is imported: `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch
import triton
from torch import Tensor

from fp8fx.codegen.triton_kernels import amax_kernel, fp8_gemm_kernel, quantize_kernel
from fp8fx.codegen.variants import INTERPRETER_CONFIG, Epilogue, GemmVariant, QuantizeVariant, TileConfig, arch_of, configs_for
from fp8fx.formats import fp8_format_of
from fp8fx.scaling import scale_shape

_FP_FUSION = dict(enable_fp_fusion=True)  # explicit: Triton warns when left to its default


def interpreter_active() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _check_device(tensors: dict[str, Tensor | None]) -> torch.device:
    present = {k: t for k, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) != 1:
        raise ValueError(f"fp8fx kernel: arguments on different devices: {', '.join(f'{k}={t.device}' for k, t in present.items())}")
    device = devices.pop()
    if device.type != "cuda" and not interpreter_active():
        raise RuntimeError(
            f"fp8fx: the Triton kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter; got {device}. "
            "Set TRITON_INTERPRET=1 before importing fp8fx to debug them on the CPU."
        )
    return device


def _check_shape(name: str, t: Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"fp8fx FP8 GEMM: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _scale_strides(scale: Tensor, block: tuple) -> tuple[int, int]:
    return (0, 0) if not block else (scale.stride(-2), scale.stride(-1))


@functools.cache
def _autotuned(arch: str, variant: GemmVariant):
    """One autotuner per variant and GPU, over that variant's configs, keyed on M, N, K."""
    configs = [
        triton.Config(c.constexprs(), num_warps=c.num_warps, num_stages=c.num_stages, **_FP_FUSION) for c in configs_for(arch, variant)
    ]
    return triton.autotune(configs=configs, key=["M", "N", "K"])(fp8_gemm_kernel)


def fp8_gemm(
    a: Tensor,
    b: Tensor,
    scale_inv_a: Tensor,
    scale_inv_b: Tensor,
    *,
    block_a: tuple = (),
    block_b: tuple = (),
    epilogue: Epilogue = Epilogue(),
    bias: Tensor | None = None,
    other: Tensor | None = None,
    residual: Tensor | None = None,
    out_scale: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    aux_dtype: torch.dtype = torch.bfloat16,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """`epilogue((a * scale_inv_a) @ (b * scale_inv_b))` with one generated kernel.

    a: [M, K] FP8 row-major (K contiguous); b: [K, N] FP8 column-major (K contiguous), as FP8
    tensor cores read them. Returns (out, aux or None, amax or None)."""
    block_a, block_b = tuple(block_a), tuple(block_b)
    variant = GemmVariant(a.dtype, b.dtype, block_a, block_b, epilogue, out_dtype, aux_dtype)
    device = _check_device(dict(a=a, b=b, scale_inv_a=scale_inv_a, scale_inv_b=scale_inv_b, bias=bias, other=other, residual=residual, out_scale=out_scale))
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8fx FP8 GEMM: needs 2-D [M, K] @ [K, N], got {tuple(a.shape)} @ {tuple(b.shape)}")
    (m, k), n = a.shape, b.shape[1]
    if a.stride(1) != 1 or b.stride(0) != 1:
        raise ValueError(
            f"fp8fx FP8 GEMM: both operands must be K-contiguous (a row-major, b column-major); got a strides {a.stride()}, "
            f"b strides {b.stride()}. Quantize with transpose=True to get the column-major copy."
        )
    for name, t, lead in (("a", a, a.stride(0)), ("b", b, b.stride(1))):
        if m > 1 and n > 1 and lead % 16:
            raise ValueError(f"fp8fx FP8 GEMM: operand {name}'s leading stride {lead} is not a multiple of 16 bytes")
    for name, s, shape, block in (("scale_inv_a", scale_inv_a, a.shape, block_a), ("scale_inv_b", scale_inv_b, b.shape, block_b)):
        if s.dtype != torch.float32 or tuple(s.shape) != tuple(scale_shape(shape, block)):
            raise ValueError(f"fp8fx FP8 GEMM: {name} must be fp32 of shape {tuple(scale_shape(shape, block))} for block {block}, got {s.dtype} {tuple(s.shape)}")
    for name, t, wanted, shape in (
        ("bias", bias, epilogue.bias, (n,)),
        ("other", other, epilogue.mul != "none", (m, n)),
        ("residual", residual, epilogue.residual, (m, n)),
        ("out_scale", out_scale, variant.constexprs()["OUT_FP8"], ()),
    ):
        if wanted != (t is not None):
            raise ValueError(f"fp8fx FP8 GEMM: epilogue {epilogue.spec() or 'plain'!r} {'needs' if wanted else 'takes no'} {name}")
        if t is not None:
            _check_shape(name, t, shape)
    if bias is not None and bias.stride(0) != 1:
        raise ValueError(f"fp8fx FP8 GEMM: bias must be contiguous, got stride {bias.stride(0)}")

    out = torch.empty((m, n), dtype=out_dtype, device=device)
    aux = torch.empty((m, n), dtype=aux_dtype, device=device) if epilogue.aux != "none" else None
    amax = torch.zeros((), dtype=torch.float32, device=device) if epilogue.out_amax else None
    placeholder = scale_inv_a  # pointer for absent tensors: never read (its constexpr branch is off)

    def strides(t):
        return (t.stride(0), t.stride(1)) if t is not None else (0, 0)

    args = (
        a, b, out, scale_inv_a, scale_inv_b,
        bias if bias is not None else placeholder, other if other is not None else placeholder,
        residual if residual is not None else placeholder, aux if aux is not None else placeholder,
        out_scale if out_scale is not None else placeholder, amax if amax is not None else placeholder,
        m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        *_scale_strides(scale_inv_a, block_a), *_scale_strides(scale_inv_b, block_b),
        *strides(other), *strides(residual), *strides(aux),
    )  # fmt: skip
    if device.type == "cuda":
        kernel = _autotuned(arch_of(torch.cuda.get_device_capability(device)), variant)
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        kernel[grid](*args, **variant.constexprs())
    else:
        c = configs_for_interpreter(variant)
        grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
        fp8_gemm_kernel[grid](*args, **variant.constexprs(), **c.constexprs(), num_warps=c.num_warps, num_stages=c.num_stages)
    return out, aux, amax


def configs_for_interpreter(variant: GemmVariant) -> TileConfig:
    c = INTERPRETER_CONFIG
    return replace(c, block_k=math.gcd(c.block_k, variant.k_block)) if variant.k_block else c


def _launch_quantize(x: Tensor, out: Tensor, scale: Tensor, amax: Tensor, variant: QuantizeVariant) -> None:
    """One `quantize_kernel` launch over 2-D `x` (scales per block, or one shared: strides 0)."""
    b0, b1, tile_r, tile_c = variant.blocking()
    (r, c), block = x.shape, variant.block
    scale_strides = (scale.stride(0), scale.stride(1)) if block else (0, 0)
    grid = (triton.cdiv(r, b0) if b0 else 1, triton.cdiv(c, b1) if b1 else 1)
    quantize_kernel[grid](
        x, out, scale, amax, r, c, x.stride(0), x.stride(1), out.stride(0), out.stride(1), *scale_strides,
        ROW_BLOCK=b0, COL_BLOCK=b1, TILE_R=tile_r, TILE_C=tile_c, **variant.constexprs(),
    )  # fmt: skip


def _empty_fp8(rows: int, cols: int, dtype: torch.dtype, device: torch.device, transpose: bool) -> Tensor:
    """[rows, cols] FP8 output, row-major or (transpose) column-major."""
    return torch.empty((cols, rows), dtype=dtype, device=device).t() if transpose else torch.empty((rows, cols), dtype=dtype, device=device)


def quantize(
    x: Tensor,
    dtype: torch.dtype,
    block: tuple = (),
    *,
    margin: int = 0,
    power_of_two: bool = False,
    amax: Tensor | None = None,
    transpose: bool = False,
) -> tuple[Tensor, Tensor]:
    """Saturating FP8 quantization of a 2-D tensor: (x_fp8, scale), `fp8fx.scaling`'s convention.

    `block` as in fp8fx.scaling. A tensorwise `amax` computed elsewhere (a GEMM epilogue's) skips
    the amax pass. `transpose=True` returns the same values laid out column-major."""
    fp8_format_of(dtype)
    block = tuple(block)
    device = _check_device(dict(x=x, amax=amax))
    if x.dim() != 2:
        raise ValueError(f"fp8fx quantize: needs a 2-D tensor, got shape {tuple(x.shape)}")
    if amax is not None and (block or amax.numel() != 1):
        raise ValueError("fp8fx quantize: a given amax is tensorwise only (one value, block ())")
    if block and (len(block) != 2 or any(b < 0 for b in block)):
        raise ValueError(f"fp8fx quantize: block must be () or (rows, cols), got {block}")
    variant = QuantizeVariant(x.dtype, dtype, block, margin, power_of_two, amax_given=not block)  # tensorwise: amax first
    r, c = x.shape
    out = _empty_fp8(r, c, dtype, device, transpose)
    scale = torch.empty(scale_shape(x.shape, block), dtype=torch.float32, device=device)
    if not block and amax is None:  # tensorwise: amax over the whole tensor first
        amax = torch.zeros((), dtype=torch.float32, device=device)
        _, _, tile_r, tile_c = variant.blocking()
        amax_kernel[(triton.cdiv(r, tile_r), triton.cdiv(c, tile_c))](x, amax, r, c, x.stride(0), x.stride(1), TILE_R=tile_r, TILE_C=tile_c)
    _launch_quantize(x, out, scale, amax.reshape(()) if amax is not None else scale, variant)
    return out, scale


def cast(x: Tensor, scale: Tensor, dtype: torch.dtype, block: tuple = (), *, transpose: bool = False) -> Tensor:
    """Saturating cast of `x * scale` to FP8 with scales computed beforehand (`fp8fx::cast`).

    Tensorwise and row-blocked casts of N-D tensors run on the 2-D view [rows, last dim]."""
    fp8_format_of(dtype)
    block = tuple(block)
    device = _check_device(dict(x=x, scale=scale))
    if x.dim() < 2 or (x.dim() > 2 and block and block[0] != 1):
        raise ValueError(f"fp8fx cast: needs a 2-D tensor (N-D only tensorwise or with row blocks of 1), got {tuple(x.shape)} with block {block}")
    x2 = x.reshape(-1, x.shape[-1])
    scale2 = scale.reshape(-1, scale.shape[-1]) if block else scale
    if tuple(scale2.shape) != tuple(scale_shape(x2.shape, block)) or scale.dtype != torch.float32:
        raise ValueError(f"fp8fx cast: scale must be fp32 of shape {tuple(scale_shape(x.shape, block))}, got {scale.dtype} {tuple(scale.shape)}")
    out = _empty_fp8(*x2.shape, dtype, device, transpose)
    _launch_quantize(x2, out, scale2, scale2, QuantizeVariant(x.dtype, dtype, block, scale_given=True))
    return out if transpose else out.reshape(x.shape)
