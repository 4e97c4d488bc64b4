"""Under Inductor, a GEMM the graph gives to cuBLAS becomes `aten._scaled_mm` and ATen epilogue ops
(fp8fx.compiler.lowering), so Inductor's code calls cuBLAS itself. GPUs only, in use: these tests add
"cpu" to the lowering's devices (the backend option `cublas_devices`) and run the graph a GPU runs
on torch's CPU `_scaled_mm`."""

from __future__ import annotations

import random
import re

import pytest
import torch
from helpers import CUBLAS_ROWWISE, fp8fx_calls, one_layer_llama, sqnr
from torch._inductor.utils import run_and_get_code

import fp8fx
from fp8fx.codegen import versions
from fp8fx.compiler import lowering
from fp8fx.ops import cuda, reference
from fp8fx.ops.args import Fp8GemmArgs

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SEED = 20261127
EPILOGUES = ["", "bias", "bias,act=gelu,aux=pre_activation", "act=silu,mul", "gate=silu,aux=activation", "residual,amax", "bias,residual"]
CUBLAS_ON_CPU = ("cpu", "cuda")


def _case(rng: random.Random, g: torch.Generator):
    m, n, k = (16 * rng.randint(1, 6) for _ in range(3))
    recipe = rng.choice(["tensorwise", "rowwise"] if versions.cpu_rowwise_scaled_mm() else ["tensorwise"])
    a_dtype, b_dtype = rng.choice([(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)])
    block_a, block_b = ([], []) if recipe == "tensorwise" else rng.choice([([1, 0], [0, 1]), ([], [0, 1]), ([1, 0], [])])
    epilogue = rng.choice(EPILOGUES)
    out_dtype = rng.choice([torch.bfloat16, torch.float32] + ([E4M3] if "amax" not in epilogue else []))
    a = torch.randn(m, k, generator=g).to(a_dtype)
    b = torch.randn(n, k, generator=g).to(b_dtype).t()  # column-major, as lay_out_operands leaves it
    sa = torch.rand(reference.scale_shape((m, k), block_a), generator=g) + 0.5
    sb = torch.rand(reference.scale_shape((k, n), block_b), generator=g) + 0.5
    bias = torch.randn(n, generator=g) if "bias" in epilogue else None
    other = torch.randn(m, n, generator=g) if "mul" in epilogue or "gate" in epilogue else None
    residual = torch.randn(m, n, generator=g) if "residual" in epilogue else None
    out_scale = torch.tensor(0.5) if out_dtype == E4M3 else None
    args = Fp8GemmArgs(
        a,
        b,
        sa,
        sb,
        bias=bias,
        other=other,
        residual=residual,
        out_scale=out_scale,
        out_dtype=out_dtype,
        aux_dtype=torch.bfloat16,
        block_a=block_a,
        block_b=block_b,
        epilogue=epilogue,
        gpu_kernel="scaled_mm",
        fast_accum=False,
    )
    return f"{recipe} {m}x{n}x{k} {a_dtype}x{b_dtype} {block_a}x{block_b} {epilogue!r} -> {out_dtype}", args


def test_the_lowered_gemm_computes_what_the_op_runs_on_cublas():
    """Value for value what `fp8fx::fp8_gemm`'s CUDA implementation computes (the same
    `torch._scaled_mm` and epilogue), and close to the exact emulation (the rowwise product is
    bf16, as cuBLAS writes it)."""
    rng, g = random.Random(SEED), torch.Generator().manual_seed(SEED)
    for _ in range(40):
        what, args = _case(rng, g)
        lowered = lowering._cublas_fp8_gemm(args, CUBLAS_ON_CPU)
        assert lowered is not NotImplemented, what
        positional, keywords = args.call_args()
        on_cuda = cuda.fp8_gemm_cuda(*positional, **keywords)
        emulated = reference.fp8_gemm(args)
        for name, low, cud, emu in zip(("out", "aux", "amax"), lowered, on_cuda, emulated):
            assert (low.shape, low.dtype) == (cud.shape, cud.dtype), f"{what}: {name}"
            assert torch.equal(low.float(), cud.float()), f"{what}: {name}"
            if emu.numel():
                assert sqnr(low.float(), emu.float()) > (25 if low.dtype == E4M3 else 40), f"{what}: {name}"


