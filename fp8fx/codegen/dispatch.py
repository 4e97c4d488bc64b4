"""CUDA kernels of the fp8fx ops. An `fp8fx::fp8_gemm` node runs the generated Triton kernel
(default) or PyTorch's `torch._scaled_mm` followed by the epilogue in plain torch
(`kernels="scaled_mm"`); `fp8fx::cast` runs the Triton cast kernel (one pass)."""

from __future__ import annotations

import torch
from torch import Tensor

from fp8fx.codegen.scaled_mm_cuda import scaled_mm_2d
from fp8fx.codegen.variants import Epilogue


def _k_major(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """FP8 tensor cores read both operands K-contiguous; other layouts get a transposed copy
    (a memory pass over the FP8 operand, counted in the report)."""
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(-2) != 1:
        b = b.t().contiguous().t()
    return a, b


def fp8_gemm_triton(a, b, scale_inv_a, scale_inv_b, bias, other, residual, out_scale, out_dtype, aux_dtype, block_a, block_b, ep: Epilogue):
    from fp8fx.codegen.launch import fp8_gemm

    a, b = _k_major(a, b)
    out, aux, amax = fp8_gemm(
        a, b, scale_inv_a, scale_inv_b, block_a=tuple(block_a), block_b=tuple(block_b), epilogue=ep, bias=bias, other=other,
        residual=residual, out_scale=out_scale, out_dtype=out_dtype, aux_dtype=aux_dtype,
    )  # fmt: skip
    # Absent outputs are fresh empty tensors (outputs of a custom op may not alias each other).
    aux = aux if aux is not None else out.new_empty(0, dtype=aux_dtype)
    return out, aux, amax if amax is not None else out.new_empty(0, dtype=torch.float32)


def fp8_gemm_cuda(a, b, scale_inv_a, scale_inv_b, bias, other, residual, out_scale, out_dtype, aux_dtype, block_a, block_b, epilogue, kernel):
    from fp8fx.ops import reference

    if kernel == "scaled_mm":  # cuBLASLt GEMM, then the epilogue as separate torch ops
        return reference.fp8_gemm_epilogue_after(
            scaled_mm_2d(a, b, scale_inv_a, scale_inv_b, torch.float32, block_a, block_b),
            bias, other, residual, out_scale, out_dtype, aux_dtype, Epilogue.parse(epilogue),
        )  # fmt: skip
    return fp8_gemm_triton(a, b, scale_inv_a, scale_inv_b, bias, other, residual, out_scale, out_dtype, aux_dtype, block_a, block_b, Epilogue.parse(epilogue))


def cast_cuda(x: Tensor, scale: Tensor, dtype: torch.dtype, block: list[int]) -> Tensor:
    from fp8fx.codegen.launch import cast
    from fp8fx.ops.reference import cast as reference_cast

    if x.dim() < 2 or (x.dim() > 2 and block and block[0] != 1):  # batched blocks (bmm operands): rare
        return reference_cast(x, scale, dtype, block)
    return cast(x, scale, dtype, tuple(block))
