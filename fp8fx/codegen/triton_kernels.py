"""The Triton kernels: one FP8 GEMM template with constexpr epilogue hooks, and the quantize kernels.

Every choice a variant makes is a `tl.constexpr`, so Triton compiles (and caches) one kernel per
epilogue signature and dead branches cost nothing. The GEMM epilogue runs in a fixed order, the
order of a transformer's elementwise chain after a matmul:

    acc = sum_k A_fp8 @ B_fp8                  (fp32 accumulation on FP8 tensor cores; FAST_ACCUM
                                                keeps Hopper's reduced-precision FP8 accumulator for
                                                the whole K loop, else each BLOCK_K is promoted)
    y   = acc * scale_inv_a * scale_inv_b      (per tensor / row / column / K-block)
    y   = y + bias                              HAS_BIAS
    aux = y                                     AUX_STAGE pre_activation (for backward)
    y   = act(y)                                ACTIVATION: relu, gelu, gelu_tanh, silu
    aux = y                                     AUX_STAGE activation
    y   = y * other   or   act(other) * y       MUL_MODE by_other / gated (silu(gate) * up)
    aux = y                                     AUX_STAGE product
    y   = y + residual                          HAS_RESIDUAL
    aux = y                                     AUX_STAGE sum
    amax(|y|) -> atomic max                     OUT_AMAX (producer amax for the next FP8 cast)
    out = y, or saturate(y * out_scale) in FP8  OUT_FP8

FP8 stores go through `_round_to_fp8_grid` first: the value is rounded (to nearest even, in fp32,
with explicit subnormals) onto the FP8 grid before the conversion, so the conversion itself is
exact on every backend, including Triton's interpreter whose FP8 downcast does not round.

Row and column offsets are 64-bit wherever they meet a stride: a tensor of 2**31 elements or more
(a weight-gradient operand of 28672 x 81920) would wrap in 32-bit arithmetic. The epilogue is one
`@triton.jit` function shared by every GEMM kernel family (`fp8fx.codegen.tma_kernel` too).

The integer codes of activations, aux stages and product modes are `fp8fx.core.epilogue`'s, the
contract the graph passes and the reference ops share; `_activation` implements every activation
of its table (tests/codegen/interpreter/test_activations.py runs each one against the torch reference).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp8fx.codegen import versions
from fp8fx.core import recipes
from fp8fx.core.epilogue import ACTIVATIONS, AUX_STAGES, MUL_MODES

versions.patch_interpreter()  # Triton < 3.7's interpreter: run-time loop bounds under NumPy >= 2.4

_RELU = tl.constexpr(ACTIVATIONS["relu"].code)
_GELU = tl.constexpr(ACTIVATIONS["gelu"].code)
_GELU_TANH = tl.constexpr(ACTIVATIONS["gelu_tanh"].code)
_SILU = tl.constexpr(ACTIVATIONS["silu"].code)
_AUX_PRE_ACTIVATION = tl.constexpr(AUX_STAGES.index("pre_activation"))
_AUX_ACTIVATION = tl.constexpr(AUX_STAGES.index("activation"))
_AUX_PRODUCT = tl.constexpr(AUX_STAGES.index("product"))
_AUX_SUM = tl.constexpr(AUX_STAGES.index("sum"))
_MUL_NONE = tl.constexpr(MUL_MODES.index("none"))
_MUL_BY_OTHER = tl.constexpr(MUL_MODES.index("by_other"))
_SQRT_HALF = tl.constexpr(0.7071067811865476)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _round_to_fp8_grid(x, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """Round fp32 `x` (already clamped to the format's range) to the nearest FP8 value, ties to even."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXPONENT)  # subnormals share the min exponent's ulp
    ulp = ((exponent - MANTISSA_BITS + 127) << 23).to(tl.float32, bitcast=True)
    # Adding and subtracting 1.5 * 2**23 rounds to an integer, ties to even (|x / ulp| < 2**22).
    rounded = ((x / ulp + 12582912.0) - 12582912.0) * ulp
    # Keep the sign of values that round to zero (-0.0, as PyTorch's cast gives).
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _to_fp8(x, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """Saturating cast of fp32 to the FP8 grid (NaN stays NaN), still held in fp32."""
    clamped = tl.where(x != x, x, tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX))  # noqa: PLR0124 - x != x: NaN
    return _round_to_fp8_grid(clamped, MANTISSA_BITS, MIN_EXPONENT)


@triton.jit
def _abs_max(x):
    """max |x| over a tile, NaN if any element is NaN (tl.max alone drops NaN; an amax must not)."""
    has_nan = tl.sum((x != x).to(tl.int32)) > 0  # noqa: PLR0124 - x != x: NaN
    return tl.where(has_nan, float("nan"), tl.max(tl.abs(x)))


@triton.jit
def _activation(y, ACTIVATION: tl.constexpr):
    """`fp8fx.core.epilogue.ACTIVATIONS` by code ("none" and unknown codes: y unchanged)."""
    if ACTIVATION == _RELU:
        y = tl.maximum(y, 0.0)
    elif ACTIVATION == _GELU:
        y = 0.5 * y * (1.0 + tl.math.erf(y * _SQRT_HALF))
    elif ACTIVATION == _GELU_TANH:
        inner = _SQRT_2_OVER_PI * (y + 0.044715 * y * y * y)
        y = 0.5 * y * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))  # 1 + tanh(inner)
    elif ACTIVATION == _SILU:
        y = y / (1.0 + tl.exp(-y))
    return y


