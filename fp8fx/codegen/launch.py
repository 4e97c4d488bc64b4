"""Launchers for the generated kernels: one path for every device.

A launch is the same code on a GPU and under Triton's interpreter (CPU tensors, tests and
debugging): lay the operands out as the kernels read them (K-contiguous rows, 16-byte aligned:
copied when not), check every argument, take the target's autotuner (built once per target, kernel
family and variant, the same way everywhere), compute a grid within CUDA's limits, launch. Only the
target differs: a GPU architecture, or "interpreter", whose config list holds one small tile so
its autotuner never benchmarks. The interpreter is chosen when Triton defines the kernels, so it
has to be switched on before fp8fx is imported: `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from torch import Tensor

from fp8fx.codegen.triton_kernels import amax_kernel, fp8_gemm_kernel, quantize_kernel, split_k_reduce_kernel
from fp8fx.codegen.variants import (
    GRID_LIMITS,
    GROUPED_BLOCK_SCALED_TARGETS,
    NVFP4_CONFIGS,
    SPLIT_K_REDUCE,
    GemmVariant,
    GroupedVariant,
    QuantizeVariant,
    TileConfig,
    configs_for,
    device_target,
    gemm_family,
    nvfp4_blocks,
    split_k,
)
from fp8fx.codegen.versions import interpreter_active
from fp8fx.core import fp4
from fp8fx.core.epilogue import PLAIN, Epilogue
from fp8fx.core.formats import fp8_format_of
from fp8fx.core.recipes import MX_BLOCK
from fp8fx.core.scaling import NVFP4_E4M3_MAX, scale_shape, storage_order

ALIGN = 16  # bytes: TMA descriptors need 16-byte aligned bases and row strides; vector loads like them too
INTERPRETER_SMS = 3  # "SMs" a persistent kernel spreads over under the interpreter (exercises its tile loop)


def _check_device(tensors: dict[str, Tensor | None]) -> torch.device:
    present = {k: t for k, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) != 1:
        raise ValueError(
            f"fp8fx kernel: arguments on different devices: {', '.join(f'{k}={t.device}' for k, t in present.items())}"
        )
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


def _check_scales(what: str, *scales: tuple[str, Tensor, Tensor, tuple]) -> None:
    """Each (name, scale inverses, operand, block): fp32, one per block of the operand."""
    for name, s, x, block in scales:
        expected = tuple(scale_shape(x.shape, block))
        if s.dtype != torch.float32 or tuple(s.shape) != expected:
            raise ValueError(f"{what}: {name} must be fp32 of shape {expected} for block {block}, got {s.dtype} {tuple(s.shape)}")


def _scale_strides(scale: Tensor, block: tuple) -> tuple[int, int]:
    return (0, 0) if not block else (scale.stride(-2), scale.stride(-1))


def rows_aligned(t: Tensor) -> Tensor:
    """`t` [rows, k] (or [G, rows, k]) with unit stride along k, rows 16-byte aligned and not
    overlapping, as FP8 tensor cores and TMA read an operand; a copy into such storage when `t` is
    not (a transposed, sliced, broadcast or odd-width operand: the weight gradient's K is the token
    count)."""
    *lead, rows, k = t.shape
    size = t.element_size()
    ok = t.stride(-1) == 1 and t.stride(-2) >= k and (t.stride(-2) * size) % ALIGN == 0 and t.data_ptr() % ALIGN == 0
    if lead:  # a stack of matrices: each one aligned, none overlapping the next
        ok = ok and t.stride(0) >= rows * t.stride(-2) and (t.stride(0) * size) % ALIGN == 0
    if ok:
        return t
    width = -(-k * size // ALIGN) * ALIGN // size
    out = torch.empty((*lead, rows, width), dtype=t.dtype, device=t.device)[..., :k]
    return out.copy_(t)


def m_bucket(m: int) -> int:
    """The autotuner's key for M: the next power of two (at least 16). Token counts vary from step to
    step; N and K are weight dimensions. Keying on M itself would re-benchmark every new sequence length."""
    return max(16, 1 << max(m - 1, 0).bit_length())


def gemm_grid(m: int, n: int, config: TileConfig, family: str, sms: int, splits: int = 1) -> tuple[int] | tuple[int, int]:
    """Programs of one launch: a program per output tile (pointer, mx; with split-K, `splits` of
    them along grid y), or at most one per SM looping over tiles, or over (split, tile) pairs
    (tma, persistent). Checked against CUDA's grid limits."""
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    programs = min(sms, tiles * splits) if family == "tma" else tiles
    if programs > GRID_LIMITS[0] or (family != "tma" and splits > GRID_LIMITS[1]):
        raise ValueError(
            f"fp8fx FP8 GEMM: {m} x {n} needs {programs} tiles of {config.block_m} x {config.block_n}"
            f"{f' in {splits} K splits' if splits > 1 else ''}, over CUDA's grid limits"
        )
    return (programs, splits) if family != "tma" and splits > 1 else (programs,)


