"""The generated Triton kernels, run by Triton's interpreter on the CPU against the reference ops.

Runs only with TRITON_INTERPRET=1 set before import (tests/codegen/test_kernels.py starts it that way).
FP8 operands are made by torch, never by the interpreter's own FP8 conversion."""

from __future__ import annotations

import itertools
import os
import zlib

import pytest
import torch
from helpers import GatedBlock, sqnr

from fp8fx.codegen import launch
from fp8fx.core.epilogue import Epilogue
from fp8fx.core.scaling import amax_to_scale, block_amax, scale_shape
from fp8fx.ops import reference
from fp8fx.ops.args import Fp8GemmArgs

pytestmark = pytest.mark.skipif(not launch.interpreter_active(), reason="needs TRITON_INTERPRET=1 before import")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
QUANT_BLOCKS = [(), (1, 0), (0, 1), (1, 128), (128, 128), (128, 1)]


def wide_range(shape, seed):
    """Values over 12 binades, so both saturation-free rounding and FP8 subnormals are exercised."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-14, 4, shape, generator=g).float())


# Every block shape in both formats and both output layouts. FP8FX_QUANTIZE_CASES=blocks (.ci/compat,
# on an older Triton) keeps each block shape once, the formats and layouts alternating over them: a
# Triton version changes how a block shape's reductions and stores compile, not what a format is.
QUANTIZE_CASES = list(itertools.product((E4M3, E5M2), QUANT_BLOCKS, (False, True)))
if os.environ.get("FP8FX_QUANTIZE_CASES") == "blocks":
    _LAYOUTS = itertools.cycle(((E4M3, False), (E5M2, True), (E5M2, False), (E4M3, True)))
    QUANTIZE_CASES = [(dtype, block, transpose) for block, (dtype, transpose) in zip(QUANT_BLOCKS, _LAYOUTS)]


@pytest.mark.parametrize("dtype,block,transpose", QUANTIZE_CASES)
def test_quantize_is_bit_exact(dtype, block, transpose):
    x = wide_range((40, 144), seed=len(block) * 7 + transpose)
    q, scale = launch.quantize(x, dtype, block, transpose=transpose)
    ref_scale = amax_to_scale(block_amax(x, block), torch.finfo(dtype).max)
    ref = reference.cast(x, ref_scale, dtype, list(block))
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
    assert q.stride() == ((1, 40) if transpose else (144, 1))


@pytest.mark.parametrize("margin,power_of_two", [(0, True), (2, False), (1, True)])
def test_quantize_scale_options(margin, power_of_two):
    x = wide_range((64, 256), seed=3)
    for block in ((), (1, 128)):
        q, scale = launch.quantize(x, E4M3, block, margin=margin, power_of_two=power_of_two)
        ref_scale = amax_to_scale(block_amax(x, block), 448.0, margin, power_of_two)
        assert torch.equal(scale, ref_scale)
        assert torch.equal(q.view(torch.uint8), reference.cast(x, ref_scale, E4M3, list(block)).view(torch.uint8))


def test_quantize_clamps_scales_like_the_reference():
    """An amax near fp32's max with the largest margin: the kernel's scale is the reference's
    smallest normal fp32, not 0 (whose inverse would be inf)."""
    x = wide_range((32, 128), seed=4) * 1e33
    for block in ((), (1, 128)):
        q, scale = launch.quantize(x, E4M3, block, margin=32)
        ref_scale = amax_to_scale(block_amax(x, block), 448.0, 32)
        assert torch.equal(scale, ref_scale) and (scale > 0).all()


def test_quantize_given_amax_and_non_finite():
    x = wide_range((48, 128), seed=5)
    q, scale = launch.quantize(x, E4M3, amax=torch.tensor(2.0))
    assert scale.item() == 224.0
    assert q.float().abs().max().item() == 448.0  # values above the given amax saturate
    x[3, 7] = float("nan")
    for block in QUANT_BLOCKS:
        q, scale = launch.quantize(x, E4M3, block)
        ref_scale = amax_to_scale(block_amax(x, block), 448.0)
        # A NaN amax gives its block scale 1, as the reference, and leaves the program's other blocks theirs.
        assert torch.equal(scale, ref_scale) and (scale == 1).sum() == 1
        # (the NaN element itself is not checked: the interpreter's FP8 conversion loses NaN)


@pytest.mark.parametrize("shape", [(3, 5), (33, 130), (150, 257)], ids=str)
def test_quantize_and_cast_at_ragged_edges(shape):
    """Fewer rows or columns than a program's tile of blocks, partial last tiles and blocks."""
    x = wide_range(shape, seed=shape[1])
    for block, transpose in zip(QUANT_BLOCKS, itertools.cycle((False, True))):
        q, scale = launch.quantize(x, E5M2, block, transpose=transpose)
        ref_scale = amax_to_scale(block_amax(x, block), torch.finfo(E5M2).max)
        assert torch.equal(scale, ref_scale)
        assert torch.equal(q.view(torch.uint8), reference.cast(x, ref_scale, E5M2, list(block)).view(torch.uint8))
        given = ref_scale * 4  # some values saturate
        q = launch.cast(x, given, E4M3, block)
        assert torch.equal(q.view(torch.uint8), reference.cast(x, given, E4M3, list(block)).view(torch.uint8))


