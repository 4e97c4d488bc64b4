"""The fp8fx::* operators: the scale convention, saturating casts, and the CPU emulation of FP8
GEMMs against an independent reference (dequantize, then an fp64 GEMM)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from fp8fx import ops
from fp8fx.codegen import versions
from fp8fx.core.formats import FormatRecipe, Fp8Format, saturating_cast
from fp8fx.ops.args import GEMM_ARGS, Fp8GemmArgs, ScaledMmArgs, gemm_args
from fp8fx.ops.cuda import scaled_mm_2d, scaled_mm_cuda

E4M3, E5M2 = Fp8Format.E4M3, Fp8Format.E5M2


def quantize(x: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:  # tensorwise
    scale = ops.amax_to_scale(ops.amax(x, []), fmt.max, 0, False)
    return ops.cast(x, scale, fmt.dtype, []), scale.reciprocal()


def test_formats():
    assert (E4M3.max, E5M2.max) == (448.0, 57344.0)
    assert FormatRecipe.HYBRID.operand_format("grad_output") is E5M2
    assert FormatRecipe.HYBRID.operand_format("weight") is E4M3
    assert FormatRecipe.E5M2.operand_format("input") is E5M2


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cast_saturates_instead_of_overflowing(fmt):
    x = torch.tensor([1e9, -1e9, float("inf"), 0.5, float("nan")])
    y = saturating_cast(x, fmt).float()
    assert y[:3].tolist() == [fmt.max, -fmt.max, fmt.max]
    assert y[3] == 0.5 and torch.isnan(y[4])


@pytest.mark.parametrize(
    "amax,expected",
    [(0.0, 1.0), (float("inf"), 1.0), (float("nan"), 1.0), (448.0, 1.0), (1.0, 448.0), (1e-44, torch.finfo(torch.float32).max)],
)
def test_amax_to_scale_is_never_zero_inf_or_nan(amax, expected):
    scale = ops.amax_to_scale(torch.tensor(amax), E4M3.max, 0, False)
    assert torch.isfinite(scale) and scale > 0
    assert scale.item() == pytest.approx(expected)


@pytest.mark.parametrize("amax,expected", [(1.0, 256.0), (448.0, 1.0), (449.0, 0.5), (1e-44, 2.0**127), (2.14e-42, 2.0**127)])
def test_power_of_two_scale_rounds_down_and_stays_finite(amax, expected):
    """A denormal amax (seen in rowwise gradients) once made log2/exp2 round up to an inf scale."""
    assert ops.amax_to_scale(torch.tensor(amax), E4M3.max, 0, True).item() == expected


def test_power_of_two_scales_over_the_whole_fp32_range():
    g = torch.Generator().manual_seed(0)
    amax = torch.exp(torch.empty(10_000).uniform_(-103.0, 88.0, generator=g))  # denormals up to near fp32 max
    exact = ops.amax_to_scale(amax, E4M3.max, 0, False)
    pow2 = ops.amax_to_scale(amax, E4M3.max, 0, True)
    assert torch.isfinite(pow2).all() and (pow2 <= exact).all() and (pow2 > exact / 2).all()
    assert torch.equal(torch.frexp(pow2).mantissa, torch.full_like(pow2, 0.5))  # exact powers of two


def test_margin_halves_the_scale_per_step():
    amax = torch.tensor(2.0)
    assert ops.amax_to_scale(amax, 448.0, 2, False).item() == pytest.approx(448.0 / 2 / 4)


def test_amax_propagates_nan_and_inf():
    assert torch.isnan(ops.amax(torch.tensor([1.0, float("nan")]), []))
    assert ops.amax(torch.tensor([-3.0, 2.0]), []).item() == 3.0


@pytest.mark.parametrize(
    "m,n,k,fa,fb,bias",
    [
        (m, n, k, fa, fb, bias)
        for (m, n, k), (fa, fb), bias in itertools.product(
            [(16, 16, 16), (33, 48, 80), (128, 64, 256), (1, 32, 16)],
            [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)],
            [False, True],
        )
    ],
)
def test_scaled_mm_matches_dequantize_then_fp64_gemm(m, n, k, fa, fb, bias):
    g = torch.Generator().manual_seed(m * n + k)
    a = torch.randn(m, k, generator=g) * 3
    b = torch.randn(k, n, generator=g) / 5
    c = torch.randn(n, generator=g) if bias else None
    a8, sa = quantize(a, fa)
    b8, sb = quantize(b, fb)
    out = ops.scaled_mm(a8, b8, sa, sb, c, torch.float32, [], [])
    ref = (a8.double() * sa.double()) @ (b8.double() * sb.double()) + (c.double() if bias else 0)
    # fp32 accumulation of k exact products: error bounded by k * eps32 * sum |a||b|.
    bound = k * torch.finfo(torch.float32).eps * ((a8.double().abs() * sa) @ (b8.double().abs() * sb)) + 1e-6
    assert ((out.double() - ref).abs() <= bound).all()


def test_scaled_bmm_and_out_dtype():
    a8, sa = quantize(torch.randn(3, 16, 32), E4M3)
    b8, sb = quantize(torch.randn(3, 32, 16), E4M3)
    out = ops.scaled_mm(a8, b8, sa, sb, None, torch.bfloat16, [], [])
    assert out.dtype == torch.bfloat16 and out.shape == (3, 16, 16)
    ref = torch.bmm(a8.double(), b8.double()) * sa.double() * sb.double()
    assert torch.allclose(out.double(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "a,b,message",
    [
        (torch.zeros(4, 4), torch.zeros(4, 4, dtype=torch.float8_e4m3fn), "float32 is not an FP8 dtype"),
        (torch.zeros(4, 8, dtype=torch.float8_e4m3fn), torch.zeros(4, 4, dtype=torch.float8_e4m3fn), "cannot be multiplied"),
        (torch.zeros(4, dtype=torch.float8_e4m3fn), torch.zeros(4, 4, dtype=torch.float8_e4m3fn), "must be 2-D or 3-D"),
    ],
)
def test_scaled_mm_rejects_bad_operands(a, b, message):
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match=message):
        ops.scaled_mm(a, b, one, one, None, torch.float32, [], [])


@pytest.mark.parametrize("m,k", [(16, 32), (20, 32), (7, 40), (33, 17)])
def test_cuda_launcher_pads_token_dims_and_matches_emulation(m, k):
    """The CUDA path's padding and layout logic, run through torch._scaled_mm's CPU kernel."""
    a8, sa = quantize(torch.randn(m, k), E4M3)
    b8, sb = quantize(torch.randn(k, 32), E4M3)
    out = scaled_mm_2d(a8, b8, sa, sb, torch.float32)
    assert out.shape == (m, 32)
    torch.testing.assert_close(out, ops.scaled_mm(a8, b8, sa, sb, None, torch.float32, [], []), rtol=1e-5, atol=1e-5)


def test_cuda_launcher_refuses_only_what_cublas_cannot_do():
    one = torch.tensor(1.0)
    e5 = torch.zeros(16, 16, dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="two E5M2 operands"):
        scaled_mm_2d(e5, e5, one, one, torch.float32)


@pytest.mark.parametrize("m,n,k", [(1, 8, 16), (7, 24, 14), (17, 5, 33), (16, 16, 16)])
@pytest.mark.parametrize("rowwise", [False, True])
def test_cuda_launcher_pads_any_shape(m, n, k, rowwise):
    """torch._scaled_mm (run here on the CPU) needs every dimension a multiple of 16: the launcher
    zero-pads M, N and K and slices the result, for tensorwise and rowwise scales."""
    if rowwise and not versions.cpu_rowwise_scaled_mm():
        pytest.skip("this torch's CPU torch._scaled_mm takes no rowwise scales (torch 2.13's does)")
    g = torch.Generator().manual_seed(m * n + k)
    block_a, block_b = ([1, 0], [0, 1]) if rowwise else ([], [])

    def blocked(x, block):
        scale = ops.amax_to_scale(ops.amax(x, block), 448.0, 0, False)
        return ops.cast(x, scale, torch.float8_e4m3fn, block), scale.reciprocal()

    a8, sa = blocked(torch.randn(m, k, generator=g), block_a)
    b8, sb = blocked(torch.randn(k, n, generator=g), block_b)
    out = scaled_mm_2d(a8, b8, sa, sb, torch.float32, block_a, block_b)
    ref = ops.scaled_mm(a8, b8, sa, sb, None, torch.float32, block_a, block_b)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-5)  # rowwise runs bf16 out, as on CUDA


def test_cuda_launcher_batched_with_bias():
    a8, sa = quantize(torch.randn(2, 16, 32), E4M3)
    b8, sb = quantize(torch.randn(2, 32, 16), E4M3)
    bias = torch.randn(16)
    out = scaled_mm_cuda(a8, b8, sa, sb, bias, torch.float32, [], [])
    torch.testing.assert_close(out, ops.scaled_mm(a8, b8, sa, sb, bias, torch.float32, [], []), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)), reason="needs an FP8 GPU (sm_89+)")
def test_scaled_mm_on_cuda_matches_cpu_emulation():
    a8, sa = quantize(torch.randn(64, 128), E4M3)
    b8, sb = quantize(torch.randn(128, 64), E4M3)
    cpu = ops.scaled_mm(a8, b8, sa, sb, None, torch.float32, [], [])
    gpu = ops.scaled_mm(a8.cuda(), b8.cuda(), sa.cuda(), sb.cuda(), None, torch.float32, [], [])
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-3, atol=1e-3)


def test_fake_implementations_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(8, 32)
        scale = ops.amax_to_scale(ops.amax(x, []), 448.0, 0, False)
        x8 = ops.cast(x, scale, torch.float8_e4m3fn, [])
        w8 = ops.cast(torch.empty(32, 16), scale, torch.float8_e4m3fn, [])
        out = ops.scaled_mm(x8, w8, scale, scale, None, torch.bfloat16, [], [])
    assert scale.shape == () and x8.dtype == torch.float8_e4m3fn
    assert out.shape == (8, 16) and out.dtype == torch.bfloat16


def test_scaled_mm_mixes_tensorwise_and_blockwise_operands():
    a = torch.randn(8, 256)
    b = torch.randn(256, 32)
    a8, sa = quantize(a, E4M3)
    sb = ops.amax_to_scale(ops.amax(b, [128, 128]), 448.0, 0, False)
    b8 = ops.cast(b, sb, torch.float8_e4m3fn, [128, 128])
    out = ops.scaled_mm(a8, b8, sa, sb.reciprocal(), None, torch.float32, [], [128, 128])
    ref = (a8.double() * sa.double()) @ (b8.double() / sb.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :32])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_scales_stay_finite_and_normal_for_any_amax_and_margin():
    """scale and 1 / scale are finite for every finite amax, the largest margin included (a zero
    or subnormal scale would turn every output into NaN or inf)."""
    from fp8fx.core.policy import MAX_MARGIN
    from fp8fx.core.scaling import amax_to_scale

    amax = torch.tensor([1e-45, 1e-30, 1.0, 1e30, torch.finfo(torch.float32).max])
    for margin in (0, MAX_MARGIN):
        for p2 in (False, True):
            scale = amax_to_scale(amax, 448.0, margin, p2)
            assert torch.isfinite(scale).all() and torch.isfinite(scale.reciprocal()).all()
            assert (scale >= torch.finfo(torch.float32).tiny).all()


@pytest.mark.parametrize("record", GEMM_ARGS, ids=lambda r: r.OP)
def test_gemm_arg_records_match_the_registered_schemas(record):
    """Each record's fields are its op's schema arguments, by name, in order and keyword-only alike:
    a schema change fails here rather than misread the arguments of graph nodes."""
    schema = record.op()._schema.arguments
    fields = dataclasses.fields(record)
    assert [f.name for f in fields] == [a.name for a in schema]
    # A positional schema argument may be a keyword-only field (built by name); never the reverse.
    assert all(f.kw_only for f, a in zip(fields, schema) if a.kwarg_only)


def test_gemm_args_read_and_write_nodes_by_name():
    """A node's arguments read alike whether given by position or keyword, or left to the schema's
    default; writing a changed record back keeps the node's spelling and changes only that value."""
    graph = torch.fx.Graph()
    a, b, sa, sb = (graph.placeholder(name) for name in ("a", "b", "sa", "sb"))
    mm = graph.call_function(torch.ops.fp8fx.scaled_mm.default, (a, b, sa, sb, None, torch.bfloat16), {"block_a": [], "block_b": [1]})
    args = ScaledMmArgs.of(mm)
    assert (args.a, args.scale_inv_b, args.out_dtype, args.block_b, args.fast_accum) == (a, sb, torch.bfloat16, [1], False)
    assert gemm_args(mm) == args and args.operands == (a, b)
    args.with_operand(1, a).write(mm)
    assert mm.args == (a, a, sa, sb, None, torch.bfloat16) and mm.kwargs == {"block_a": [], "block_b": [1]}
    built, kwargs = Fp8GemmArgs(a, b, sa, sb, out_dtype=torch.float32, aux_dtype=torch.float32, gpu_kernel="triton").call_args()
    assert len(built) == 13 and built[12] == "" and kwargs == {"gpu_kernel": "triton", "fast_accum": False}
    with pytest.raises(ValueError, match="no call of"):
        Fp8GemmArgs.of(mm)
    with pytest.raises(TypeError, match="missing argument 'out_dtype'"):
        ScaledMmArgs.bind((a, b, sa, sb, None))
