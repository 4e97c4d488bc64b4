"""The persistent TMA FP8 GEMM (Hopper and Blackwell): operands through tensor descriptors.

At most one program per SM; each loops over output tiles in grouped order (`tile_position`),
loading A [M, K] and B^T [N, K] (both K-contiguous) tile by tile through TMA tensor descriptors,
which zero-fill reads past the tensor's edge: no masks on the operand loads, partial tiles in M, N
and K included. The tile loop can be warp specialized (WARP_SPECIALIZE: Triton splits loads, MMAs
and the epilogue into partitions that run concurrently; Blackwell only: Triton 3.9's Hopper pass
fails on this loop with 4 warps and leaves it as it is with 8) and flattened (FLATTEN: the tile
and K loops pipelined as one loop, what Hopper uses instead).

Accumulation, dequantization and the epilogue are the pointer kernel's (`triton_kernels`):
`dot_accumulate`, per-K-block promotion for blockwise scales, `apply_scales` and `epilogue_store`.
The epilogue stays pointer-based (masked stores: the output needs no alignment) and runs on
EPILOGUE_SUBTILE column slices of the accumulator one after the other, so the registers the
epilogue's own tiles take (bias, other, residual, aux) are those of one slice.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fp8fx.codegen.triton_kernels import dot_accumulate, finish_tile, split_range, store_partial, tile_position


@triton.jit
def _halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The left and right column halves of a [BLOCK_M, BLOCK_N] tile."""
    both = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
    return tl.split(both)