@pytest.mark.parametrize("shape", [(0, 64), (64, 0)], ids=str)
def test_quantize_and_cast_empty_tensors(shape):
    """An empty operand (a batch of no tokens): an empty FP8 tensor, and scales of the reference's
    shape (a whole empty dimension is one block) for an amax of 0, which is scale 1."""
    x = torch.randn(shape)
    for block in QUANT_BLOCKS:
        q, scale = launch.quantize(x, E4M3, block)
        ref_amax = block_amax(x, block)
        assert q.shape == x.shape and q.dtype == E4M3
        assert scale.shape == ref_amax.shape == scale_shape(shape, block) and (ref_amax == 0).all()
        assert torch.equal(scale, amax_to_scale(ref_amax, 448.0)) and (scale == 1).all()
        assert launch.cast(x, scale, E4M3, block).shape == x.shape


GEMM_BLOCKS = [((), ()), ((1, 0), (0, 1)), ((1, 128), (128, 128)), ((1, 128), (128, 1)), ((128, 128), (128, 1))]
EPILOGUES = [
    Epilogue(),
    Epilogue(bias=True, activation="gelu", aux="pre_activation"),
    Epilogue(activation="gelu_tanh", out_amax=True),
    Epilogue(activation="relu", aux="activation", residual=True),
    Epilogue(activation="silu", mul="by_other", aux="product"),
    Epilogue(mul="gated", mul_activation="silu", aux="pre_activation", out_amax=True),
    Epilogue(bias=True, residual=True, aux="sum", out_amax=True),
]


def fp8_operand(shape, dtype, block, seed, column_major=False):
    x = wide_range(shape, seed).clamp(-8, 8)
    scale = amax_to_scale(block_amax(x, block), torch.finfo(dtype).max)
    q = reference.cast(x, scale, dtype, list(block))
    if column_major:
        q = q.t().contiguous().t()
    return q, scale.reciprocal()


UNIT = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10, E4M3: 2**-3}


def close_as(out, ref):
    """Equal up to accumulation order: within one unit of the output format's last place, plus a
    small absolute term for cancellation (the kernel sums K in tiles, the reference in one GEMM)."""
    ref = ref.float()
    atol = 1e-5 * ref.abs().max().item() + (2**-9 if out.dtype == E4M3 else 0.0)
    torch.testing.assert_close(out.float(), ref, rtol=UNIT[out.dtype], atol=atol)


CASES = [
    (blocks, ep, out_dtype, formats)
    for (blocks, ep), out_dtype, formats in zip(
        itertools.product(GEMM_BLOCKS, EPILOGUES),
        itertools.cycle((torch.float32, torch.bfloat16, torch.float16, E4M3)),
        itertools.cycle(((E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2))),
    )
]


