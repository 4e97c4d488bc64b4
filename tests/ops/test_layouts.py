"""Every fp8fx op's CPU implementation, and the CUDA implementations that run on CPU tensors
(`torch._scaled_mm`'s path; the generated kernels: tests/codegen/interpreter/test_op_layouts.py),
return exactly what the op's fake promises, for inputs laid out as graphs hand them over
(tests/layouts.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
from layouts import E4M3, E5M2, GEMM_CASES, LAYOUTS, OPERAND_LAYOUTS, cast_cases, check_layout, gemm_operands, laid_out
from torch._subclasses.fake_tensor import FakeTensorMode

from fp8fx.codegen import versions
from fp8fx.core import grouped
from fp8fx.ops import cuda, reference
from fp8fx.ops.args import Fp8GemmArgs

ops = torch.ops.fp8fx
EPILOGUES = ["", "bias", "bias,act=gelu,aux=pre_activation,amax", "residual", "mul=by_other,aux=pre_activation"]


@pytest.mark.parametrize("name,args", list(cast_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_cast(name, args):
    check_layout(ops.cast, ops.cast, args, what=name)


@pytest.mark.parametrize("layout,block", list(itertools.product(LAYOUTS, ([], [1, 0], [0, 1], [1, 128], [128, 128]))))
def test_amax_scale_and_inverse(layout, block):
    x = laid_out(torch.randn(40, 256), layout)
    check_layout(ops.amax, ops.amax, (x, block), what=f"amax {layout} {block}")
    amax = ops.amax(x, block)
    if amax.dim() == 2:  # the scale ops take scales in any layout too
        amax = laid_out(amax, layout)
    check_layout(ops.amax_to_scale, ops.amax_to_scale, (amax, 448.0, 0, False), what=f"amax_to_scale {layout}")
    scale = ops.amax_to_scale(amax, 448.0, 0, False)
    check_layout(ops.scale_inverse, ops.scale_inverse, (scale,), what=f"scale_inverse {layout}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_saved_copy(layout):
    check_layout(ops.saved_copy, ops.saved_copy, (laid_out(torch.randn(2, 6, 5, 32), layout), torch.bfloat16), what=layout)


@pytest.mark.parametrize("layout,block", list(itertools.product(LAYOUTS, ([1, 0], [1, 128]))))
def test_widen(layout, block):
    x = laid_out(torch.randn(2, 6, 40, 256), layout)
    scale = ops.amax_to_scale(ops.amax(x, block), 448.0, 0, False)
    q = ops.cast(x, scale, torch.float8_e4m3fn, block)
    check_layout(ops.widen, ops.widen, (q, ops.scale_inverse(scale), torch.bfloat16, block), what=f"{layout} {block}")


@pytest.mark.parametrize("batch", [(), (3,)])
def test_delayed_scale_update(batch):
    args = (
        torch.rand(*batch, 8),
        torch.ones(batch),
        torch.zeros(batch, dtype=torch.int64),
        torch.zeros(batch, dtype=torch.int64),
        torch.rand(batch) * 3,
    )
    check_layout(ops.delayed_scale_update, ops.delayed_scale_update, (*args, 448.0, 0, False, False, 1))


def test_delayed_state_ops():
    """A graph's state read (each scale and its inverse, tensors of their own) and its state update."""
    from types import SimpleNamespace

    from fp8fx.ops import delayed

    class States:
        def state(self, key):
            return self.states[key]

    instance = States()
    instance.states = {
        key: SimpleNamespace(amax_history=torch.zeros(length), scale=torch.ones(()), steps=torch.zeros((), dtype=torch.int64),
                             non_finite=torch.zeros((), dtype=torch.int64))
        for key, length in (("a", 4), ("b", 4), ("c", 1))
    }  # fmt: skip
    handle = delayed.register(instance)
    check_layout(ops.delayed_scales, ops.delayed_scales, (handle, "a\nb\nc", torch.device("cpu")))
    amaxes = [torch.rand(5), torch.rand(()), torch.rand(2)]
    settings = ([448.0, 57344.0, 448.0], [0, 0, 2], [False, True, False], [False, False, True], [1, 1, 3])
    check_layout(ops.delayed_scale_steps, ops.delayed_scale_steps, (handle, "a\nb\nc", amaxes, *settings))


def gemm_cases():
    for (block_a, block_b, mnk), la, lb in itertools.product(GEMM_CASES, OPERAND_LAYOUTS, OPERAND_LAYOUTS):
        yield f"{block_a}x{block_b} {mnk} a={la} b={lb}", (block_a, block_b), mnk, la, lb