@triton.jit
def _k_block_scales(
    scale_ptr, start, k0, limit, stride_idx, stride_k, LEN: tl.constexpr, BLOCK: tl.constexpr, K_BLOCK: tl.constexpr
):
    """Scales of the LEN rows (of A) or columns (of B) from `start` (int64, a multiple of LEN) at
    K offset k0, as a [LEN] vector (1 past `limit`). A scale block covering the tile is one scalar
    load; blocks that tile it are addressed from the tile's first block, so the per-element part
    of the offset is the in-tile index (what stays live across the K loop is smaller)."""
    if K_BLOCK == 0:
        base = scale_ptr
    else:
        base = scale_ptr + (k0 // K_BLOCK).to(tl.int64) * stride_k
    j = tl.arange(0, LEN)
    if BLOCK == 0:
        s = tl.full([LEN], tl.load(base), tl.float32)
    elif BLOCK % LEN == 0:
        s = tl.full([LEN], tl.load(base + (start // BLOCK) * stride_idx), tl.float32)
    elif LEN % BLOCK == 0:
        first = base + (start // BLOCK) * stride_idx
        s = tl.load(first + (j // BLOCK).to(tl.int64) * stride_idx, mask=j < (limit - start).to(tl.int32), other=1.0)
    else:
        s = tl.load(base + ((start + j) // BLOCK) * stride_idx, mask=start + j < limit, other=1.0)
    return s


@triton.jit
def fp8_gemm_tma_kernel(
    a_desc,
    b_desc,
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
    EPILOGUE_SUBTILE: tl.constexpr = 1,
    WARP_SPECIALIZE: tl.constexpr = False,
    FLATTEN: tl.constexpr = False,
    PARTIAL: tl.constexpr = False,
):
    """Persistent: program p computes tiles p, p + programs, p + 2 * programs, ... M_BUCKET is the
    autotuner's key, not used here. EPILOGUE_SUBTILE is 1, 2 or 4 column slices.
    PARTIAL (split-K): the work units are (split, tile) pairs, split-major (units running together
    read the same K range), each storing its fp32 partial sum to `out_ptr`, the workspace
    [SPLIT_K, M, N] (row stride stride_om), as `triton_kernels.fp8_gemm_kernel` does."""
    tl.static_assert(EPILOGUE_SUBTILE == 1 or EPILOGUE_SUBTILE == 2 or EPILOGUE_SUBTILE == 4)
    PER_K_SCALES: tl.constexpr = A_K_BLOCK != 0 or B_K_BLOCK != 0
    SLICE_N: tl.constexpr = BLOCK_N // EPILOGUE_SUBTILE
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if PARTIAL:
        num_units = num_tiles * SPLIT_K
    else:
        num_units = num_tiles
    # The epilogue recomputes its tile from its own counter (as Triton's persistent matmul
    # tutorial does): no value then lives from the loads' prologue into the epilogue, which lets
    # the pipeliner and warp specialisation overlap one tile's epilogue with the next tile's loads.
    tile_c = tl.program_id(0) - tl.num_programs(0)
    for unit in tl.range(tl.program_id(0), num_units, tl.num_programs(0), flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        if PARTIAL:
            tile = unit % num_tiles
            k_start, k_end = split_range(unit // num_tiles, K, SPLIT_K, BLOCK_K)
            k_first = k_start // BLOCK_K
            k_last = tl.cdiv(k_end, BLOCK_K)
        else:
            tile = unit
            k_first = 0
            k_last = k_tiles
        pid_m, pid_n = tile_position(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        # TMA coordinates are 32-bit (rows and columns, not byte offsets); scale offsets are 64-bit.
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_first, k_last):
            k0 = ki * BLOCK_K
            a = a_desc.load([row0, k0])
            b = b_desc.load([col0, k0]).T
            if PER_K_SCALES:
                # Each K-block's partial product is promoted to fp32 with its own scales.
                sa = _k_block_scales(
                    scale_a_ptr, row0.to(tl.int64), k0, M, stride_sa_row, stride_sa_k, BLOCK_M, A_ROW_BLOCK, A_K_BLOCK
                )
                sb = _k_block_scales(
                    scale_b_ptr, col0.to(tl.int64), k0, N, stride_sb_col, stride_sb_k, BLOCK_N, B_COL_BLOCK, B_K_BLOCK
                )
                acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
            else:
                acc = dot_accumulate(a, b, acc, FAST_ACCUM, BLOCK_K)

        tile_c += tl.num_programs(0)
        if PARTIAL:
            split_c = tile_c // num_tiles
            pid_m_c, pid_n_c = tile_position(tile_c % num_tiles, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        else:
            split_c = 0
            pid_m_c, pid_n_c = tile_position(tile_c, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m_c = pid_m_c.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m_c = offs_m_c < M
        offs_n_c = pid_n_c.to(tl.int64) * BLOCK_N + tl.arange(0, SLICE_N)
        if EPILOGUE_SUBTILE == 1:
            slices = (acc,)
        elif EPILOGUE_SUBTILE == 2:
            slices = _halves(acc, BLOCK_M, BLOCK_N)
        else:
            left, right = _halves(acc, BLOCK_M, BLOCK_N)
            s0, s1 = _halves(left, BLOCK_M, BLOCK_N // 2)
            s2, s3 = _halves(right, BLOCK_M, BLOCK_N // 2)
            slices = (s0, s1, s2, s3)
        for s in tl.static_range(EPILOGUE_SUBTILE):
            offs_n_s = offs_n_c + s * SLICE_N
            if PARTIAL:
                store_partial(slices[s], out_ptr, split_c, offs_m_c, offs_n_s, mask_m_c, offs_n_s < N, M, stride_om, stride_on)
            else:
                finish_tile(
                    slices[s],
                    offs_m_c,
                    offs_n_s,
                    mask_m_c,
                    offs_n_s < N,
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


def set_block_shapes(nargs: dict) -> None:
    """Config pre-hook: the descriptors' block shapes are the chosen config's operand tiles."""
    nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


def operand_descriptors(a, bt) -> tuple[TensorDescriptor, TensorDescriptor]:
    """Host tensor descriptors of A [M, K] and B^T [N, K] (K-contiguous, 16-byte aligned rows, as
    `launch.rows_aligned` makes them). Their block shapes are placeholders until `set_block_shapes`
    runs for the config the autotuner picks; reads past the edges are zero-filled."""
    return descriptor(a), descriptor(bt)


def descriptor(t) -> TensorDescriptor:
    """`TensorDescriptor(t, shape, [row stride, 1], [16, 16])` without its constructor's per-call
    checks (rank, 16-byte aligned base and rows, unit inner stride), which `launch.rows_aligned`
    guarantees: they were half of a GEMM call's host work. The other fields are those of a
    descriptor built by the constructor, whatever this Triton's class holds."""
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(_checked_descriptor().__dict__, base=t, shape=list(t.shape), strides=[t.stride(0), 1], block_shape=[16, 16])
    return d


@functools.cache
def _checked_descriptor() -> TensorDescriptor:
    return TensorDescriptor(torch.empty(16, 16, dtype=torch.uint8), [16, 16], [16, 1], [16, 16])
