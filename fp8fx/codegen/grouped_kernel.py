"""The grouped FP8 GEMM of mixture-of-experts layers (`torch._scaled_grouped_mm`'s semantics).

Two forms, told apart by K_GROUPED:

    2D-3D (tokens x experts):  out[rows of g] = a[rows of g] @ b[g]        a [M, K], b [G, K, N]
    2D-2D (weight gradient):   out[g] = a[:, ks of g] @ b[ks of g, :]      a [M, K], b [K, N]

where group g's rows (2D-3D) or K-slice (2D-2D) run from offs[g - 1] (0 for g = 0) to offs[g];
rows past offs[-1] (2D-3D) are zero, as in fp8fx's emulation (torch leaves them unwritten).
Group sizes live on the device (a router decides them), so the host cannot count the tiles: the
kernel is persistent, each program walking the groups and taking every num_programs-th tile of
their concatenation. In 2D-3D a tile's rows stop at its group's end, in 2D-2D its K loop does;
groups and offsets need not be multiples of any tile size, and empty groups have no tiles (2D-3D)
or a zero product (2D-2D).

Scales are scale inverses. Constant along K (K_BLOCK = 0), they multiply the fp32 accumulator after
the K loop, and the launcher passes any granularity as (per-group, per-row / per-column) strides:
rowwise A is (0, 1) in 2D-3D, a per-group scalar (1, 0), a [G, M] tensor (M, 1); B likewise. In
blocks of K_BLOCK along K (MX's 32, blockwise's 128), each BLOCK_K window's product (BLOCK_K
divides K_BLOCK) is promoted to the accumulator times its rows' and columns' block scales: A's
[M, K / K_BLOCK], B's [G, K / K_BLOCK, N / B_COL_BLOCK] (2D-3D) or [K / K_BLOCK, N] (2D-2D, whose
groups then start and end at multiples of K_BLOCK: the graph pads them, `fp8fx::pad_groups`).
BLOCK_SCALED_MMA (MX's power-of-two scales, Blackwell) hands each window's E8M0 scales to the
block-scaled MMA (`tl.dot_scaled`) instead, BLOCK_K a multiple of K_BLOCK. The
accumulation (`dot_accumulate`, with Hopper's per-BLOCK_K promotion unless FAST_ACCUM) and the
tile order inside a group (`tile_position`) are the dense kernel's. Its launcher is
`fp8fx.codegen.launch.grouped_fp8_gemm`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp8fx.codegen.triton_kernels import dot_accumulate, mx_dot, tile_position


@triton.jit
def _partial_window(acc, a_rows, b_cols, k0, lo, hi, K, stride_ak, stride_bk, FAST_ACCUM: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += the product over the K indices of the aligned window k0 .. k0 + BLOCK_K that lie in
    [lo, hi). The loads take the whole window (masked at K only: aligned, vectorized) and what lies
    outside [lo, hi) is zeroed in registers: a mask per element would take a register each."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_rows + offs_k.to(tl.int64)[None, :] * stride_ak, mask=offs_k[None, :] < K, other=0.0)
    b = tl.load(b_cols + offs_k.to(tl.int64)[:, None] * stride_bk, mask=offs_k[:, None] < K, other=0.0)
    inside = (offs_k >= lo) & (offs_k < hi)
    a = tl.where(inside[None, :], a, tl.zeros_like(a))
    b = tl.where(inside[:, None], b, tl.zeros_like(b))
    return dot_accumulate(a, b, acc, FAST_ACCUM, BLOCK_K)


@triton.jit
def fp8_grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    scale_a_ptr,
    scale_b_ptr,
    offs_ptr,
    G,
    M,
    N,
    K,
    M_BUCKET,
    K_BUCKET,
    stride_am,
    stride_ak,
    stride_bg,
    stride_bk,
    stride_bn,
    stride_og,
    stride_om,
    stride_on,
    stride_sa_g,
    stride_sa_row,
    stride_sa_k,
    stride_sb_g,
    stride_sb_col,
    stride_sb_k,
    K_GROUPED: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    K_BLOCK: tl.constexpr,
    B_COL_BLOCK: tl.constexpr,
    BLOCK_SCALED_MMA: tl.constexpr,
):
    """Persistent over the groups' tiles. M is a's rows (all groups' in 2D-3D), K the contraction
    length (2D-3D) or a's columns (2D-2D). M_BUCKET and K_BUCKET are the autotuner's key only."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)  # the next tile this program computes, counted over all groups
    first = tile * 0  # the current group's first tile
    start = tile * 0  # the current group's first row (2D-3D) or K index (2D-2D)
    for g in range(G):
        # Offsets that decrease or pass the grouped dimension's end give empty or clipped groups.
        end = tl.minimum(tl.maximum(tl.load(offs_ptr + g), start), K if K_GROUPED else M)
        if K_GROUPED:
            rows, row0 = M, start * 0
        else:
            rows, row0 = end - start, start
        tiles = tl.cdiv(rows, BLOCK_M) * tiles_n
        while tile < first + tiles:
            pid_m, pid_n = tile_position(tile - first, rows, N, BLOCK_M, BLOCK_N, GROUP_M)
            local_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_m = row0.to(tl.int64) + local_m  # rows of a (and of out in 2D-3D)
            offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_m = local_m < rows
            mask_n = offs_n < N
            # Rows and columns past the edge load a valid one instead (never stored): the loads
            # then need a K mask only.
            load_m = tl.minimum(offs_m, row0.to(tl.int64) + rows - 1)
            a_rows = a_ptr + load_m[:, None] * stride_am
            b_cols = b_ptr + tl.cast(g, tl.int64) * stride_bg + (offs_n % N)[None, :] * stride_bn
            if K_GROUPED:
                # The K-slice's whole BLOCK_K-aligned windows run in the pipelined loop (aligned
                # loads); a partial window at either end runs once after it (`_partial_window`).
                k_lo = tl.cdiv(start, BLOCK_K) * BLOCK_K
                k_hi = tl.maximum((end // BLOCK_K) * BLOCK_K, k_lo)
            else:
                k_lo, k_hi = 0, K
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            offs_k = k_lo + tl.arange(0, BLOCK_K)
            a_ptrs = a_rows + offs_k.to(tl.int64)[None, :] * stride_ak
            b_ptrs = b_cols + offs_k.to(tl.int64)[:, None] * stride_bk
            if K_BLOCK != 0:  # scales per K block: each window's product promoted with its block's
                sa_ptrs = scale_a_ptr + load_m * stride_sa_row
                sb_ptrs = scale_b_ptr + tl.cast(g, tl.int64) * stride_sb_g + ((offs_n % N) // B_COL_BLOCK) * stride_sb_col
            for k0 in range(k_lo, k_hi, BLOCK_K):
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_hi, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_hi, other=0.0)
                if BLOCK_SCALED_MMA:  # MX on Blackwell: the E8M0 scales go to the block-scaled MMA
                    kbs = k0 // K_BLOCK + tl.arange(0, BLOCK_K // K_BLOCK)
                    in_k = (kbs < tl.cdiv(K, K_BLOCK))[None, :]
                    sa = tl.load(sa_ptrs[:, None] + kbs[None, :] * stride_sa_k, mask=in_k, other=1.0)
                    sb = tl.load(sb_ptrs[:, None] + kbs[None, :] * stride_sb_k, mask=in_k, other=1.0)
                    acc = mx_dot(a, sa, b, sb, acc)
                elif K_BLOCK != 0:
                    kb = k0 // K_BLOCK
                    sa = tl.load(sa_ptrs + kb * stride_sa_k)
                    sb = tl.load(sb_ptrs + kb * stride_sb_k)
                    acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
                else:
                    acc = dot_accumulate(a, b, acc, FAST_ACCUM, BLOCK_K)
                offs_k += BLOCK_K
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            if K_GROUPED and K_BLOCK == 0:  # (K-block scales: groups start and end on whole windows)
                if start < tl.minimum(k_lo, end):
                    acc = _partial_window(
                        acc, a_rows, b_cols, k_lo - BLOCK_K, start, end, K, stride_ak, stride_bk, FAST_ACCUM, BLOCK_K
                    )
                if k_hi < end:
                    acc = _partial_window(acc, a_rows, b_cols, k_hi, start, end, K, stride_ak, stride_bk, FAST_ACCUM, BLOCK_K)
            if K_BLOCK == 0:
                sa = tl.load(scale_a_ptr + g * stride_sa_g + offs_m * stride_sa_row, mask=mask_m, other=1.0)
                sb = tl.load(scale_b_ptr + g * stride_sb_g + offs_n * stride_sb_col, mask=mask_n, other=1.0)
                acc = acc * sa[:, None] * sb[None, :]
            y = acc
            out_ptrs = out_ptr + tl.cast(g, tl.int64) * stride_og + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
            tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
            tile += tl.num_programs(0)
        first += tiles
        start = end
    if not K_GROUPED:  # rows past the last group's end belong to none: zeros, as the emulation's
        rows = M - start
        while tile < first + tl.cdiv(rows, BLOCK_M) * tiles_n:
            pid_m, pid_n = tile_position(tile - first, rows, N, BLOCK_M, BLOCK_N, GROUP_M)
            local_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            out_ptrs = out_ptr + (start.to(tl.int64) + local_m)[:, None] * stride_om + offs_n[None, :] * stride_on
            zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptrs, zeros, mask=(local_m < rows)[:, None] & (offs_n < N)[None, :])
            tile += tl.num_programs(0)