def run_both(blocks, epilogue, out_dtype, shape, formats, fast_accum, seed, family):
    """(the `family` kernel's (out, aux, amax), the reference's) for one generated GEMM case."""
    (m, n, k), (block_a, block_b) = shape, blocks
    a, sa = fp8_operand((m, k), formats[0], block_a, seed)
    b, sb = fp8_operand((k, n), formats[1], block_b, seed + 1, column_major=True)
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if epilogue.bias else None
    other = torch.randn(m, n, generator=g) if epilogue.mul != "none" else None
    residual = torch.randn(m, n, generator=g).to(torch.bfloat16) if epilogue.residual else None
    out_scale = torch.tensor(3.0) if out_dtype == E4M3 else None
    got = launch.fp8_gemm(
        a, b, sa, sb, block_a=block_a, block_b=block_b, epilogue=epilogue, bias=bias, other=other, residual=residual,
        out_scale=out_scale, out_dtype=out_dtype, aux_dtype=torch.float32, fast_accum=fast_accum, family=family,
    )  # fmt: skip
    ref = reference.fp8_gemm(
        Fp8GemmArgs(
            a,
            b,
            sa,
            sb,
            bias=bias,
            other=other,
            residual=residual,
            out_scale=out_scale,
            out_dtype=out_dtype,
            aux_dtype=torch.float32,
            block_a=list(block_a),
            block_b=list(block_b),
            epilogue=epilogue.spec(),
            gpu_kernel="scaled_mm",
            fast_accum=fast_accum,
        )
    )
    return got, ref


def case_seed(*parts) -> int:
    """A seed from a case's description, the same in every process (unlike hash())."""
    return zlib.crc32(repr(parts).encode()) % 1000


@pytest.mark.parametrize("blocks,epilogue,out_dtype,formats", CASES, ids=lambda v: getattr(v, "spec", lambda: str(v))() or "plain")
def test_gemm_variant_matches_reference(blocks, epilogue, out_dtype, formats):
    """The pointer kernel (Ada's, and the fallback); tests/codegen/interpreter/test_tma.py runs the TMA one."""
    shape = (40, 144, 256)  # partial tiles in M and N, two 128-K-blocks
    got, ref = run_both(blocks, epilogue, out_dtype, shape, formats, False, case_seed(blocks, epilogue.spec()), "pointer")
    assert_matches(epilogue, got, ref)


def assert_matches(epilogue: Epilogue, got: tuple, ref: tuple) -> None:
    """A launcher's (out, aux, amax) against the reference's: aux and amax present as the epilogue says."""
    (out, aux, amax), (ref_out, ref_aux, ref_amax) = got, ref
    close_as(out, ref_out)
    if epilogue.aux != "none":
        close_as(aux, ref_aux)
    else:
        assert aux is None
    if epilogue.out_amax:
        torch.testing.assert_close(amax, ref_amax, rtol=1e-6, atol=0)
    else:
        assert amax is None


def test_gemm_rejects_bad_arguments():
    a, sa = fp8_operand((32, 64), E4M3, (), 1)
    b, sb = fp8_operand((64, 32), E4M3, (), 2, column_major=True)
    with pytest.raises(ValueError, match="cannot|2-D"):
        launch.fp8_gemm(a, b[:32], sa, sb)
    with pytest.raises(ValueError, match="needs bias"):
        launch.fp8_gemm(a, b, sa, sb, epilogue=Epilogue(bias=True))
    with pytest.raises(ValueError, match="scale_inv_a must be fp32 of shape"):
        launch.fp8_gemm(a, b, sa.reshape(1, 1), sb, block_a=(1, 0))
    with pytest.raises(ValueError, match="two E5M2"):
        launch.fp8_gemm(a.to(torch.float32).to(E5M2), b.float().to(E5M2).t().contiguous().t(), sa, sb)


