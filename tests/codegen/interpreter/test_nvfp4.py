"""NVFP4 GEMMs (E2M1 operands, E4M3 scales per 16 elements of K, a per-tensor fp32 scale) in the
kernel Blackwell runs them with (`tl.dot_scaled` on packed FP4), run by Triton's interpreter through
the same launcher, against the CPU emulation (`fp8fx.ops.reference.scaled_mm`, which adds every 16
of K exactly scaled in fp32); and a whole NVFP4 training step through the GPU dispatch.

Runs only with TRITON_INTERPRET=1 set before import (tests/codegen/test_kernels.py starts it that way)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import sqnr
from test_kernels import close_as, wide_range

from fp8fx.codegen import launch, versions
from fp8fx.core import fp4
from fp8fx.ops import library, nvfp4, reference

pytestmark = [
    pytest.mark.skipif(not launch.interpreter_active(), reason="needs TRITON_INTERPRET=1 before import"),
    pytest.mark.skipif(not versions.has("interpreter_e4m3_scales"), reason=versions.reason("interpreter_e4m3_scales")),
]

LEFT_BLOCKS, RIGHT_BLOCKS = ((1, 16), (16, 16)), ((16, 1), (16, 16))


def nvfp4_operand(shape, block, seed, zero_block=False):
    """An NVFP4 operand as the graph makes it: block amaxes -> two-level scales -> E2M1 cast, from
    values over 12 binades (and, with `zero_block`, one all-zero block: its E4M3 scale is the smallest)."""
    x = wide_range(shape, seed)
    if zero_block:
        x[: block[0], : block[1]] = 0.0
    scale, scale_inv = nvfp4.nvfp4_scale(library.amax(x, list(block)))
    return nvfp4.cast_nvfp4(x, scale, list(block), False), scale_inv


def _cases(count: int, seed: int) -> list:
    """Sampled (M, N, K, blocks, out dtype): M and N across partial tiles, K a multiple of 32 (the
    policy's NVFP4 alignment), of 16 only, and ending inside a 16-block."""
    rng = random.Random(seed)
    cases = [(40, 72, 128, (1, 16), (16, 16), torch.float32), (7, 33, 48, (16, 16), (16, 1), torch.bfloat16)]
    while len(cases) < count:
        k = rng.choice([32, 96, 160, 200, 256])
        cases.append(
            (
                rng.randint(1, 70),
                rng.randint(1, 70),
                k,
                rng.choice(LEFT_BLOCKS),
                rng.choice(RIGHT_BLOCKS),
                rng.choice((torch.float32, torch.bfloat16)),
            )
        )
    return cases


@pytest.mark.parametrize("m,n,k,block_a,block_b,out_dtype", _cases(8, seed=20), ids=str)
def test_nvfp4_gemm_matches_emulation(m, n, k, block_a, block_b, out_dtype):
    a, sa = nvfp4_operand((m, k), block_a, seed=m * 1000 + k, zero_block=m >= 16)
    b, sb = nvfp4_operand((k, n), block_b, seed=n * 1000 + k + 1)
    out = launch.nvfp4_gemm(a, b, sa, sb, block_a=block_a, block_b=block_b, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    close_as(out, reference.scaled_mm(a, b, sa, sb, None, torch.float32, list(block_a), list(block_b)))


def test_nvfp4_gemm_takes_transposed_operands_and_zeros():
    """A weight used transposed (a strided view) and an all-zero operand (tensor scale 1, smallest block scales)."""
    a, sa = nvfp4_operand((24, 64), (1, 16), seed=3)
    w, sw = nvfp4_operand((40, 64), (16, 16), seed=4)  # [N, K], used as w.t()
    out = launch.nvfp4_gemm(a, w.t(), sa, sw.t(), block_a=(1, 16), block_b=(16, 16), out_dtype=torch.float32)
    close_as(out, reference.scaled_mm(a, w.t(), sa, sw.t(), None, torch.float32, [1, 16], [16, 16]))
    z, sz = nvfp4_operand((24, 64), (1, 16), seed=5)
    z, sz = torch.zeros_like(z), nvfp4.nvfp4_scale(torch.zeros_like(sz))[1]
    assert torch.equal(
        launch.nvfp4_gemm(z, w.t(), sz, sw.t(), block_a=(1, 16), block_b=(16, 16)), torch.zeros(24, 40, dtype=torch.bfloat16)
    )


def test_scales_split_exactly_into_e4m3_block_scales_and_a_tensor_scale():
    """The kernel's E4M3 block scales times its tensor scale give back fp8fx's fp32 scale inverses
    to within fp32 rounding (the tensor scale is the largest inverse over 448: 2**-23 off TE's)."""
    x = wide_range((64, 160), 9)
    _, scale_inv = nvfp4.nvfp4_scale(library.amax(x, [1, 16]))
    codes, tensor_scale = launch._nvfp4_scales(scale_inv, (1, 16), 64, 10, per_row=True)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (64, 10) and codes.float().amax() == 448
    torch.testing.assert_close(codes.float() * tensor_scale, scale_inv, rtol=2**-22, atol=0)


def test_packing_puts_the_even_element_in_the_low_nibble():
    values = torch.tensor([[0.5, -6.0, 0.0, 3.0] + [0.0] * 28]).to(fp4.CARRIER)
    packed = fp4.pack_e2m1(values)
    assert packed.shape == (1, 16) and packed[0, :2].tolist() == [0x1 | (0xF << 4), 0x0 | (0x5 << 4)]


def test_launcher_rejects_other_operands():
    a, sa = nvfp4_operand((16, 32), (1, 16), seed=1)
    b, sb = nvfp4_operand((32, 16), (16, 16), seed=2)
    with pytest.raises(ValueError, match=r"operands must hold E2M1 values in torch.float8_e4m3fn"):
        launch.nvfp4_gemm(a.float(), b, sa, sb)
    with pytest.raises(ValueError, match=r"blocks must be \(1, 16\) or \(16, 16\) for A"):
        launch.nvfp4_gemm(a, b, sa, sb, block_a=(1, 32))
    with pytest.raises(ValueError, match=r"scale_inv_b must be fp32 of shape \(2, 1\)"):
        launch.nvfp4_gemm(a, b, sa, torch.ones(2, 16), block_b=(16, 16))


def test_nvfp4_training_step_runs_the_fp4_kernel(monkeypatch):
    """Recipe nvfp4 (stochastic rounding, random Hadamard transform), fwd + bwd with kernels="triton":
    every FP4 GEMM goes through the GPU dispatch to the NVFP4 kernel, and the step equals the same
    step on the exact emulation (measured 129-138 dB: only fp32 summation order differs; 60 dB leaves
    room for an FP4 value rounded the other way at the next cast)."""
    from test_shapes import kernel_and_emulated_steps

    launched = []
    real = launch.nvfp4_gemm

    def recorded(*args, **kwargs):
        launched.append(kwargs["block_a"] + kwargs["block_b"])
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "nvfp4_gemm", recorded)
    (kernel_grads, report), (emulated_grads, _) = kernel_and_emulated_steps("nvfp4", monkeypatch)
    assert len(report.fp8_ops) == 6 and all(op.gpu_kernel == "nvfp4" for op in report.fp8_ops)
    assert len(launched) == 6 and {(1, 16, 16, 16), (1, 16, 16, 1)} <= set(launched)  # weight and wgrad blocks
    for ours, ref in zip(kernel_grads, emulated_grads):
        assert sqnr(ours, ref) >= 60
