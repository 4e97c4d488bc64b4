"""The NVFP4 GEMM kernel: FP4 (E2M1) operands with one E4M3 scale per 16 elements of K, on
Blackwell's block-scaled FP4 tensor cores (`tcgen05.mma ... kind::mxf4nvf4.block_scale.block16`).

`tl.dot_scaled` multiplies each 16-wide K block by its two E4M3 scales inside the MMA; the two
per-tensor fp32 scales multiply the accumulator once at the end. Operands are packed two codes per
byte along K (`fp8fx.core.fp4.pack_e2m1`), B given as [N, K / 2] (K-contiguous). The launcher is
`fp8fx.codegen.launch.nvfp4_gemm`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp8fx.codegen.triton_kernels import tile_position


@triton.jit
def nvfp4_gemm_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    scale_a_ptr,
    scale_b_ptr,
    tensor_scale_a_ptr,
    tensor_scale_b_ptr,
    M,
    N,
    K_BYTES,
    K_SCALES,
    M_BUCKET,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_om,
    stride_on,
    stride_sa_m,
    stride_sa_k,
    stride_sb_n,
    stride_sb_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One output tile per program: out = (A * sa) @ (B * sb) * tensor_scale_a * tensor_scale_b.
    BLOCK_K counts FP4 elements (BLOCK_K / 2 bytes, BLOCK_K / 16 scales per row per step); K past
    K_BYTES loads zero codes. M_BUCKET is the autotuner's key only."""
    pid_m, pid_n = tile_position(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 16)
    # Rows / columns past the edge load a valid row (never stored): no M / N masks on the loads.
    rows, cols = offs_m % M, offs_n % N
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_kb[None, :] * stride_ak
    b_ptrs = b_ptr + offs_kb[:, None] * stride_bk + cols[None, :] * stride_bn
    sa_ptrs = scale_a_ptr + rows[:, None] * stride_sa_m + offs_ks[None, :] * stride_sa_k
    sb_ptrs = scale_b_ptr + cols[:, None] * stride_sb_n + offs_ks[None, :] * stride_sb_k
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_BYTES, BLOCK_K // 2):
        a = tl.load(a_ptrs, mask=offs_kb[None, :] < K_BYTES - k0, other=0)
        b = tl.load(b_ptrs, mask=offs_kb[:, None] < K_BYTES - k0, other=0)
        in_k = offs_ks[None, :] < K_SCALES - k0 // 8
        sa = tl.load(sa_ptrs, mask=in_k, other=0.0)
        sb = tl.load(sb_ptrs, mask=in_k, other=0.0)
        acc = tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1", acc)
        a_ptrs += (BLOCK_K // 2) * stride_ak
        b_ptrs += (BLOCK_K // 2) * stride_bk
        sa_ptrs += (BLOCK_K // 16) * stride_sa_k
        sb_ptrs += (BLOCK_K // 16) * stride_sb_k
    acc = acc * (tl.load(tensor_scale_a_ptr) * tl.load(tensor_scale_b_ptr))
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)