def _kernel(family: str):
    """(kernel, config pre-hook): TMA descriptors take their block shape from the chosen config.
    The mx family is the pointer kernel with block-scaled MMAs (its configs set BLOCK_SCALED_MMA)."""
    if family in ("pointer", "mx"):
        return fp8_gemm_kernel, None
    from fp8fx.codegen.tma_kernel import fp8_gemm_tma_kernel, set_block_shapes

    return fp8_gemm_tma_kernel, set_block_shapes


def _triton_configs(configs, pre_hook=None) -> list:
    return [triton.Config(c.constexprs(), num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=pre_hook) for c in configs]


@functools.cache
def autotuner(target: str, family: str, variant: GemmVariant, partial: bool = False):
    """The autotuner of one variant on one target: over the target's configs for it, keyed on
    (M bucket, N, K, split count: `variants.split_k` reads M itself). The same construction serves
    GPUs and the interpreter. `partial`: split-K's partial-sum kernel (its own configs, PARTIAL set)."""
    kernel, pre_hook = _kernel(family)
    configs = _triton_configs(configs_for(target, variant, family, partial), pre_hook)
    if not configs:
        raise ValueError(f"fp8fx: no {family} tile config of {target} fits variant {variant.name}")
    return triton.autotune(configs=configs, key=["M_BUCKET", "N", "K", "SPLIT_K"])(kernel)


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


class GemmPlan(NamedTuple):
    """What one call signature of `fp8_gemm` launches, validated once: the variant, its constexprs,
    the kernel family and its autotuner, the SMs a persistent kernel spreads over, the target, and
    the tile `variants.split_k` counts output tiles in (the first config of split-K's partial sums)."""

    variant: GemmVariant
    constexprs: dict
    family: str
    kernel: object
    sms: int
    target: str
    split_tile: TileConfig


@functools.lru_cache(maxsize=1024)
def gemm_plan(
    variant_fields: tuple, device: torch.device, present: tuple[bool, bool, bool, bool], family: str | None, empty_k: bool
) -> GemmPlan:
    """The launch plan of the `GemmVariant(*variant_fields)` on `device`, with `present` (bias,
    other, residual, out_scale) tensors. Built once per signature: a training step calls each
    GEMM's kernel with the same one, so its checks and lookups are not paid per call. Raises naming
    what does not fit."""
    variant = GemmVariant(*variant_fields)
    epilogue, constexprs = variant.epilogue, variant.constexprs()
    wanted = (epilogue.bias, epilogue.mul != "none", epilogue.residual, constexprs["OUT_FP8"])
    for name, has, wants in zip(("bias", "other", "residual", "out_scale"), present, wanted):
        if wants != has:
            raise ValueError(f"fp8fx FP8 GEMM: epilogue {epilogue.spec() or 'plain'!r} {'needs' if wants else 'takes no'} {name}")
    target = device_target(device)
    family = family or gemm_family(target, variant)
    if family == "mx" and not variant.mx:
        raise ValueError(
            f"fp8fx FP8 GEMM: kernel family mx runs MX blocks (1, 32) x (32, 1) only, got {variant.block_a} x {variant.block_b}"
        )
    if empty_k:
        family = "pointer"  # nothing to load: a descriptor cannot describe an empty K
    split_tile = configs_for(target, variant, family, partial=True)[0]
    return GemmPlan(variant, constexprs, family, autotuner(target, family, variant), _multiprocessors(device), target, split_tile)


