"""Any input torch accepts runs through the generated kernels: odd token counts, transposed,
sliced and broadcast operands, in all three GEMM roles, for every scale granularity.

Generated cases (sampled, fixed seeds), run under Triton's interpreter through the same launcher a
GPU uses, against the exact CPU reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import sqnr
from test_kernels import E4M3, E5M2, close_as, fp8_operand
from torch import nn

import fp8fx
from fp8fx.codegen import launch
from fp8fx.ops import reference
from fp8fx.ops.args import Fp8GemmArgs

pytestmark = pytest.mark.skipif(not launch.interpreter_active(), reason="needs TRITON_INTERPRET=1 before import")

LAYOUTS = ("row", "col", "sliced", "broadcast")


def laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as `x` (2-D) in another memory layout."""
    if layout == "col":
        return x.t().contiguous().t()
    if layout == "sliced":  # a view at an odd offset with a wider row stride
        wide = torch.zeros(x.shape[0] + 1, x.shape[1] + 3, dtype=x.dtype)
        wide[1:, 3:] = x
        return wide[1:, 3:]
    if layout == "broadcast":  # stride 0: one row repeated (values change, the reference sees the same)
        return x[:1].expand(x.shape)
    return x


BLOCKS = [((), ()), ((1, 0), (0, 1)), ((1, 128), (128, 128)), ((1, 128), (128, 1))]
SHAPES = [(1, 16, 16), (7, 24, 14), (15, 5, 33), (17, 1, 48), (127, 40, 130), (40, 16, 1)]
CASES = [
    (shape, blocks, la, lb, fmts, family)
    for shape, blocks, la, lb, fmts, family in zip(
        SHAPES * 4,
        itertools.cycle(BLOCKS),
        itertools.cycle(LAYOUTS),
        itertools.cycle(LAYOUTS[::-1] + LAYOUTS[1:2]),
        itertools.cycle(((E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2))),
        itertools.cycle(("tma", "pointer", "pointer", "tma", "tma")),
    )
]


@pytest.mark.parametrize("shape,blocks,layout_a,layout_b,formats,family", CASES, ids=lambda v: str(v))
def test_launcher_takes_any_shape_and_layout(shape, blocks, layout_a, layout_b, formats, family):
    m, n, k = shape
    (block_a, block_b), seed = blocks, m * 131 + n * 7 + k
    a, sa = fp8_operand((m, k), formats[0], block_a, seed)
    b, sb = fp8_operand((k, n), formats[1], block_b, seed + 1)
    a, b = laid_out(a, layout_a), laid_out(b, layout_b)
    ep = fp8fx.codegen.variants.Epilogue(bias=True, activation="gelu")
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    out, _, _ = launch.fp8_gemm(
        a, b, sa, sb, block_a=block_a, block_b=block_b, epilogue=ep, bias=bias, out_dtype=torch.float32, family=family
    )
    ref, _, _ = reference.fp8_gemm(
        Fp8GemmArgs(
            a.contiguous(),
            b.contiguous(),
            sa,
            sb,
            bias=bias,
            out_dtype=torch.float32,
            aux_dtype=torch.float32,
            block_a=list(block_a),
            block_b=list(block_b),
            epilogue=ep.spec(),
            gpu_kernel="scaled_mm",
            fast_accum=False,
        )
    )
    close_as(out, ref)


def test_empty_gemms_are_not_refused():
    one = torch.tensor(1.0)
    for (m, n, k), family in itertools.product(((0, 16, 16), (16, 0, 16), (16, 16, 0)), ("pointer", "tma")):
        a = torch.zeros(m, k).to(E4M3)
        b = torch.zeros(k, n).to(E4M3)
        ep = fp8fx.codegen.variants.Epilogue(out_amax=True)
        out, _, amax = launch.fp8_gemm(a, b, one, one, epilogue=ep, out_dtype=torch.float32, family=family)
        assert out.shape == (m, n) and not out.any() and amax.item() == 0.0