@triton.jit
def _scale_index(offs_rows, k0, ROW_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr):
    """Row and K index into a block-scale tensor; a block size of 0 means the whole dimension."""
    if ROW_BLOCK == 0:
        rows = offs_rows * 0
    else:
        rows = offs_rows // ROW_BLOCK
    if K_BLOCK == 0:
        k = 0
    else:
        k = k0 // K_BLOCK
    return rows, k


@triton.jit
def dot_accumulate(a, b, acc, FAST_ACCUM: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += a @ b. Without FAST_ACCUM, Hopper promotes the FP8 partial sums to fp32 every
    BLOCK_K (TransformerEngine's split accumulator; other GPUs accumulate in fp32 anyway)."""
    if FAST_ACCUM:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)


@triton.jit
def apply_scales(
    acc,
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    scale_a_ptr,
    scale_b_ptr,
    stride_sa_row,
    stride_sb_col,
    A_ROW_BLOCK: tl.constexpr,
    B_COL_BLOCK: tl.constexpr,
):
    """Dequantize a tile whose scales are constant along K: per tensor, row (of A) or column (of B)."""
    rows_a, _ka = _scale_index(offs_m, 0, A_ROW_BLOCK, 0)
    cols_b, _kb = _scale_index(offs_n, 0, B_COL_BLOCK, 0)
    sa = tl.load(scale_a_ptr + rows_a * stride_sa_row, mask=mask_m, other=1.0)
    sb = tl.load(scale_b_ptr + cols_b * stride_sb_col, mask=mask_n, other=1.0)
    return acc * sa[:, None] * sb[None, :]


@triton.jit
def epilogue_store(
    y,
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    out_ptr,
    bias_ptr,
    other_ptr,
    residual_ptr,
    aux_ptr,
    out_scale_ptr,
    amax_ptr,
    stride_om,
    stride_on,
    stride_xm,
    stride_xn,
    stride_rm,
    stride_rn,
    stride_aux_m,
    stride_aux_n,
    HAS_BIAS: tl.constexpr,
    AUX_STAGE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    MUL_MODE: tl.constexpr,
    MUL_ACTIVATION: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    OUT_AMAX: tl.constexpr,
    OUT_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
):
    """The fused epilogue on a dequantized fp32 tile `y` (rows `offs_m`, columns `offs_n`, int64),
    in the fixed order of the module docstring; stores `out` (and `aux`), atomically maxes `amax`."""
    mask = mask_m[:, None] & mask_n[None, :]
    rows = offs_m[:, None]
    cols = offs_n[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if AUX_STAGE == _AUX_PRE_ACTIVATION:
        tl.store(aux_ptr + rows * stride_aux_m + cols * stride_aux_n, y.to(aux_ptr.dtype.element_ty), mask=mask)
    y = _activation(y, ACTIVATION)
    if AUX_STAGE == _AUX_ACTIVATION:
        tl.store(aux_ptr + rows * stride_aux_m + cols * stride_aux_n, y.to(aux_ptr.dtype.element_ty), mask=mask)
    if MUL_MODE != _MUL_NONE:
        other = tl.load(other_ptr + rows * stride_xm + cols * stride_xn, mask=mask, other=0.0).to(tl.float32)
        if MUL_MODE == _MUL_BY_OTHER:
            y = y * other
        else:
            y = _activation(other, MUL_ACTIVATION) * y
    if AUX_STAGE == _AUX_PRODUCT:
        tl.store(aux_ptr + rows * stride_aux_m + cols * stride_aux_n, y.to(aux_ptr.dtype.element_ty), mask=mask)
    if HAS_RESIDUAL:
        y += tl.load(residual_ptr + rows * stride_rm + cols * stride_rn, mask=mask, other=0.0).to(tl.float32)
    if AUX_STAGE == _AUX_SUM:
        tl.store(aux_ptr + rows * stride_aux_m + cols * stride_aux_n, y.to(aux_ptr.dtype.element_ty), mask=mask)
    if OUT_AMAX:
        tl.atomic_max(amax_ptr, _abs_max(tl.where(mask, y, 0.0)))
    if OUT_FP8:
        y = _to_fp8(y * tl.load(out_scale_ptr), FP8_MAX, MANTISSA_BITS, MIN_EXPONENT)
    tl.store(out_ptr + rows * stride_om + cols * stride_on, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def finish_tile(
    acc,
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    out_ptr,
    scale_a_ptr,
    scale_b_ptr,
    bias_ptr,
    other_ptr,
    residual_ptr,
    aux_ptr,
    out_scale_ptr,
    amax_ptr,
    stride_om,
    stride_on,
    stride_sa_row,
    stride_sb_col,
    stride_xm,
    stride_xn,
    stride_rm,
    stride_rn,
    stride_aux_m,
    stride_aux_n,
    A_ROW_BLOCK: tl.constexpr,
    B_COL_BLOCK: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    AUX_STAGE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    MUL_MODE: tl.constexpr,
    MUL_ACTIVATION: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    OUT_AMAX: tl.constexpr,
    OUT_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
):
    """Dequantize (unless the K loop did: SCALED) and run the epilogue on a tile or a column slice of
    one, after the K loop (or split-K's reduction): every GEMM kernel ends here."""
    if not SCALED:
        acc = apply_scales(
            acc, offs_m, offs_n, mask_m, mask_n, scale_a_ptr, scale_b_ptr, stride_sa_row, stride_sb_col, A_ROW_BLOCK, B_COL_BLOCK
        )
    epilogue_store(
        acc,
        offs_m,
        offs_n,
        mask_m,
        mask_n,
        out_ptr,
        bias_ptr,
        other_ptr,
        residual_ptr,
        aux_ptr,
        out_scale_ptr,
        amax_ptr,
        stride_om,
        stride_on,
        stride_xm,
        stride_xn,
        stride_rm,
        stride_rn,
        stride_aux_m,
        stride_aux_n,
        HAS_BIAS,
        AUX_STAGE,
        ACTIVATION,
        MUL_MODE,
        MUL_ACTIVATION,
        HAS_RESIDUAL,
        OUT_AMAX,
        OUT_FP8,
        FP8_MAX,
        MANTISSA_BITS,
        MIN_EXPONENT,
    )


@triton.jit
def tile_position(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of linear tile index `tile`, in grouped order: GROUP_M row-tiles
    share their B columns in L2."""
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = tile // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group_size)
    pid_n = (tile % (GROUP_M * grid_n)) // group_size
    return pid_m, pid_n


MX_BLOCK = tl.constexpr(recipes.MX_BLOCK)  # one E8M0 scale per 32 elements along K


@triton.jit
def _e8m0(scale_inv):
    """The E8M0 code of a power-of-two fp32 scale inverse: its exponent field. 2**-127 (subnormal
    in fp32) has field 0, which is E8M0's 2**-127, and so has a flushed 0 (a block of zeros)."""
    return ((scale_inv.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)


@triton.jit
def _mx_dot(
    a,
    b,
    acc,
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    k0,
    K,
    scale_a_ptr,
    scale_b_ptr,
    stride_sa_row,
    stride_sa_k,
    stride_sb_k,
    stride_sb_col,
    BLOCK_K: tl.constexpr,
):
    """acc += (a * 2**ea) @ (b * 2**eb) on block-scaled tensor cores, the exponents per 1 x 32 (A)
    and 32 x 1 (B) block of this K window read from fp8fx's fp32 scale inverses (MX's are powers
    of two: exact). Blocks past M, N or K get 2**0 (their data is never stored, or zero)."""
    kb = k0 // MX_BLOCK + tl.arange(0, BLOCK_K // MX_BLOCK)
    in_k = kb < tl.cdiv(K, MX_BLOCK)
    sa = tl.load(
        scale_a_ptr + offs_m[:, None] * stride_sa_row + kb[None, :] * stride_sa_k, mask=mask_m[:, None] & in_k[None, :], other=1.0
    )
    sb = tl.load(
        scale_b_ptr + offs_n[:, None] * stride_sb_col + kb[None, :] * stride_sb_k, mask=mask_n[:, None] & in_k[None, :], other=1.0
    )
    return mx_dot(a, sa, b, sb, acc)


@triton.jit
def mx_dot(a, sa, b, sb, acc):
    """acc += (a * sa) @ (b * sb) on block-scaled tensor cores: a [M, K], b [K, N] FP8, sa [M, K / 32]
    and sb [N, K / 32] fp32 power-of-two scale inverses, handed over as their E8M0 codes."""
    A_FORMAT: tl.constexpr = "e5m2" if a.dtype == tl.float8e5 else "e4m3"
    B_FORMAT: tl.constexpr = "e5m2" if b.dtype == tl.float8e5 else "e4m3"
    return tl.dot_scaled(a, _e8m0(sa), A_FORMAT, b, _e8m0(sb), B_FORMAT, acc)


@triton.jit
def split_range(split, K, SPLIT_K, BLOCK_K: tl.constexpr):
    """[k_start, k_end) of split `split` of SPLIT_K: whole BLOCK_K windows, as even as they go (the
    last splits may be shorter, or empty: an empty one stores zeros). Boundaries on BLOCK_K windows
    keep every window inside one scale K-block (BLOCK_K divides it: `variants.configs_for`)."""
    windows = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_start = split * windows * BLOCK_K
    return k_start, tl.minimum(k_start + windows * BLOCK_K, K)


@triton.jit
def store_partial(acc, ws_ptr, split, offs_m, offs_n, mask_m, mask_n, M, stride_wm, stride_wn):
    """Split `split`'s fp32 partial tile into the workspace [SPLIT_K, M, N] (row stride stride_wm)."""
    base = ws_ptr + split.to(tl.int64) * M * stride_wm
    tl.store(base + offs_m[:, None] * stride_wm + offs_n[None, :] * stride_wn, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def fp8_gemm_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    scale_a_ptr,
    scale_b_ptr,
    bias_ptr,
    other_ptr,
    residual_ptr,
    aux_ptr,
    out_scale_ptr,
    amax_ptr,
    M,
    N,
    K,
    M_BUCKET,
    SPLIT_K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_om,
    stride_on,
    stride_sa_row,
    stride_sa_k,
    stride_sb_k,
    stride_sb_col,
    stride_xm,
    stride_xn,
    stride_rm,
    stride_rn,
    stride_aux_m,
    stride_aux_n,
    A_ROW_BLOCK: tl.constexpr,
    A_K_BLOCK: tl.constexpr,
    B_K_BLOCK: tl.constexpr,
    B_COL_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    AUX_STAGE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    MUL_MODE: tl.constexpr,
    MUL_ACTIVATION: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    OUT_AMAX: tl.constexpr,
    OUT_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_SCALED_MMA: tl.constexpr = False,
    PARTIAL: tl.constexpr = False,
):
    """One output tile per program, operands loaded through pointers (Ada, and the fallback).
    M_BUCKET is M rounded up to a power of two: the autotuner's key, not used here.
    BLOCK_SCALED_MMA (MX blocks only: 1 x 32 along K for A, 32 x 1 for B) hands the E8M0 scales
    to the tensor cores' block-scaled MMA (`tl.dot_scaled`) instead of promoting every 32 K.
    PARTIAL (split-K): program (tile, split) sums split `program_id(1)` of SPLIT_K ranges of whole
    BLOCK_K windows and stores it in fp32 to `out_ptr`, the workspace [SPLIT_K, M, N] (row stride
    stride_om), scaled only where scales vary along K; `split_k_reduce_kernel` does the rest."""
    pid_m, pid_n = tile_position(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if PARTIAL:
        k_start, k_end = split_range(tl.program_id(1), K, SPLIT_K, BLOCK_K)
    else:
        k_start = 0
        k_end = K
    # Rows / columns past the edge load a valid row instead (their results are never stored): the
    # loads then need no M / N mask, which keeps them pipelined.
    a_ptrs = a_ptr + (offs_m % M)[:, None] * stride_am + (k_start + offs_k)[None, :] * stride_ak
    b_ptrs = b_ptr + (k_start + offs_k)[:, None] * stride_bk + (offs_n % N)[None, :] * stride_bn

    # Scales along K (blockwise recipes) promote each K-block's partial product to the fp32
    # accumulator with its own scales; otherwise the scales are applied once after the loop.
    PER_K_SCALES: tl.constexpr = A_K_BLOCK != 0 or B_K_BLOCK != 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
        if BLOCK_SCALED_MMA:
            acc = _mx_dot(
                a,
                b,
                acc,
                offs_m,
                offs_n,
                mask_m,
                mask_n,
                k0,
                K,
                scale_a_ptr,
                scale_b_ptr,
                stride_sa_row,
                stride_sa_k,
                stride_sb_k,
                stride_sb_col,
                BLOCK_K,
            )
        elif PER_K_SCALES:
            rows_a, ka = _scale_index(offs_m, k0, A_ROW_BLOCK, A_K_BLOCK)
            cols_b, kb = _scale_index(offs_n, k0, B_COL_BLOCK, B_K_BLOCK)
            sa = tl.load(scale_a_ptr + rows_a * stride_sa_row + ka * stride_sa_k, mask=mask_m, other=1.0)
            sb = tl.load(scale_b_ptr + kb * stride_sb_k + cols_b * stride_sb_col, mask=mask_n, other=1.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        else:
            acc = dot_accumulate(a, b, acc, FAST_ACCUM, BLOCK_K)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if PARTIAL:
        store_partial(acc, out_ptr, tl.program_id(1), offs_m, offs_n, mask_m, mask_n, M, stride_om, stride_on)
    else:
        SCALED: tl.constexpr = PER_K_SCALES or BLOCK_SCALED_MMA  # (each K block was scaled in the loop)
        finish_tile(
            acc,
            offs_m,
            offs_n,
            mask_m,
            mask_n,
            out_ptr,
            scale_a_ptr,
            scale_b_ptr,
            bias_ptr,
            other_ptr,
            residual_ptr,
            aux_ptr,
            out_scale_ptr,
            amax_ptr,
            stride_om,
            stride_on,
            stride_sa_row,
            stride_sb_col,
            stride_xm,
            stride_xn,
            stride_rm,
            stride_rn,
            stride_aux_m,
            stride_aux_n,
            A_ROW_BLOCK,
            B_COL_BLOCK,
            SCALED,
            HAS_BIAS,
            AUX_STAGE,
            ACTIVATION,
            MUL_MODE,
            MUL_ACTIVATION,
            HAS_RESIDUAL,
            OUT_AMAX,
            OUT_FP8,
            FP8_MAX,
            MANTISSA_BITS,
            MIN_EXPONENT,
        )


@triton.jit
def split_k_reduce_kernel(
    ws_ptr,
    out_ptr,
    scale_a_ptr,
    scale_b_ptr,
    bias_ptr,
    other_ptr,
    residual_ptr,
    aux_ptr,
    out_scale_ptr,
    amax_ptr,
    M,
    N,
    SPLIT_K,
    stride_ws,
    stride_wm,
    stride_om,
    stride_on,
    stride_sa_row,
    stride_sb_col,
    stride_xm,
    stride_xn,
    stride_rm,
    stride_rn,
    stride_aux_m,
    stride_aux_n,
    A_ROW_BLOCK: tl.constexpr,
    A_K_BLOCK: tl.constexpr,
    B_K_BLOCK: tl.constexpr,
    B_COL_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    AUX_STAGE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    MUL_MODE: tl.constexpr,
    MUL_ACTIVATION: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    OUT_AMAX: tl.constexpr,
    OUT_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Split-K's second kernel: one program per BLOCK_M x BLOCK_N output tile adds the SPLIT_K fp32
    partial sums of the workspace [SPLIT_K, M, N] (strides stride_ws, stride_wm, 1) in split order,
    the same order every run, then dequantizes (unless each split did: scales along K) and runs the
    variant's epilogue once, as the GEMM kernels do after their K loop. FAST_ACCUM is the GEMM's."""
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // grid_n).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % grid_n).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask = mask_m[:, None] & mask_n[None, :]
    ws_ptrs = ws_ptr + offs_m[:, None] * stride_wm + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(SPLIT_K):
        acc += tl.load(ws_ptrs, mask=mask, other=0.0)
        ws_ptrs += stride_ws
    PER_K_SCALES: tl.constexpr = A_K_BLOCK != 0 or B_K_BLOCK != 0  # (each split scaled its K blocks)
    finish_tile(
        acc,
        offs_m,
        offs_n,
        mask_m,
        mask_n,
        out_ptr,
        scale_a_ptr,
        scale_b_ptr,
        bias_ptr,
        other_ptr,
        residual_ptr,
        aux_ptr,
        out_scale_ptr,
        amax_ptr,
        stride_om,
        stride_on,
        stride_sa_row,
        stride_sb_col,
        stride_xm,
        stride_xn,
        stride_rm,
        stride_rn,
        stride_aux_m,
        stride_aux_n,
        A_ROW_BLOCK,
        B_COL_BLOCK,
        PER_K_SCALES,
        HAS_BIAS,
        AUX_STAGE,
        ACTIVATION,
        MUL_MODE,
        MUL_ACTIVATION,
        HAS_RESIDUAL,
        OUT_AMAX,
        OUT_FP8,
        FP8_MAX,
        MANTISSA_BITS,
        MIN_EXPONENT,
    )


@triton.jit
def _block_ids(COLUMNS_FIRST: tl.constexpr):
    """(row block, column block) of this program. CUDA allows 2**31 - 1 programs along grid x but
    65535 along y: the launcher puts the longer side on x (COLUMNS_FIRST when there are more column blocks)."""
    if COLUMNS_FIRST:
        return tl.program_id(1).to(tl.int64), tl.program_id(0).to(tl.int64)
    else:
        return tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)


@triton.jit
def amax_kernel(
    x_ptr, amax_ptr, R, C, stride_xr, stride_xc, TILE_R: tl.constexpr, TILE_C: tl.constexpr, COLUMNS_FIRST: tl.constexpr
):
    """Tensorwise amax of a 2-D tensor (any strides): one atomic max per tile."""
    pid_r, pid_c = _block_ids(COLUMNS_FIRST)
    rr = pid_r * TILE_R + tl.arange(0, TILE_R)
    cc = pid_c * TILE_C + tl.arange(0, TILE_C)
    m = (rr[:, None] < R) & (cc[None, :] < C)
    x = tl.load(x_ptr + rr[:, None] * stride_xr + cc[None, :] * stride_xc, mask=m, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, _abs_max(x))


@triton.jit
def _amax_to_scale(amax, FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr, POWER_OF_TWO: tl.constexpr):
    """`fp8fx.core.scaling.amax_to_scale` in-kernel: fp64 division rounded once to fp32; 1 for 0 / inf / NaN."""
    usable = (amax > 0.0) & (amax < float("inf"))
    safe = tl.where(usable, amax, 1.0).to(tl.float64)
    scale = (FP8_MAX / MARGIN_FACTOR / safe).to(tl.float32)
    scale = tl.minimum(tl.maximum(scale, 1.1754943508222875e-38), 3.4028234663852886e38)  # finite, normal
    if POWER_OF_TWO:
        bits = scale.to(tl.int32, bitcast=True) & 0x7F800000  # drop the mantissa: round down to 2**e
        scale = bits.to(tl.float32, bitcast=True)
    return tl.where(usable, scale, 1.0)


@triton.jit
def _load_tile(x_ptr, rr, cc, r_end, c_end, stride_xr, stride_xc):
    """Rows `rr` x columns `cc` of x as fp32 (zeros past the block's end), with the mask."""
    m = (rr[:, None] < r_end) & (cc[None, :] < c_end)
    x = tl.load(x_ptr + rr[:, None] * stride_xr + cc[None, :] * stride_xc, mask=m, other=0.0).to(tl.float32)
    return x, rr, cc, m


@triton.jit
def _block_abs_max(x, BLOCKS_R: tl.constexpr, BLOCKS_C: tl.constexpr):
    """max |x| per scale block of a tile, [BLOCKS_R, BLOCKS_C]: a side of 1 is folded (the block spans the tile's
    rows or columns), a side of the tile's size is not (each row or column is a block). NaN where a block holds a
    NaN, as `_abs_max`."""
    a = tl.abs(x)
    nan = (x != x).to(tl.int32)  # noqa: PLR0124 - x != x: NaN
    if BLOCKS_R == 1:
        a = tl.max(a, axis=0, keep_dims=True)
        nan = tl.max(nan, axis=0, keep_dims=True)
    if BLOCKS_C == 1:
        a = tl.max(a, axis=1, keep_dims=True)
        nan = tl.max(nan, axis=1, keep_dims=True)
    return tl.where(nan > 0, float("nan"), a)


@triton.jit
def quantize_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    amax_ptr,
    R,
    C,
    stride_xr,
    stride_xc,
    stride_or,
    stride_oc,
    stride_sr,
    stride_sc,
    ROW_BLOCK: tl.constexpr,
    COL_BLOCK: tl.constexpr,
    AMAX_GIVEN: tl.constexpr,
    SCALE_GIVEN: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MARGIN_FACTOR: tl.constexpr,
    POWER_OF_TWO: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    BLOCKS_R: tl.constexpr,
    BLOCKS_C: tl.constexpr,
    COLUMNS_FIRST: tl.constexpr,
):
    """Saturating FP8 quantization of a 2-D tensor, one program per BLOCKS_R x BLOCKS_C scale blocks
    (or a cast with given scales, SCALE_GIVEN).

    A block is ROW_BLOCK x COL_BLOCK elements (0: the whole dimension). A program covers one block,
    or, where a block side is 1, a tile's worth of blocks (`QuantizeVariant.blocking`): BLOCKS_R =
    TILE_R rows each with its own scale(s), or BLOCKS_C = TILE_C columns, so that rowwise and
    per-column scales run no single-row or single-column programs. It walks its part in TILE_R x
    TILE_C tiles: pass 1 takes the blocks' amax (skipped when AMAX_GIVEN: a tensorwise amax computed
    beforehand by `amax_kernel` or by the producing GEMM's epilogue), pass 2 casts and stores; the
    output strides may transpose (the column-major copies backward GEMMs want). Each program
    stores its blocks' scales; a tensorwise quantization runs many programs over one given amax,
    all storing the same scale (scale strides 0)."""
    pid_r, pid_c = _block_ids(COLUMNS_FIRST)
    r_start = pid_r * (BLOCKS_R * ROW_BLOCK)
    c_start = pid_c * (BLOCKS_C * COL_BLOCK)
    r_end = R if ROW_BLOCK == 0 else tl.minimum(r_start + BLOCKS_R * ROW_BLOCK, R)
    c_end = C if COL_BLOCK == 0 else tl.minimum(c_start + BLOCKS_C * COL_BLOCK, C)
    offs_r = tl.arange(0, TILE_R)
    offs_c = tl.arange(0, TILE_C)
    # This program's [BLOCKS_R, BLOCKS_C] scales. Only per-row (per-column) ones can lie past the edge; masking
    # by R and C suits every block, whose index never exceeds its first row's (column's).
    s_r = pid_r * BLOCKS_R + tl.arange(0, BLOCKS_R)[:, None]
    s_c = pid_c * BLOCKS_C + tl.arange(0, BLOCKS_C)[None, :]
    s_ptrs = scale_ptr + s_r * stride_sr + s_c * stride_sc
    s_mask = (s_r < R) & (s_c < C)
    if SCALE_GIVEN:  # cast only: the scales were computed beforehand (the graph's amax_to_scale, or state)
        scale = tl.load(s_ptrs, mask=s_mask, other=1.0)
    elif AMAX_GIVEN:
        scale = _amax_to_scale(tl.load(amax_ptr), FP8_MAX, MARGIN_FACTOR, POWER_OF_TWO)
    else:
        amax = tl.zeros([BLOCKS_R, BLOCKS_C], tl.float32)
        for r0 in range(r_start, r_end, TILE_R):
            for c0 in range(c_start, c_end, TILE_C):
                x, rr, cc, m = _load_tile(x_ptr, r0 + offs_r, c0 + offs_c, r_end, c_end, stride_xr, stride_xc)
                amax = tl.maximum(amax, _block_abs_max(x, BLOCKS_R, BLOCKS_C), propagate_nan=tl.PropagateNan.ALL)
        scale = _amax_to_scale(amax, FP8_MAX, MARGIN_FACTOR, POWER_OF_TWO)
    for r0 in range(r_start, r_end, TILE_R):
        for c0 in range(c_start, c_end, TILE_C):
            x, rr, cc, m = _load_tile(x_ptr, r0 + offs_r, c0 + offs_c, r_end, c_end, stride_xr, stride_xc)
            q = _to_fp8(x * scale, FP8_MAX, MANTISSA_BITS, MIN_EXPONENT)
            tl.store(out_ptr + rr[:, None] * stride_or + cc[None, :] * stride_oc, q.to(out_ptr.dtype.element_ty), mask=m)
    if not SCALE_GIVEN:
        tl.store(s_ptrs, scale, mask=s_mask)