def scaled_mm_runs_on_cpu(blocks) -> bool:
    """torch's CPU `_scaled_mm` takes tensorwise scales, rowwise ones from torch 2.13, no blockwise ones."""
    return blocks[0] == [] or (blocks[0] == [1, 0] and versions.cpu_rowwise_scaled_mm())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name,blocks,mnk,la,lb", list(gemm_cases()))
def test_scaled_mm(name, blocks, mnk, la, lb, bias):
    a, b, sa, sb = gemm_operands(blocks, mnk, la, lb)
    args = (a, b, sa, sb, torch.randn(mnk[1]) if bias else None, torch.bfloat16, *blocks)
    check_layout(ops.scaled_mm, ops.scaled_mm, args, what=name)
    if scaled_mm_runs_on_cpu(blocks):  # what CUDA runs: torch._scaled_mm, padded
        check_layout(ops.scaled_mm, cuda.scaled_mm_cuda, args, what=f"{name} (CUDA implementation)")


def test_batched_scaled_mm():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 40, 64, generator=g).to(E4M3), torch.randn(3, 48, 64, generator=g).to(E4M3).transpose(1, 2)
    args = (a, b, torch.ones(()), torch.ones(()), None, torch.float32, [], [])
    check_layout(ops.scaled_mm, ops.scaled_mm, args)
    check_layout(ops.scaled_mm, cuda.scaled_mm_cuda, args, what="CUDA implementation")


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("name,blocks,mnk,la,lb", [c for c in gemm_cases() if c[3] in ("contiguous", "transposed_slice")])
def test_fp8_gemm(name, blocks, mnk, la, lb, epilogue):
    a, b, sa, sb = gemm_operands(blocks, mnk, la, lb)
    m, n, _ = mnk
    spec = {part.split("=")[0]: part for part in epilogue.split(",") if part}
    bias = torch.randn(n) if "bias" in spec else None
    other = laid_out(torch.randn(m, n), la) if "mul" in spec else None
    residual = laid_out(torch.randn(m, n), lb) if "residual" in spec else None
    gemm = Fp8GemmArgs(
        a,
        b,
        sa,
        sb,
        bias=bias,
        other=other,
        residual=residual,
        out_dtype=torch.bfloat16,
        aux_dtype=torch.bfloat16,
        block_a=blocks[0],
        block_b=blocks[1],
        epilogue=epilogue,
        gpu_kernel="scaled_mm",
    )
    for kernel in ("scaled_mm", "triton"):
        args, kwargs = gemm.replace(gpu_kernel=kernel).call_args()
        check_layout(ops.fp8_gemm, ops.fp8_gemm, args, kwargs, what=f"{name} {epilogue} {kernel}")
    if scaled_mm_runs_on_cpu(blocks):
        args, kwargs = gemm.call_args()
        check_layout(ops.fp8_gemm, cuda.fp8_gemm_cuda, args, kwargs, what=f"{name} {epilogue} (CUDA implementation)")


@pytest.mark.parametrize("form", ["2d-3d", "2d-2d"])
def test_grouped_ops(form):
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([5, 5, 42, 64], dtype=torch.int32)
    dim = 0 if form == "2d-3d" else 1  # the dim the groups split: rows of a token matrix, or K
    x = torch.randn(64, 32, generator=g) if dim == 0 else torch.randn(32, 64, generator=g)
    for layout, lines in itertools.product(LAYOUTS, (False, True)):
        xl = laid_out(x, layout)
        what = f"{form} {layout} lines={lines}"
        check_layout(ops.grouped_amax, ops.grouped_amax, (xl, offs, dim, lines), what=what)
        scale = ops.amax_to_scale(ops.grouped_amax(xl, offs, dim, lines), 448.0, 0, False)
        check_layout(ops.grouped_cast, ops.grouped_cast, (xl, scale, offs, dim, E4M3), what=what)
        check_layout(ops.pad_groups, ops.pad_groups, (xl, offs, dim, 16), what=what)
    check_layout(ops.pad_offsets, ops.pad_offsets, (offs, 16))
    if form == "2d-3d":
        a, b = torch.randn(64, 32, generator=g).to(E5M2), torch.randn(4, 48, 32, generator=g).to(E4M3).transpose(1, 2)
    else:
        a, b = torch.randn(32, 64, generator=g).to(E4M3), torch.randn(48, 64, generator=g).to(E5M2).t()
    sa, sb = (torch.ones(grouped.scale_shape(tuple(x.shape), 4, grouped.operand_scales(form, side, ()))) for side, x in enumerate((a, b)))
    args = (a, b, sa, sb, offs, torch.bfloat16, [], [])
    check_layout(ops.fp8_grouped_mm, ops.fp8_grouped_mm, args, what=form)