class Mlp(nn.Module):
    def __init__(self, d=128, hidden=256):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))


def kernel_and_emulated_steps(recipe: str, monkeypatch, d=64, hidden=128, batch=2) -> list[tuple[list, fp8fx.Report]]:
    """One fwd + bwd of the same Mlp(d, hidden) on [batch, 40, d] under `recipe` with kernels="triton":
    first through the generated kernels (the interpreter), then on the exact emulation (the CPU op's
    other path). [(grads of input, up and down weights, report)] for both runs, same seeds."""
    import fp8fx.ops.cuda

    torch.manual_seed(0)
    model, x = Mlp(d, hidden), torch.randn(batch, 40, d)
    runs = []
    for emulated in (False, True):
        if emulated:
            monkeypatch.setattr(fp8fx.ops.cuda, "interpreter_active", lambda: False)
        m = Mlp(d, hidden)
        m.load_state_dict(model.state_dict())
        xi = x.clone().requires_grad_()
        backend = fp8fx.backend(policy=fp8fx.Policy.from_recipe(recipe), inner="eager", kernels="triton")
        torch.manual_seed(1)  # the same stochastic rounding (NVFP4) in both runs
        torch.compile(m, backend=backend)(xi).square().sum().backward()
        runs.append(([xi.grad, m.up.weight.grad, m.down.weight.grad], fp8fx.report(backend)))
        torch._dynamo.reset()
    return runs


def input_in_layout(batch: int, tokens: int, d: int, layout: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if layout == "col":  # [tokens, batch, d] storage seen as [batch, tokens, d]
        return torch.randn(tokens, batch, d, generator=g).transpose(0, 1)
    if layout == "sliced":
        return torch.randn(batch, tokens + 2, d + 8, generator=g)[:, 1:-1, 4:-4]
    if layout == "broadcast":
        return torch.randn(batch, 1, d, generator=g).expand(batch, tokens, d)
    return torch.randn(batch, tokens, d, generator=g)


TRAINING = list(
    zip(
        [(1, 1), (1, 7), (1, 15), (1, 17), (1, 127), (1, 1000), (2, 7), (3, 5)],
        itertools.cycle(("rowwise", "blockwise", "tensorwise")),
        itertools.cycle(LAYOUTS),
    )
)


@pytest.mark.parametrize("shape,recipe,layout", TRAINING, ids=lambda v: str(v))
def test_training_step_with_any_token_count(shape, recipe, layout):
    """fwd + bwd with every FP8 GEMM in the generated kernels (output, grad_input and grad_weight,
    whose K is the token count) equals the same step on the reference kernels."""
    batch, tokens = shape
    # Blockwise scales 128-wide blocks: a narrow model elsewhere (the token count is what varies here).
    d = 128 if recipe == "blockwise" else 32
    torch.manual_seed(0)
    model = Mlp(d, 2 * d)
    x = input_in_layout(batch, tokens, d, layout, seed=tokens)
    results = []
    for kernels in ("triton", "scaled_mm"):  # on CPU tensors "scaled_mm" runs the exact reference
        m = Mlp(d, 2 * d)
        m.load_state_dict(model.state_dict())
        xi = x.detach().clone().requires_grad_() if layout != "broadcast" else x.detach().requires_grad_()
        backend = fp8fx.backend(policy=fp8fx.Policy.from_recipe(recipe), inner="eager", kernels=kernels)
        out = torch.compile(m, backend=backend)(xi)
        out.square().sum().backward()
        report = fp8fx.report(backend)
        assert len(report.fp8_ops) == 6 and {op.gpu_kernel for op in report.fp8_ops} == {kernels}
        results.append([out, xi.grad, m.up.weight.grad, m.up.bias.grad, m.down.weight.grad])
        torch._dynamo.reset()
    # Not bit-equal: fp32 summation order differs (tiles vs one GEMM), which can move a value
    # across an FP8 rounding boundary where the next cast happens.
    for ours, ref in zip(*results):
        assert sqnr(ours, ref) >= 35
