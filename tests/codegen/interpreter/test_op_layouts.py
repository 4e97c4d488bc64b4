"""The fp8fx ops' GPU implementations (the generated kernels through their launchers, run by Triton's
interpreter on CPU tensors as a GPU runs them) return exactly what each op's fake promises, for
inputs laid out as graphs hand them over (tests/layouts.py). A cast kernel that returned a
contiguous tensor for a transposed weight or a permuted attention output crashed every real model
on a GPU (Inductor's assert_size_stride); this is where the CPU suite sees it."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from layouts import GEMM_CASES, LAYOUTS, cast_cases, check_layout, gemm_operands, laid_out

from fp8fx.codegen import launch
from fp8fx.core import grouped
from fp8fx.ops import cuda, reference
from fp8fx.ops.args import Fp8GemmArgs

pytestmark = pytest.mark.skipif(not launch.interpreter_active(), reason="needs TRITON_INTERPRET=1 before import")
ops = torch.ops.fp8fx


@pytest.mark.parametrize("name,args", list(cast_cases())[::5], ids=lambda v: v if isinstance(v, str) else "")
def test_cast_kernel(name, args):
    """fp8fx::cast on CPU tensors runs the CUDA implementation here; bit for bit the reference's values."""
    check_layout(ops.cast, cuda.cast_cuda, args, what=name)
    check_layout(ops.cast, ops.cast, args, what=f"{name} (dispatched)")
    assert torch.equal(ops.cast(*args).view(torch.uint8), reference.cast(*args).view(torch.uint8))


@pytest.mark.parametrize(
    "blocks,mnk,layouts,epilogue",
    [
        (blocks, mnk, layouts, epilogue)
        for (*blocks, mnk), layouts, epilogue in itertools.product(
            GEMM_CASES, [("contiguous", "transposed"), ("transposed_slice", "sliced")], ["", "bias,act=gelu,aux=pre_activation,amax"]
        )
    ][::3],
)
def test_gemm_kernel(blocks, mnk, layouts, epilogue):
    a, b, sa, sb = gemm_operands(blocks, mnk, *layouts)
    bias = torch.randn(mnk[1]) if epilogue else None
    gemm = Fp8GemmArgs(
        a,
        b,
        sa,
        sb,
        bias=bias,
        out_dtype=torch.bfloat16,
        aux_dtype=torch.bfloat16,
        block_a=blocks[0],
        block_b=blocks[1],
        epilogue=epilogue,
        gpu_kernel="triton",
    )
    check_layout(ops.fp8_gemm, cuda.fp8_gemm_cuda, *gemm.call_args(), what=f"{blocks} {layouts} {epilogue}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_kernel(layout):
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([5, 5, 42, 64], dtype=torch.int32)
    a = laid_out(torch.randn(64, 32, generator=g), layout).to(torch.float8_e5m2)
    b = laid_out(torch.randn(4, 32, 48, generator=g), layout).to(torch.float8_e4m3fn)
    blocks = ([1, 0], [0, 1])
    sa, sb = (torch.ones(grouped.scale_shape(tuple(x.shape), 4, grouped.operand_scales("2d-3d", side, block))) for side, (x, block) in enumerate(zip((a, b), blocks)))
    args = (a, b, sa, sb, offs, torch.bfloat16, *blocks)
    check_layout(ops.fp8_grouped_mm, cuda.fp8_grouped_mm_cpu, args, what=layout)


def test_inductor_training_step_runs_the_gpu_implementations():
    """A training step compiled by Inductor, whose generated code checks every fp8fx op's output
    against its fake (assert_size_stride): the GEMMs run the code a GPU runs, and they are the only
    fp8fx ops left (Inductor compiles the casts, fp8fx.compiler.lowering). The model casts a
    permuted attention output and transposed weights (the first GPU run's crash)."""
    from torch._inductor.utils import run_and_get_code

    import fp8fx
    from fp8fx.tools.selftest import ModelDims, SelftestModel

    torch.manual_seed(0)
    model = SelftestModel(ModelDims(64, 4, 128, 1, 13))
    x = torch.randn(1, 13, 64, requires_grad=True)
    backend = fp8fx.backend(inner="inductor", kernels="triton")
    _, code = run_and_get_code(lambda: torch.compile(model, backend=backend)(x).sum().backward())
    assert x.grad is not None and all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    report = fp8fx.report(backend)
    assert {op.gpu_kernel for op in report.fp8_ops} == {"triton"}
    called = re.findall(r"torch\.ops\.fp8fx\.(\w+)\.default\(", "\n".join(code))
    assert called and set(called) == {"fp8_gemm"}, called
    assert len(called) == len(report.fp8_ops)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_inductor_step_hands_the_gemms_their_operands_laid_out(recipe, monkeypatch):
    """Every GEMM operand reaches the launcher K-contiguous: Inductor writes the layout the tensor
    cores read (from the cast's kernel, or a tiled transpose of a saved FP8 tensor), the launchers
    copy nothing, and no view of the lowered casts becomes an extern copy (`detach_copy`). On an
    H100 the launchers' strided copies of transposed FP8 tensors took 15 of a 75 ms Llama step."""
    from torch._inductor.utils import run_and_get_code

    import fp8fx
    from fp8fx.tools.selftest import ModelDims, SelftestModel

    copies = []

    def rows_aligned(t, real=launch.rows_aligned):
        out = real(t)
        if out is not t:
            copies.append((tuple(t.shape), t.stride()))
        return out

    monkeypatch.setattr(launch, "rows_aligned", rows_aligned)
    torch.manual_seed(0)
    model = SelftestModel(ModelDims(64, 4, 128, 2, 16))  # token count a multiple of 16: aligned wgrad rows
    x = torch.randn(2, 16, 64, requires_grad=True)
    backend = fp8fx.backend(policy=fp8fx.Policy.from_recipe(recipe), inner="inductor", kernels="triton")
    _, code = run_and_get_code(lambda: torch.compile(model, backend=backend)(x).sum().backward())
    assert len(fp8fx.report(backend).fp8_ops) == len(re.findall(r"torch\.ops\.fp8fx\.fp8_gemm\.default\(", "\n".join(code))) > 0
    assert copies == []
    assert not re.findall(r"aten\.\w+_copy\.default\(", "\n".join(code))