def test_a_call_signature_is_planned_once_and_each_call_still_checked():
    """The launcher validates a call signature (variant, device, tensors present, family) once
    (`launch.gemm_plan`); the checks that depend on each call's tensors still run on every call,
    and a signature that fails is not cached."""
    a, sa = fp8_operand((32, 64), E4M3, (), 1)
    b, sb = fp8_operand((64, 32), E4M3, (), 2, column_major=True)
    bias = torch.randn(32)
    launch.gemm_plan.cache_clear()
    first = launch.fp8_gemm(a, b, sa, sb, epilogue=Epilogue(bias=True), bias=bias)
    again = launch.fp8_gemm(a, b, sa, sb, epilogue=Epilogue(bias=True), bias=bias)
    info = launch.gemm_plan.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    torch.testing.assert_close(first[0], again[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"bias must have shape \(32,\)"):
        launch.fp8_gemm(a, b, sa, sb, epilogue=Epilogue(bias=True), bias=torch.randn(31))
    with pytest.raises(ValueError, match="scale_inv_b must be fp32"):
        launch.fp8_gemm(a, b, sa, sb.double(), epilogue=Epilogue(bias=True), bias=bias)
    for _ in range(2):
        with pytest.raises(ValueError, match="takes no bias"):
            launch.fp8_gemm(a, b, sa, sb, bias=bias)
    assert launch.gemm_plan.cache_info().currsize == 1


def test_backend_runs_the_kernels_it_reports():
    """kernels="triton" runs every fused FP8 GEMM of a training step in the generated kernels
    (transposed backward operands included); "auto" runs the generated kernel where the epilogue
    saves a memory pass and torch._scaled_mm elsewhere (here: the exact reference, as for
    "scaled_mm"); all three agree."""
    import copy

    import fp8fx

    torch.manual_seed(0)
    model = GatedBlock()
    x = torch.randn(2, 16, 64)
    results = {}
    for kernels in ("triton", "auto", "scaled_mm"):
        m = copy.deepcopy(model)
        backend = fp8fx.backend(inner="eager", kernels=kernels)
        xi = x.clone().requires_grad_()
        out = torch.compile(m, backend=backend)(xi)
        out.sum().backward()
        results[kernels] = [out, xi.grad, *(p.grad for p in m.parameters())]
        ops = fp8fx.report(backend).fp8_ops
        if kernels == "auto":
            saves = {op.site + op.role: bool(op.memory_passes_saved) for op in ops}
            assert {op.site + op.role: op.gpu_kernel == "triton" for op in ops} == saves
            assert 0 < sum(saves.values()) < len(ops)
        else:
            assert {op.gpu_kernel for op in ops} == {kernels}
        torch._dynamo.reset()
    # Not bit-equal: an fp32 rounding difference (summation order) can move a value across an FP8
    # rounding boundary when the next layer's input or an incoming gradient is cast.
    for kernels in ("triton", "auto"):
        for result, ref in zip(results[kernels], results["scaled_mm"]):
            assert sqnr(result, ref) >= 40  # measured: 52-100 dB


@pytest.mark.parametrize(
    "dtype,block",
    [(E4M3, ()), (E5M2, ()), (E4M3, (1, 0)), (E4M3, (1, 128)), (E5M2, (128, 128)), (E4M3, (0, 1)), (E5M2, (128, 1))],
)
def test_cast_with_given_scale_is_bit_exact(dtype, block):
    """fp8fx::cast's CUDA kernel: scales from the graph (amax_to_scale or delayed-scaling state)."""
    x = wide_range((40, 144), seed=11) * 3  # a scale below amax-derived: some values saturate
    scale = amax_to_scale(block_amax(x, block), torch.finfo(dtype).max) * 2
    q = launch.cast(x, scale, dtype, block)
    assert torch.equal(q.view(torch.uint8), reference.cast(x, scale, dtype, list(block)).view(torch.uint8))
    if not block:  # N-D tensors, tensorwise: as in the graph, where activations are [batch, seq, dim]
        x3 = x.reshape(4, 10, 144)
        assert torch.equal(launch.cast(x3, scale, dtype).view(torch.uint8), reference.cast(x3, scale, dtype, []).view(torch.uint8))