@pytest.mark.parametrize(
    "shape,blocks,gpu_kernel",
    [((30, 32, 64), ([], []), "scaled_mm"), ((32, 32, 64), ([1, 128], [128, 1]), "scaled_mm"), ((32, 32, 64), ([], []), "triton"),
     ((32, 32, 64), ([1, 32], [32, 1]), "scaled_mm")],
)  # fmt: skip
def test_gemms_cublas_cannot_take_as_they_are_stay_ops(shape, blocks, gpu_kernel):
    """Unaligned M (the op pads), blockwise and MX scales, and the generated kernel stay `fp8fx::fp8_gemm`."""
    m, n, k = shape
    a, b = torch.zeros(m, k, dtype=E4M3), torch.zeros(n, k, dtype=E4M3).t()
    sa, sb = torch.ones(reference.scale_shape((m, k), blocks[0])), torch.ones(reference.scale_shape((k, n), blocks[1]))
    rest = dict(out_dtype=torch.bfloat16, aux_dtype=torch.bfloat16, block_a=blocks[0], block_b=blocks[1])
    args = Fp8GemmArgs(a, b, sa, sb, **rest, gpu_kernel=gpu_kernel)
    assert lowering._cublas_fp8_gemm(args, CUBLAS_ON_CPU) is NotImplemented


def _step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("recipe", ["tensorwise", CUBLAS_ROWWISE])
def test_a_cublas_training_step_calls_scaled_mm_from_inductor_code(recipe):
    """Every FP8 GEMM of a Llama step is an `aten._scaled_mm` call in Inductor's code, none an
    fp8fx op, and the step's loss and gradients are the fp32 step's, to FP8's precision."""
    model = one_layer_llama()
    ids = torch.randint(0, 512, (2, 16))
    fp32_loss, fp32_grads = _step(model, ids)
    model.zero_grad()
    policy = fp8fx.Policy.from_recipe(recipe)
    backend = fp8fx.backend(policy=policy, inner="inductor", kernels="scaled_mm", cublas_devices=CUBLAS_ON_CPU)
    compiled = torch.compile(model, backend=backend)
    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        (loss, grads), code = run_and_get_code(_step, compiled, ids)
    code = "\n".join(code)
    gemms = len(fp8fx.report(backend).fp8_ops)
    assert gemms == 24  # 7 projections and the LM head x (output, input gradient, weight gradient)
    assert fp8fx_calls(code) == []
    assert len(re.findall(r"extern_kernels\._scaled_mm\(|aten\._scaled_mm\.default\(", code)) == gemms
    assert sqnr(loss, fp32_loss) > 50 and sqnr(grads, fp32_grads) > 18  # measured: 75-83 dB and 23-25 dB
    # Each FP8 tensor Inductor's kernels write for cuBLAS (a cast or a layout copy) costs at least
    # its write and a read of its source: the report's passes count them all, weights' casts too
    # (Inductor names `_scaled_mm` among the origins of the cast kernel writing its operand).
    fp8_buffers = len(re.findall(r"empty_strided_cpu\([^\n]*torch\.float8_e", code))
    assert fp8fx.report(backend).summary()["memory_passes_added"] >= 2 * fp8_buffers
    if recipe == "tensorwise":  # each activation is cast once, token-major ([batch, tokens, features] or its
        # [tokens, features] view): the attention output too, which SDPA stores token-major behind a
        # [batch, heads, tokens] view, and whose cast computed in that view's order was written
        # head-major and then copied for its GEMM; and forward makes no transposed copy for backward
        forward = re.findall(r"empty_strided_cpu\(\(([\d, ]+)\), \([\d, ]+\), torch\.float8_e4m3fn\)", code.split("AOT ID")[1])
        activations = [s for s in forward if s.startswith(("2, 16, ", f"{ids.numel()}, "))]
        assert len(activations) == 3 and not [s for s in forward if s.startswith("2, 4, ") or s.endswith(f", {ids.numel()}")], forward


def test_without_fused_epilogues_the_gemms_are_still_cublas_calls_in_inductor_code():
    """`fuse_epilogues=False` keeps each GEMM an `fp8fx::scaled_mm` with its epilogue as graph ops;
    under Inductor a GEMM cuBLAS takes as it is still becomes `aten._scaled_mm` in Inductor's code
    (it was a Python-dispatched op call per GEMM), and the step matches the fp32 step."""
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    x = torch.randn(16, 32)

    def step(m):
        m.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    fp32_loss, fp32_grads = step(model)
    backend = fp8fx.backend(inner="inductor", fuse_epilogues=False, cublas_devices=CUBLAS_ON_CPU)
    compiled = torch.compile(model, backend=backend)
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        (loss, grads), code = run_and_get_code(step, compiled)
    code = "\n".join(code)
    gemms = len(fp8fx.report(backend).fp8_ops)
    assert gemms == 5  # 2 Linears x (output, input gradient, weight gradient), but x needs no gradient
    assert fp8fx_calls(code) == []
    assert len(re.findall(r"extern_kernels\._scaled_mm\(|aten\._scaled_mm\.default\(", code)) == gemms
    assert sqnr(loss, fp32_loss) > 30 and sqnr(grads, fp32_grads) > 15