# torch._scaled_mm's blockwise GEMMs (cuBLASLt, Hopper) check their scales' layouts; torch's meta
# kernel (2.13) checks the same rules, for sizes that are multiples of 128.
@pytest.mark.parametrize("block_a,block_b", [([1, 128], [128, 1]), ([1, 128], [128, 128]), ([128, 128], [128, 1])])
@pytest.mark.parametrize("m,n,k", [(256, 384, 512), (128, 128, 128), (7, 500, 1000)])
def test_blockwise_scales_are_laid_out_as_cublas_takes_them(block_a, block_b, m, n, k):
    ceil = lambda x, b: -(-x // b)  # noqa: E731
    mp, np_ = ceil(m, 16) * 16, ceil(n, 16) * 16
    sa = torch.rand(*reference.scale_shape((m, k), block_a)) + 0.5
    sb = torch.rand(*reference.scale_shape((k, n), block_b)) + 0.5
    ca, cb = cuda.blockwise_scales(sa, sb, block_a, block_b)
    kb, l4 = ceil(k, 128), ceil(ceil(k, 128), 4) * 4
    expected_a = ((mp, kb), (1, mp)) if block_a == [1, 128] else ((l4, ceil(m, 128)), (1, l4))
    expected_b = ((np_, kb), (1, np_)) if block_b == [128, 1] else ((l4, ceil(n, 128)), (1, l4))
    for scales, (shape, strides) in ((ca, expected_a), (cb, expected_b)):  # (a size-1 dim's stride is free)
        assert tuple(scales.shape) == shape
        assert [s for s, size in zip(scales.stride(), shape) if size > 1] == [s for s, size in zip(strides, shape) if size > 1]
    # the same values, moved
    assert torch.equal(ca[:m, :kb] if block_a == [1, 128] else ca[:kb].t(), sa)
    assert torch.equal(cb[:n, :kb].t() if block_b == [128, 1] else cb[:kb], sb)
    if m % 128 == 0 and n % 128 == 0 and k % 128 == 0 and hasattr(torch, "_scaled_mm_v2"):
        # The CUDA branch itself (padding, scale layouts, F.scaled_mm, the unpadded result), line
        # for line, with torch's meta kernel's checks standing in for cuBLASLt's.
        a = torch.empty(m, k, dtype=E4M3, device="meta")
        b = torch.empty(n, k, dtype=E4M3, device="meta").t()
        out = cuda.scaled_mm_2d(a, b, sa.to("meta"), sb.to("meta"), torch.float32, block_a, block_b)
        assert out.shape == (m, n) and out.dtype == torch.float32 and out.is_contiguous()


# fp8_gemm's cuBLAS branch (CUDA only): run line for line on meta tensors, torch's meta kernel of
# torch._scaled_mm standing in for cuBLASLt's; its outputs must be what the op's fake says.
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("epilogue,out_dtype", [("", torch.bfloat16), ("", torch.float32), ("residual", torch.bfloat16)])
def test_fp8_gemm_scaled_mm_branch_matches_its_fake(recipe, epilogue, out_dtype):
    m, n, k = 64, 48, 32
    a = torch.empty(m, k, dtype=E4M3, device="meta")
    b = torch.empty(n, k, dtype=E4M3, device="meta").t()
    block_a, block_b = ([], []) if recipe == "tensorwise" else ([1, 0], [0, 1])
    sa = torch.ones(reference.scale_shape((m, k), block_a), device="meta")
    sb = torch.ones(reference.scale_shape((k, n), block_b), device="meta")
    residual = torch.empty(m, n, dtype=torch.bfloat16, device="meta") if epilogue else None
    gemm = Fp8GemmArgs(
        a,
        b,
        sa,
        sb,
        residual=residual,
        out_dtype=out_dtype,
        aux_dtype=torch.bfloat16,
        block_a=block_a,
        block_b=block_b,
        epilogue=epilogue,
        gpu_kernel="scaled_mm",
    )
    outs = cuda.fp8_gemm_on_cuda(gemm)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = {k: mode.from_tensor(x) for k, x in vars(gemm).items() if isinstance(x, torch.Tensor)}
        fakes = gemm.replace(**fake_args)()
    for out, fake in zip(outs, fakes):
        assert (out.shape, out.stride(), out.dtype) == (fake.shape, fake.stride(), fake.dtype)