def fp8_gemm(
    a: Tensor,
    b: Tensor,
    scale_inv_a: Tensor,
    scale_inv_b: Tensor,
    *,
    block_a: tuple = (),
    block_b: tuple = (),
    epilogue: Epilogue = PLAIN,
    bias: Tensor | None = None,
    other: Tensor | None = None,
    residual: Tensor | None = None,
    out_scale: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    aux_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
    family: str | None = None,
    splits: int | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """`epilogue((a * scale_inv_a) @ (b * scale_inv_b))` with one generated kernel (two with split-K).

    a: [M, K] FP8, b: [K, N] FP8, any strides (operands that are not K-contiguous with aligned rows
    are copied first). `family` forces the kernel family ("pointer", "tma", or "mx" for MX blocks);
    by default `variants.gemm_family`'s. `splits` forces the number of K ranges (split-K: partial
    sums in an fp32 workspace, then `split_k_reduce_kernel` adds them in a fixed order and runs
    the scales and the epilogue); by default `variants.split_k`'s rule, 1 for most GEMMs.
    Returns (out, aux or None, amax or None)."""
    device = _check_device(
        {
            "a": a,
            "b": b,
            "scale_inv_a": scale_inv_a,
            "scale_inv_b": scale_inv_b,
            "bias": bias,
            "other": other,
            "residual": residual,
            "out_scale": out_scale,
        }
    )
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8fx FP8 GEMM: needs 2-D [M, K] @ [K, N], got {tuple(a.shape)} @ {tuple(b.shape)}")
    (m, k), n = a.shape, b.shape[1]
    block_a, block_b = tuple(block_a), tuple(block_b)
    _check_scales("fp8fx FP8 GEMM", ("scale_inv_a", scale_inv_a, a, block_a), ("scale_inv_b", scale_inv_b, b, block_b))
    present = (bias is not None, other is not None, residual is not None, out_scale is not None)
    plan = gemm_plan(
        (a.dtype, b.dtype, block_a, block_b, epilogue, out_dtype, aux_dtype, fast_accum), device, present, family, k == 0
    )
    for name, t, shape in (
        ("bias", bias, (n,)),
        ("other", other, (m, n)),
        ("residual", residual, (m, n)),
        ("out_scale", out_scale, ()),
    ):
        if t is not None:
            _check_shape(name, t, shape)
    scale_inv_a, scale_inv_b = scale_inv_a.contiguous(), scale_inv_b.contiguous()  # unit inner stride, as the kernels are built
    a, bt = rows_aligned(a), rows_aligned(b.t())
    bias = bias.contiguous() if bias is not None else None

    out = torch.empty((m, n), dtype=out_dtype, device=device)
    aux = torch.empty((m, n), dtype=aux_dtype, device=device) if epilogue.aux != "none" else None
    amax = torch.zeros((), dtype=torch.float32, device=device) if epilogue.out_amax else None
    if splits is None:
        splits = split_k(plan.target, m, n, k, plan.split_tile, plan.sms)
    elif not isinstance(splits, int) or splits < 1:
        raise ValueError(f"fp8fx FP8 GEMM: splits must be a positive int, got {splits!r}")
    if m == 0 or n == 0:
        return out, aux, amax
    placeholder = scale_inv_a  # pointer for absent tensors: never read (its constexpr branch is off)
    if k == 0:
        splits = 1

    def strides(t):
        return (t.stride(0), t.stride(1)) if t is not None else (0, 0)

    family = plan.family
    if family != "tma":
        operands = (a, bt.t())
    else:
        from fp8fx.codegen.tma_kernel import operand_descriptors

        operands = operand_descriptors(a, bt)
    pointers = (
        scale_inv_a,
        scale_inv_b,
        bias if bias is not None else placeholder,
        other if other is not None else placeholder,
        residual if residual is not None else placeholder,
        aux if aux is not None else placeholder,
        out_scale if out_scale is not None else placeholder,
        amax if amax is not None else placeholder,
    )
    scale_strides = (*_scale_strides(scale_inv_a, block_a), *_scale_strides(scale_inv_b, block_b))
    epilogue_strides = (*strides(other), *strides(residual), *strides(aux))

    def gemm_args(c: Tensor) -> tuple:  # the GEMM kernels' arguments, writing to `c` (out, or the workspace)
        sizes = (m, n, k, m_bucket(m), splits, *_operand_strides(a, bt, family))
        return (*operands, c, *pointers, *sizes, c.stride(-2), c.stride(-1), *scale_strides, *epilogue_strides)

    sms = plan.sms
    if splits == 1:
        plan.kernel[lambda meta: gemm_grid(m, n, _config_of(meta), family, sms)](*gemm_args(out), **plan.constexprs)
        return out, aux, amax
    # Split-K: the GEMM kernel writes each split's fp32 partial sums to the workspace in out's place,
    # then the reduction adds them in split order and runs the scales and the epilogue into `out`.
    workspace = torch.empty((splits, m, n), dtype=torch.float32, device=device)
    grid = lambda meta: gemm_grid(m, n, _config_of(meta), family, sms, splits)
    autotuner(plan.target, family, plan.variant, partial=True)[grid](*gemm_args(workspace), **plan.constexprs, PARTIAL=True)
    tile = SPLIT_K_REDUCE[plan.target]
    reduce_grid = gemm_grid(m, n, tile, "pointer", sms)
    split_k_reduce_kernel[reduce_grid](
        workspace,
        out,
        *pointers,
        m,
        n,
        splits,
        workspace.stride(0),
        workspace.stride(1),
        out.stride(0),
        out.stride(1),
        scale_strides[0],
        scale_strides[3],
        *epilogue_strides,
        **plan.constexprs,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        num_warps=tile.num_warps,
    )
    return out, aux, amax


def _config_of(meta: dict) -> TileConfig:
    return TileConfig(meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"], meta["GROUP_M"], 0, 0)


def _operand_strides(a: Tensor, bt: Tensor, family: str) -> tuple:
    # The pointer kernel reads b as [K, N] with strides (1, row stride of bt); the TMA kernel gets descriptors.
    return (a.stride(0), a.stride(1), bt.stride(1), bt.stride(0)) if family != "tma" else ()


@functools.cache
def nvfp4_autotuner(target: str):
    """The NVFP4 GEMM's autotuner on one target (Blackwell, or the interpreter), keyed as the FP8 GEMM's."""
    from fp8fx.codegen.nvfp4_kernel import nvfp4_gemm_kernel

    if target not in NVFP4_CONFIGS:
        raise RuntimeError(
            f"fp8fx: NVFP4 GEMMs run on Blackwell's FP4 tensor cores (sm_100a) only; this GPU is {target}. "
            "Use an FP8 recipe (tensorwise, rowwise, blockwise, mxfp8) here"
        )
    if target == "interpreter":
        _interpreter_reads_e4m3_scales()
    return triton.autotune(configs=_triton_configs(NVFP4_CONFIGS[target]), key=["M_BUCKET", "N", "K_BYTES"])(nvfp4_gemm_kernel)


def _interpreter_reads_e4m3_scales() -> None:
    """Triton 3.9's interpreter decodes every `dot_scaled` scale as E8M0 (MX's) whatever its type;
    Blackwell's NVFP4 MMA reads E4M3 scales. Make the interpreter decode E4M3-typed scales as E4M3
    (its other scales unchanged), so the NVFP4 kernel runs on CPU tensors as it does on a GPU."""
    import numpy as np
    from triton.runtime import interpreter

    decode = getattr(interpreter, "_dot_scaled_scale_to_f32", None)
    if decode is None:
        raise RuntimeError(
            "fp8fx: this Triton's interpreter has no dot_scaled scale decoder to extend; NVFP4 kernels cannot run under it"
        )
    if getattr(decode, "fp8fx_e4m3", False):
        return
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()

    def decode_e4m3_too(scale_handle, compute_type):
        if scale_handle.dtype == triton.language.float8e4nv:
            return values[scale_handle.data.view(np.uint8)]
        return decode(scale_handle, compute_type)

    decode_e4m3_too.fp8fx_e4m3 = True
    interpreter._dot_scaled_scale_to_f32 = decode_e4m3_too


def _nvfp4_scales(scale_inv: Tensor, block: tuple, lines: int, k_scales: int, per_row: bool) -> tuple[Tensor, Tensor]:
    """(E4M3 block scales [lines, k_scales], per-tensor fp32 scale) of one operand's fp32 NVFP4
    scale inverses (`fp8fx.core.scaling.nvfp4_scales`: tensor scale x E4M3 block scale). The
    largest block scale is E4M3's 448, so the tensor scale is the largest scale inverse / 448,
    and each block's quotient rounds back to its E4M3 scale exactly (2**-23 off it, E4M3 steps
    are 2**-3). Blocks of 16 lines are repeated per line; K blocks past the data are zero."""
    largest = scale_inv.amax() if scale_inv.numel() else scale_inv.new_zeros(())
    tensor_scale = torch.where(largest > 0, largest / NVFP4_E4M3_MAX, torch.ones_like(largest)).to(torch.float32)
    codes = (scale_inv / tensor_scale).to(torch.float8_e4m3fn)
    line_block = block[0] if per_row else block[1]
    codes = codes if per_row else codes.t()  # [lines / line_block, K blocks]
    if line_block != 1:
        codes = codes.view(torch.uint8).repeat_interleave(line_block, dim=0)[:lines].view(torch.float8_e4m3fn)
    codes = torch.nn.functional.pad(codes.view(torch.uint8), (0, k_scales - codes.shape[1])).view(torch.float8_e4m3fn)
    return codes.contiguous(), tensor_scale.reshape(1)


def nvfp4_gemm(
    a: Tensor,
    b: Tensor,
    scale_inv_a: Tensor,
    scale_inv_b: Tensor,
    *,
    block_a: tuple = (1, 16),
    block_b: tuple = (16, 16),
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """`(a * scale_inv_a) @ (b * scale_inv_b)` for NVFP4 operands, on FP4 tensor cores.

    a: [M, K], b: [K, N], E2M1 values in their E4M3 carrier (`fp8fx.core.fp4`), any strides;
    scale_inv_*: fp32 per block as `fp8fx::nvfp4_scale` makes them, blocks 1 x 16 or 16 x 16 (A),
    16 x 1 or 16 x 16 (B). Operands are packed to FP4 and the scales split into E4M3 block scales
    and a tensor scale here, then one kernel runs (Blackwell, or the interpreter on CPU)."""
    block_a, block_b = tuple(block_a), tuple(block_b)
    device = _check_device({"a": a, "b": b, "scale_inv_a": scale_inv_a, "scale_inv_b": scale_inv_b})
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8fx NVFP4 GEMM: needs 2-D [M, K] @ [K, N], got {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype != fp4.CARRIER or b.dtype != fp4.CARRIER:
        raise ValueError(f"fp8fx NVFP4 GEMM: operands must hold E2M1 values in {fp4.CARRIER}, got {a.dtype} and {b.dtype}")
    if not nvfp4_blocks(block_a, block_b):
        raise ValueError(
            f"fp8fx NVFP4 GEMM: blocks must be (1, 16) or (16, 16) for A and (16, 1) or (16, 16) for B, got {block_a} x {block_b}"
        )
    (m, k), n = a.shape, b.shape[1]
    _check_scales("fp8fx NVFP4 GEMM", ("scale_inv_a", scale_inv_a, a, block_a), ("scale_inv_b", scale_inv_b, b, block_b))
    kernel = nvfp4_autotuner(device_target(device))
    out = torch.empty((m, n), dtype=out_dtype, device=device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    packed_a, packed_bt = rows_aligned(fp4.pack_e2m1(a)), rows_aligned(fp4.pack_e2m1(b.t()))  # [M, K/2], [N, K/2]
    k_scales = packed_a.shape[1] // 8
    sa, tensor_a = _nvfp4_scales(scale_inv_a, block_a, m, k_scales, per_row=True)
    sb, tensor_b = _nvfp4_scales(scale_inv_b, block_b, n, k_scales, per_row=False)
    kernel[lambda meta: gemm_grid(m, n, _config_of(meta), "pointer", 0)](
        packed_a,
        packed_bt,
        out,
        sa,
        sb,
        tensor_a,
        tensor_b,
        m,
        n,
        packed_a.shape[1],
        k_scales,
        m_bucket(m),
        packed_a.stride(0),
        packed_a.stride(1),
        packed_bt.stride(0),
        packed_bt.stride(1),
        out.stride(0),
        out.stride(1),
        sa.stride(0),
        sa.stride(1),
        sb.stride(0),
        sb.stride(1),
    )
    return out


@functools.cache
def grouped_autotuner(target: str, variant: GroupedVariant):
    """The grouped GEMM's autotuner on one target, keyed on the bucketed row and contraction
    lengths (one of them is the token count), N and the group count."""
    from fp8fx.codegen.grouped_kernel import fp8_grouped_gemm_kernel

    return triton.autotune(configs=_triton_configs(variant.configs(target)), key=["M_BUCKET", "N", "K_BUCKET", "G"])(
        fp8_grouped_gemm_kernel
    )


def _grouped_scale_strides(
    name: str, s: Tensor, groups: int, rows: int, rows_per_group: bool, per_group: bool
) -> tuple[int, int]:
    """(group stride, row stride) reading the contiguous scale inverses `s` of one operand: one per
    group ([G]), or one per row (column) of each group ([G, rows] or its flat [G * rows]:
    rows_per_group) or of all groups at once ([rows]). `per_group` decides a 1-D size both fit."""
    if s.dtype != torch.float32:
        raise ValueError(f"fp8fx grouped FP8 GEMM: {name} must be float32 scale inverses, got {s.dtype}")
    shape = tuple(s.shape)
    fits_rows = shape in ((groups, rows), (groups * rows,)) if rows_per_group else shape == (rows,)
    if shape == (groups,) and (per_group or not fits_rows):
        return 1, 0
    if fits_rows:
        return (rows, 1) if rows_per_group else (0, 1)
    wanted = f"({groups}, {rows}) or ({groups * rows},)" if rows_per_group else f"({rows},)"
    raise ValueError(f"fp8fx grouped FP8 GEMM: {name} must have shape ({groups},) (per group) or {wanted}, got {shape}")


def _k_block_scales(scale_a: Tensor, scale_b: Tensor, block_a: tuple, block_b: tuple, a: Tensor, b: Tensor):
    """(K block, B's column block, ((group, row, K-block) strides of A's scales, B's likewise)) of
    scales in blocks along K, checked against the operands' shapes."""
    k_block = block_a[1] if len(block_a) == 2 else 0
    ok = len(block_a) == 2 and block_a[0] == 1 and k_block > 1 and len(block_b) == 2 and block_b[0] == k_block
    b_cols = block_b[1] if ok else 0
    ok = ok and (b_cols == 1 or (b.dim() == 3 and b_cols == k_block))
    if not ok:
        raise ValueError(
            "fp8fx grouped FP8 GEMM: blocks along K are (1, kb) for a with (kb, 1) or, for a 3-D b, (kb, kb) for b; "
            f"got {block_a} x {block_b}"
        )
    _check_scales("fp8fx grouped FP8 GEMM", ("scale_a", scale_a, a, block_a), ("scale_b", scale_b, b, block_b))
    sb_group = scale_b.stride(0) if b.dim() == 3 else 0
    return k_block, b_cols, ((0, scale_a.stride(0), scale_a.stride(1)), (sb_group, scale_b.stride(-1), scale_b.stride(-2)))


def grouped_fp8_gemm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    fast_accum: bool = False,
    block_a: tuple = (),
    block_b: tuple = (),
    block_scaled: bool | None = None,
) -> Tensor:
    """`torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=out_dtype)` with one
    generated kernel; scales are scale inverses (x ~= x_fp8 * scale_inv), accumulation fp32.

    2D-3D: a [M, K], b [G, K, N], offs [G] int32 (cumulative row ends of a's groups) -> out
    [M, N]; scale_a [M] (rowwise) with scale_b [G, N], or per group scale_a [G] with scale_b [G].
    2D-2D: a [M, K], b [K, N], offs [G] (cumulative K ends) -> out [G, M, N]; scale_a [G, M] (or
    flat [G * M]) or [G], scale_b [G, N] (or [G * N]) or [G]. Rows of out past offs[-1] (2D-3D) are
    zero (torch leaves them unwritten); K past offs[-1] (2D-2D) is not read. Any operand layout (copied when
    tensor cores cannot read it).
    Scales in blocks along K instead: `block_a` (1, kb) with scale_a [M, K / kb], `block_b` (kb, 1)
    or (kb, kb) with scale_b [G, K / kb, N / cols] (2D-3D) or (kb, 1) with [K / kb, N] (2D-2D, whose
    group offsets must then be multiples of kb, as `fp8fx::pad_offsets` makes them). MX blocks
    (kb = 32, power-of-two scales) run on the block-scaled MMA where the target has it
    (`block_scaled` None), or as `block_scaled` says; other blocks promote each K window."""
    device = _check_device({"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b, "offs": offs})
    if offs.dtype != torch.int32 or offs.dim() != 1:
        raise ValueError(f"fp8fx grouped FP8 GEMM: offs must be a 1-D int32 tensor, got {offs.dtype} {tuple(offs.shape)}")
    if a.dim() != 2 or b.dim() not in (2, 3) or a.shape[1] != b.shape[-2]:
        raise ValueError(
            f"fp8fx grouped FP8 GEMM: needs a [M, K] with b [G, K, N] or [K, N], got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    k_grouped = b.dim() == 2
    (m, k), n, groups = a.shape, b.shape[-1], offs.shape[0]
    if not k_grouped and b.shape[0] != groups:
        raise ValueError(f"fp8fx grouped FP8 GEMM: b has {b.shape[0]} groups, offs {groups}")
    scale_a, scale_b = scale_a.contiguous(), scale_b.contiguous()
    if block_a or block_b:
        k_block, b_cols, (sa_strides, sb_strides) = _k_block_scales(scale_a, scale_b, tuple(block_a), tuple(block_b), a, b)
    else:
        k_block, b_cols = 0, 1
        sb_strides = _grouped_scale_strides("scale_b", scale_b, groups, n, True, True)
        # An [M] rowwise scale_a with as many rows as groups is read as scale_b is: per group or per row.
        sa_strides = _grouped_scale_strides("scale_a", scale_a, groups, m, k_grouped, sb_strides[1] == 0)
        sa_strides, sb_strides = (*sa_strides, 0), (*sb_strides, 0)
    target = device_target(device)
    mx = k_block == MX_BLOCK and b_cols == 1
    if block_scaled is None:
        block_scaled = mx and target in GROUPED_BLOCK_SCALED_TARGETS
    elif block_scaled and not mx:
        raise ValueError(
            f"fp8fx grouped FP8 GEMM: the block-scaled MMA takes MX blocks (1, 32) x (32, 1), got {block_a} x {block_b}"
        )
    variant = GroupedVariant(a.dtype, b.dtype, k_grouped, out_dtype, fast_accum, k_block, b_cols, block_scaled)
    a = rows_aligned(a)
    bt = rows_aligned(b.transpose(-2, -1))  # [G, N, K] or [N, K]: K-contiguous
    offs = offs.contiguous()
    out = torch.empty((groups, m, n) if k_grouped else (m, n), dtype=out_dtype, device=device)
    if out.numel() == 0 or groups == 0:
        return out
    sms = _multiprocessors(device)
    # 2D-3D: each group, and the rows past the last one, may end in a partial tile.
    row_tiles = (lambda bm: groups * triton.cdiv(m, bm)) if k_grouped else (lambda bm: triton.cdiv(m, bm) + groups + 1)

    def grid(meta):  # an upper bound on the tiles (the group sizes are on the device), at most one program per SM
        return (min(sms, row_tiles(meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])),)

    out_strides = (out.stride(0), out.stride(1), out.stride(2)) if k_grouped else (0, out.stride(0), out.stride(1))
    b_group_stride = 0 if k_grouped else bt.stride(0)
    kernel = grouped_autotuner(target, variant)
    kernel[grid](
        a,
        bt,
        out,
        scale_a,
        scale_b,
        offs,
        groups,
        m,
        n,
        k,
        m_bucket(m),
        m_bucket(k),
        a.stride(0),
        a.stride(1),
        b_group_stride,
        bt.stride(-1),
        bt.stride(-2),
        *out_strides,
        *sa_strides,
        *sb_strides,
        **variant.constexprs(),
    )
    return out


def _launch_quantize(x: Tensor, out: Tensor, scale: Tensor, amax: Tensor, variant: QuantizeVariant) -> None:
    """One `quantize_kernel` launch over 2-D `x` (scales per block, or one shared: strides 0)."""
    (r, c), block = x.shape, variant.block
    scale_strides = (scale.stride(0), scale.stride(1)) if block else (0, 0)
    grid, columns_first = block_grid(*variant.programs(r, c))
    quantize_kernel[grid](
        x,
        out,
        scale,
        amax,
        r,
        c,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        *scale_strides,
        COLUMNS_FIRST=columns_first,
        **variant.blocking(),
        **variant.constexprs(),
    )


def block_grid(row_programs: int, col_programs: int) -> tuple[tuple[int, int], bool]:
    """(grid, columns_first) for row_programs x col_programs programs (`QuantizeVariant.programs`, or
    the amax pass's tiles): the longer side on grid x (up to 2**31 - 1), the shorter on y (up to 65535),
    so a rowwise cast of 1M tokens or a per-column cast of a 256k vocabulary both fit."""
    columns_first = col_programs > row_programs
    grid = (col_programs, row_programs) if columns_first else (row_programs, col_programs)
    if grid[0] > GRID_LIMITS[0] or grid[1] > GRID_LIMITS[1]:
        raise ValueError(f"fp8fx quantize: {row_programs} x {col_programs} programs exceed CUDA's grid limits")
    return grid, columns_first


def _empty_fp8(rows: int, cols: int, dtype: torch.dtype, device: torch.device, transpose: bool) -> Tensor:
    """[rows, cols] FP8 output, row-major or (transpose) column-major."""
    return (
        torch.empty((cols, rows), dtype=dtype, device=device).t()
        if transpose
        else torch.empty((rows, cols), dtype=dtype, device=device)
    )


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
    """Saturating FP8 quantization of a 2-D tensor: (x_fp8, scale), `fp8fx.core.scaling`'s convention.

    `block` as in fp8fx.core.scaling. A tensorwise `amax` computed elsewhere (a GEMM epilogue's) skips
    the amax pass. `transpose=True` returns the same values laid out column-major."""
    fp8_format_of(dtype)
    block = tuple(block)
    device = _check_device({"x": x, "amax": amax})
    if x.dim() != 2:
        raise ValueError(f"fp8fx quantize: needs a 2-D tensor, got shape {tuple(x.shape)}")
    if amax is not None and (block or amax.numel() != 1):
        raise ValueError("fp8fx quantize: a given amax is tensorwise only (one value, block ())")
    if block and (len(block) != 2 or any(b < 0 for b in block)):
        raise ValueError(f"fp8fx quantize: block must be () or (rows, cols), got {block}")
    variant = QuantizeVariant(x.dtype, dtype, block, margin, power_of_two, amax_given=not block)  # tensorwise: amax first
    r, c = x.shape
    out = _empty_fp8(r, c, dtype, device, transpose)
    if x.numel() == 0:  # nothing to cast; each block's amax is 0, whose scale is 1 (no program would write it)
        return out, torch.ones(scale_shape(x.shape, block), dtype=torch.float32, device=device)
    scale = torch.empty(scale_shape(x.shape, block), dtype=torch.float32, device=device)
    if not block and amax is None:  # tensorwise: amax over the whole tensor first
        amax = torch.zeros((), dtype=torch.float32, device=device)
        blocking = variant.blocking()
        tile_r, tile_c = blocking["TILE_R"], blocking["TILE_C"]
        grid, columns_first = block_grid(triton.cdiv(r, tile_r), triton.cdiv(c, tile_c))
        amax_kernel[grid](x, amax, r, c, x.stride(0), x.stride(1), TILE_R=tile_r, TILE_C=tile_c, COLUMNS_FIRST=columns_first)
    _launch_quantize(x, out, scale, amax.reshape(()) if amax is not None else scale, variant)
    return out, scale


def cast(x: Tensor, scale: Tensor, dtype: torch.dtype, block: tuple = ()) -> Tensor:
    """Saturating cast of `x * scale` to FP8 with scales computed beforehand (`fp8fx::cast`).

    The result is laid out as `torch.empty_like(x)` (the op's fake): a transposed weight or a
    permuted attention output keeps its layout, as the graph around the op was traced with it.
    The kernel runs on a 2-D [rows, last dim] view of the input and the output; a tensorwise cast
    of a dense tensor takes both in memory order, and where no such view exists (row blocks of
    a permuted tensor) it casts a contiguous copy and lays the result out after."""
    fp8_format_of(dtype)
    block = tuple(block)
    _check_device({"x": x, "scale": scale})
    if x.dim() < 2 or (x.dim() > 2 and block and block[0] != 1):
        raise ValueError(
            f"fp8fx cast: needs a 2-D tensor (N-D only tensorwise or with row blocks of 1), got {tuple(x.shape)} "
            f"with block {block}"
        )
    if tuple(scale.shape) != tuple(scale_shape(x.shape, block)) or scale.dtype != torch.float32:
        raise ValueError(
            f"fp8fx cast: scale must be fp32 of shape {tuple(scale_shape(x.shape, block))}, got {scale.dtype} "
            f"{tuple(scale.shape)}"
        )
    out = torch.empty_like(x, dtype=dtype)
    if x.numel() == 0:  # (no rows to view it as, and nothing to cast)
        return out
    x_in, out_in = x, out
    if not block and out.stride() == x.stride():  # elementwise: any order of dims will do, memory's reads best
        order = storage_order(x)
        x_in, out_in = x.permute(order), out.permute(order)
    try:
        x2, out2 = x_in.view(-1, x_in.shape[-1]), out_in.view(-1, x_in.shape[-1])
    except RuntimeError:  # the leading dims do not flatten into rows of a view
        return out.copy_(cast(x.contiguous(), scale, dtype, block))
    scale2 = scale.reshape(-1, scale.shape[-1]) if block else scale
    _launch_quantize(x2, out2, scale2, scale2, QuantizeVariant(x.dtype, dtype, block, scale_given=True))
    return out
