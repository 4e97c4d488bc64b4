"""The NVFP4 recipe (TransformerEngine's NVFP4BlockScaling): FP4 E2M1 data with one E4M3 scale per
16 elements along K (16x16 for weights) under an fp32 per-tensor scale, stochastic rounding of
gradients and a random Hadamard transform on the weight gradient's operands. Casts are checked bit
for bit against torchao's NVFP4 reference (torchao.prototype.mx_formats.nvfp4_tensor), then the
GEMM, the transform, stochastic rounding, compiled training and the policy file."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked, unpack_uint4
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, nvfp4_quantize, per_tensor_amax_to_scale

import fp8fx
from fp8fx.core import fp4, scaling
from fp8fx.core.formats import Fp8Format
from fp8fx.core.policy import Policy, PolicyError, Rule, Settings
from fp8fx.core.policy_yaml import policy_from_yaml
from fp8fx.core.recipes import GRANULARITIES, RECIPES, Granularity, Hadamard
from tests.helpers import assert_policy_yaml_error, compile_captured, sqnr

ops = torch.ops.fp8fx
ASSETS = Path(__file__).parents[1] / "assets"


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    cases = {"normal": torch.randn(64, 256, generator=g)}
    # Magnitudes from 2**-40 to 2**40 per element: block scales over E4M3's whole range and clamped at its ends.
    cases["wide_range"] = torch.randn(48, 128, generator=g) * torch.exp2((torch.randn(48, 128, generator=g) * 12).clamp(-40, 40))
    cases["outlier_channels"] = torch.randn(32, 128, generator=g) * torch.logspace(-3, 3, 128)
    cases["zeros"] = torch.zeros(32, 64)
    with_zero_block = torch.randn(32, 128, generator=g)
    with_zero_block[5, 16:32] = 0.0
    cases["zero_block"] = with_zero_block
    cases["tiny"] = torch.randn(16, 64, generator=g) * 1e-30  # per-tensor scale ~4e-34: still a normal fp32
    cases["huge"] = torch.randn(16, 64, generator=g) * 1e30
    # Scaled values exactly on E2M1's ties (0.25, 0.75, ..., 5): a block of amax 6 holds them unscaled.
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
    cases["ties"] = ties.repeat(8, 4)
    cases["bf16_3d"] = (torch.randn(2, 32, 96, generator=g) * 7).to(torch.bfloat16)
    return cases


CASES = _cases()


def _torchao(x: torch.Tensor, per_tensor_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's E4M3 block-scale bytes and E2M1 codes (one per element)."""
    scales, packed = nvfp4_quantize(x.contiguous(), 16, per_tensor_scale)
    return scales.view(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] // 16), unpack_uint4(packed).reshape(x.shape)


def _fp8fx(x: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8fx's NVFP4 cast through its ops: (E4M3 block-scale bytes, E2M1 codes, carrier, scale_inv)."""
    amax = ops.amax(x, block)
    scale, scale_inv = ops.nvfp4_scale(amax)
    q = ops.cast_nvfp4(x, scale, block, False)
    finite = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    block_scales = scaling.nvfp4_block_scales(finite, scaling.nvfp4_tensor_scale_inv(finite.amax()))
    return block_scales.view(torch.uint8), fp4.e2m1_codes(q), q, scale_inv


# ---------------------------------------------------------------- the cast, bit for bit


@pytest.mark.parametrize("case", list(CASES))
def test_cast_matches_torchao_bit_for_bit(case):
    x = CASES[case]
    amax = x.float().abs().amax()
    tensor_scale_inv = scaling.nvfp4_tensor_scale_inv(amax)
    if amax > 0:  # the per-tensor scale is torchao's `per_tensor_amax_to_scale` (0 for zeros: fp8fx takes 1, as TE)
        assert torch.equal(tensor_scale_inv, per_tensor_amax_to_scale(amax))
    ref_scales, ref_codes = _torchao(x, tensor_scale_inv)
    scales, codes, q, scale_inv = _fp8fx(x, [1, 16])
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes, ref_codes)
    # The dequantized operand the GEMM multiplies is torchao's dequantize, exactly.
    if x.dim() == 2:
        expected = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=tensor_scale_inv).dequantize(torch.float32)
        assert torch.equal(q.float() * scaling.expand_blocks(scale_inv, (1, 16), x.shape), expected)
        # The right operand (K x N) takes 16x1 blocks: torchao's cast of its transpose.
        scales_t, codes_t, _, _ = _fp8fx(x.t().contiguous(), [16, 1])
        assert torch.equal(scales_t.t(), ref_scales) and torch.equal(codes_t.t(), ref_codes)


def test_round_to_nearest_even_matches_torchao_on_every_tie():
    # Every multiple of 1/8 in [-8, 8]: E2M1 values, their midpoints (the ties) and values between.
    x = torch.arange(-64, 65, dtype=torch.float32) / 8
    expected = f32_to_f4_unpacked(x.clamp(-6, 6))
    assert torch.equal(fp4.e2m1_codes(fp4.round_e2m1(x)), expected)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert fp4.round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # to the even code
    assert fp4.round_e2m1(torch.tensor([-0.0, 0.1, -7.0, 1e30])).tolist() == [-0.0, 0.0, -6.0, 6.0]
    assert torch.signbit(fp4.round_e2m1(torch.tensor([-0.0, -0.2]))).all()  # the sign of zero is kept (code 8)


def test_every_e2m1_value_is_exact_in_its_e4m3_carrier():
    values = torch.tensor(fp4.E2M1_VALUES)
    assert torch.equal(values.to(fp4.CARRIER).float(), values)
    assert fp4.e2m1_codes(torch.cat([values, -values])).tolist() == list(range(16))


def test_non_finite_values():
    """A NaN stays NaN in the carrier, an inf saturates to +-6 of its block's scale; a block holding
    either gets the smallest scale and leaves the per-tensor amax to the finite blocks, so every
    other block casts as torchao casts the tensor with those blocks zeroed."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    x[2, 5], x[7, 40] = math.nan, -math.inf
    scales, codes, q, _ = _fp8fx(x, [1, 16])
    assert math.isnan(q[2, 5].float()) and q[7, 40].float() == -6.0
    assert scales[2, 0] == scales[7, 2] == torch.tensor(2.0**-6).to(torch.float8_e4m3fn).view(torch.uint8)
    clean = x.clone()
    clean[2, :16], clean[7, 32:48] = 0.0, 0.0
    ref_scales, ref_codes = _torchao(clean, scaling.nvfp4_tensor_scale_inv(clean.abs().amax()))
    good = torch.ones_like(scales, dtype=torch.bool)
    good[2, 0], good[7, 2] = False, False
    assert torch.equal(scales[good], ref_scales[good])
    assert torch.equal(codes.reshape(16, 4, 16)[good], ref_codes.reshape(16, 4, 16)[good])
    # All non-finite or all zero: the per-tensor scale is 1, never 0, inf or NaN.
    for bad in (torch.full((2,), math.nan), torch.zeros(2), torch.full((2,), math.inf)):
        assert scaling.nvfp4_tensor_scale_inv(bad.amax()).item() == 1.0
    assert scaling.nvfp4_tensor_scale_inv(torch.tensor(1e-44)).item() == torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("spread", [0.0, 3.0])
def test_te_order_of_scale_arithmetic_differs_only_below_normal_block_scales(spread):
    """TransformerEngine's reference quantizer multiplies by the global encode scale 448 * 6 / amax
    where torchao (and fp8fx) divide by amax / (448 * 6). Written out here: the block scales and
    elements agree wherever TE's block scale is a normal E4M3 value; TE keeps subnormal ones where
    fp8fx clamps to 2**-6 (rows spread over 2**(3 N(0,1)) have such blocks, plain Gaussians none)."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(256, 512, generator=g) * torch.exp2(torch.randn(256, 1, generator=g) * spread)
    amax, block_amax = x.abs().amax(), x.abs().reshape(256, 32, 16).amax(-1)
    ours = scaling.nvfp4_block_scales(block_amax, scaling.nvfp4_tensor_scale_inv(amax))
    global_encode = (448.0 * 6.0) / amax
    te = (block_amax / 6.0 * global_encode).clamp(max=448.0).to(torch.float8_e4m3fn)
    normal = te.float() >= 2.0**-6
    assert torch.equal(ours.view(torch.uint8)[normal], te.view(torch.uint8)[normal])
    assert (ours.float()[~normal] == 2.0**-6).all() and (normal.all() if spread == 0 else not normal.all())
    ours_elements = fp4.round_e2m1(x * ((1.0 / scaling.nvfp4_tensor_scale_inv(amax)) / ours.float()).repeat_interleave(16, 1))
    te_elements = fp4.round_e2m1(x * (1.0 / (te.float() * (1.0 / global_encode))).repeat_interleave(16, 1))
    same = normal.repeat_interleave(16, 1)
    assert torch.equal(ours_elements[same], te_elements[same])


def test_weight_blocks_serve_both_orientations():
    """16x16 weight blocks: the cast of W^T is the transpose of the cast of W, so forward's and
    backward's weight casts are one quantization (TE's 2-D weights), each block scaled by its amax."""
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(4)) * torch.logspace(-2, 2, 96)
    scales, codes, _, scale_inv = _fp8fx(w, [16, 16])
    scales_t, codes_t, _, scale_inv_t = _fp8fx(w.t().contiguous(), [16, 16])
    assert torch.equal(scales_t.t(), scales) and torch.equal(codes_t.t(), codes) and torch.equal(scale_inv_t.t(), scale_inv)
    amax = w.abs().reshape(4, 16, 6, 16).amax(dim=(1, 3))
    assert torch.equal(scales, scaling.nvfp4_block_scales(amax, scaling.nvfp4_tensor_scale_inv(w.abs().amax())).view(torch.uint8))


# ---------------------------------------------------------------- the GEMM


@pytest.mark.parametrize("shape", [(64, 96, 128), (32, 64, 256)])
def test_gemm_error_against_fp64_of_the_dequantized_operands(shape):
    m, n, k = shape
    g = torch.Generator().manual_seed(1)
    a = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)  # outlier channels: blocks matter
    b = torch.randn(k, n, generator=g)
    _, _, qa, sa = _fp8fx(a, [1, 16])
    _, _, qb, sb = _fp8fx(b, [16, 16])  # a weight
    out = ops.scaled_mm(qa, qb, sa, sb, None, torch.float32, [1, 16], [16, 16])
    a_dq = qa.double() * scaling.expand_blocks(sa, (1, 16), a.shape).double()
    b_dq = qb.double() * scaling.expand_blocks(sb, (16, 16), b.shape).double()
    expected = a_dq @ b_dq
    magnitude = a_dq.abs() @ b_dq.abs()
    # Each 16-of-K partial product is exact in fp32 and scaled with two roundings; the K/16 partial
    # sums add in fp32: at most (K/16 + 2) * 2**-24 of the sum of |products|. Measured on seeds
    # 1-4: at most 1.6 * 2**-24 of it, SQNR 146.4-147.2 dB.
    err = (out.double() - expected).abs()
    assert (err <= (k / 16 + 2) * 2.0**-24 * magnitude).all()
    assert (err <= 3 * 2.0**-24 * magnitude).all()
    assert sqnr(out, expected) > 135
    # Against the unquantized product, FP4 is FP4: measured 16.3-17.0 dB on these operands (seeds 1-4).
    assert 14.0 < sqnr(out, a.double() @ b.double()) < 20.0


# ---------------------------------------------------------------- stochastic rounding


def test_stochastic_rounding_is_unbiased_and_deterministic_for_a_seed():
    x = torch.empty(2048).uniform_(-6, 6, generator=torch.Generator().manual_seed(5))
    n = 256
    g = torch.Generator().manual_seed(0)
    samples = torch.stack([fp4.stochastic_round_e2m1(x, g) for _ in range(n)])
    # Every sample is one of x's two neighbouring E2M1 values.
    step = torch.where(x.abs() < 2, 0.5, torch.where(x.abs() < 4, 1.0, 2.0))
    assert ((samples - x).abs() <= step).all()
    assert torch.equal(fp4.round_e2m1(samples), samples)
    # Unbiased: the mean of n samples is within 5 standard deviations (step * sqrt(p(1-p)/n)) of x
    # per element (measured: at most 3.9 over these 2048), and the mean of all 524288 errors is
    # within 0.003 of 0 (measured 5e-4; its standard deviation is about 4e-4).
    p = (x.abs() - x.abs().div(step).floor() * step) / step
    sigma = step * torch.sqrt(p * (1 - p) / n)
    assert ((samples.mean(0) - x).abs() <= 5 * sigma + 1e-6).all()
    assert (samples - x).mean().abs() < 0.003
    # E2M1 values never move; the same seed gives the same bits, another seed others.
    grid = torch.tensor(fp4.E2M1_VALUES * 4)
    assert torch.equal(fp4.stochastic_round_e2m1(grid, torch.Generator().manual_seed(1)), grid)
    first = fp4.stochastic_round_e2m1(x, torch.Generator().manual_seed(7))
    assert torch.equal(first, fp4.stochastic_round_e2m1(x, torch.Generator().manual_seed(7)))
    assert not torch.equal(first, fp4.stochastic_round_e2m1(x, torch.Generator().manual_seed(8)))
    # The graph's cast draws from torch's default generator: torch.manual_seed repeats it.
    scale = torch.ones(1, 4096 // 16)
    torch.manual_seed(11)
    one = ops.cast_nvfp4(x[None], scale, [1, 16], True)
    torch.manual_seed(11)
    assert torch.equal(one.view(torch.uint8), ops.cast_nvfp4(x[None], scale, [1, 16], True).view(torch.uint8))


# ---------------------------------------------------------------- the random Hadamard transform


def test_hadamard_matrix_is_orthogonal_with_random_signs():
    h = fp4.hadamard_matrix()
    assert torch.equal(h @ h.t(), torch.eye(16)) and torch.equal(h.t() @ h, torch.eye(16))  # exact: entries are +-1/4
    assert set(h.abs().unique().tolist()) == {0.25}
    signs = (h[:, 0] * 4).tolist()  # Sylvester's first column is all ones: the diagonal's signs
    assert set(signs) == {-1.0, 1.0}
    assert torch.equal(h, fp4.hadamard_matrix(fp4.HADAMARD_SEED)) and not torch.equal(
        h, fp4.hadamard_matrix(fp4.HADAMARD_SEED + 1)
    )


@pytest.mark.parametrize("tokens", [64, 50])
def test_wgrad_with_the_transform_equals_the_plain_wgrad_in_exact_arithmetic(tokens):
    """dW = dY^T X over the tokens: (dY^T R)(R^T X) = dY^T X for the block-diagonal orthogonal R,
    the token dim zero-padded to a multiple of 16 (fp64 here: exact to its rounding)."""
    g = torch.Generator().manual_seed(6)
    grad_t = torch.randn(32, tokens, generator=g, dtype=torch.float64)  # dY^T: [N, tokens]
    x = torch.randn(tokens, 48, generator=g, dtype=torch.float64)  # X: [tokens, K]
    h = fp4.hadamard_matrix()
    left, right = fp4.hadamard_transform(grad_t, -1, h), fp4.hadamard_transform(x, -2, h)
    assert left.shape == (32, -(-tokens // 16) * 16) and right.shape == (-(-tokens // 16) * 16, 48)
    assert torch.allclose(left @ right, grad_t @ x, rtol=0, atol=1e-12)
    # The op pads the same way and its fake says so.
    assert ops.hadamard(grad_t.float(), -1).shape == left.shape
    with torch._subclasses.FakeTensorMode():
        assert ops.hadamard(torch.empty(32, tokens), -1).shape == left.shape


# ---------------------------------------------------------------- compiled training


def _asset(name: str):
    spec = importlib.util.spec_from_file_location(f"asset_{name}", ASSETS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Wrapped(nn.Module):
    """The asset's nn.Sequential inside a class of our own (torch.compile sees built-ins' graphs only so)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


# tests/assets/mlp.py (64 -> 256 -> 64 -> 10; the last layer's N=10 stays high), cross-entropy over
# 10 classes, seeds 0-4, 8 SGD steps: outputs 14.1-16.5 dB; first-step gradients of the FP4
# layers' weights 6.7-8.1 dB (the high last layer's 13.3-14.7): the forward's FP4 noise in the
# logits and ReLU masks reaches every gradient, and gradients are FP4 too (rounding to nearest
# instead of stochastically changes them by under 0.5 dB); losses within 0.22% of fp32's. The
# floors leave about 2 dB of margin, the losses' bound is 1%.
NVFP4_OUTPUT_SQNR_DB = (12.0, 22.0)
NVFP4_GRAD_SQNR_DB = (5.0, 16.0)


def test_mlp_from_assets_trains_under_nvfp4_close_to_fp32():
    mlp = _asset("mlp")
    torch.manual_seed(0)
    model = Wrapped(mlp.build_model())
    reference = Wrapped(mlp.build_model())
    reference.load_state_dict(model.state_dict())
    cap = compile_captured(model, Policy.from_recipe("nvfp4"))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(reference.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    losses, ref_losses = [], []
    for step in range(8):
        out, ref_out = cap.compiled(x), reference(x)
        loss, ref_loss = nn.functional.cross_entropy(out, y), nn.functional.cross_entropy(ref_out, y)
        opt.zero_grad(), ref_opt.zero_grad()
        loss.backward(), ref_loss.backward()
        assert NVFP4_OUTPUT_SQNR_DB[0] < sqnr(out.detach(), ref_out.detach()) < NVFP4_OUTPUT_SQNR_DB[1]
        if step == 0:
            for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
                if name.endswith("weight"):
                    assert NVFP4_GRAD_SQNR_DB[0] < sqnr(p.grad, ref_p.grad) < NVFP4_GRAD_SQNR_DB[1], name
        opt.step(), ref_opt.step()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert all(abs(v - r) <= 0.01 * r for v, r in zip(losses, ref_losses)), (losses, ref_losses)
    assert losses[-1] < losses[0]

    report = cap.report
    fp4_rows = report.fp8_ops
    assert {(op.site, op.role) for op in fp4_rows} == {
        ("inner.0", "output"), ("inner.0", "grad_weight"), *((s, r) for s in ("inner.2",) for r in ("output", "grad_input", "grad_weight"))
    }  # fmt: skip
    assert all(op.formats == ("nvfp4", "nvfp4") and op.granularity == "nvfp4" for op in fp4_rows)
    assert all(op.gpu_kernel == "nvfp4" and "Blackwell only" in op.gpu_kernel_reason for op in fp4_rows)
    assert {(op.role, op.stochastic_rounding, op.hadamard) for op in fp4_rows} == {
        ("output", False, False), ("grad_input", True, False), ("grad_weight", True, True)
    }  # fmt: skip
    assert "dynamic nvfp4 sr rht" in str(report)
    assert all(op.memory_passes_added >= 4 for op in fp4_rows)  # an amax and a cast pass per operand
    blocks = {op.role: op.blocks for op in fp4_rows if op.site == "inner.2"}
    assert blocks == {"output": ((1, 16), (16, 16)), "grad_input": ((1, 16), (16, 16)), "grad_weight": ((1, 16), (16, 1))}
    assert all(op.precision == "high" and op.reason_kind == "shape" for op in report.find(site="inner.4"))
    assert "nvfp4" in str(report)


def test_graph_has_the_transform_on_wgrad_and_stochastic_rounding_on_gradients_only():
    cap = compile_captured(Wrapped(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))), Policy.from_recipe("nvfp4"))
    cap.compiled(torch.randn(40, 64, requires_grad=True)).sum().backward()
    casts = [n for g in cap.forward + cap.backward for n in g.graph.nodes if n.target == ops.cast_nvfp4.default]
    hadamards = [n for g in cap.forward + cap.backward for n in g.graph.nodes if n.target == ops.hadamard.default]
    # Two Linear sites: the wgrad GEMMs' operands are transformed (2 sites x 2 operands), and the
    # gradients are cast stochastically: each site's dgrad (the first site's input needs one) and wgrad.
    assert len(hadamards) == 4
    stochastic = [n for n in casts if n.args[3]]
    assert len(stochastic) == 4 and all(not n.args[3] for n in casts if n.args[2] == [16, 16])  # weights round to nearest
    off = Policy.from_recipe("nvfp4", stochastic_rounding=False, hadamard="none")
    cap = compile_captured(Wrapped(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))), off)
    cap.compiled(torch.randn(40, 64, requires_grad=True)).sum().backward()
    nodes = [n for g in cap.forward + cap.backward for n in g.graph.nodes]
    assert not any(n.target == ops.hadamard.default for n in nodes)
    assert not any(n.args[3] for n in nodes if n.target == ops.cast_nvfp4.default)


@pytest.mark.slow
def test_transformer_from_assets_trains_under_nvfp4():
    """tests/assets/transformer.py's TinyTransformer (2 blocks, dim 64), 4 AdamW steps. Measured on
    seeds 0-2: logits 15.0-16.0 dB, all first-step gradients together 15.5-16.2 dB (single
    LayerNorm parameters down to 6 dB: every FP4 GEMM behind them adds noise), losses within 0.4%
    of fp32's; the floors leave about 2 dB."""
    from fp8fx.tools.demo import TinyTransformer

    torch.manual_seed(0)
    model, reference = TinyTransformer(max_seq=32), TinyTransformer(max_seq=32)
    reference.load_state_dict(model.state_dict())
    cap = compile_captured(model, Policy.from_recipe("nvfp4"))
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=3e-3), torch.optim.AdamW(reference.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses, ref_losses = [], []
    for step in range(4):
        data = (torch.randint(0, 200, (8, 1), generator=g) + torch.arange(33) * 3) % 256
        x, y = data[:, :-1], data[:, 1:]
        out, ref_out = cap.compiled(x), reference(x)
        loss = nn.functional.cross_entropy(out.reshape(-1, 256), y.reshape(-1))
        ref_loss = nn.functional.cross_entropy(ref_out.reshape(-1, 256), y.reshape(-1))
        opt.zero_grad(), ref_opt.zero_grad()
        loss.backward(), ref_loss.backward()
        assert 13.0 < sqnr(out.detach(), ref_out.detach()) < 20.0
        if step == 0:
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            ref_grads = torch.cat([p.grad.flatten() for p in reference.parameters()])
            assert 13.5 < sqnr(grads, ref_grads) < 20.0
        opt.step(), ref_opt.step()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert all(abs(v - r) <= 0.01 * r for v, r in zip(losses, ref_losses)), (losses, ref_losses)
    assert fp8fx.report(cap.backend).summary()["fp8_gemms"] > 0


def test_inductor_and_dynamic_shapes_run_nvfp4():
    """The NVFP4 ops through Inductor (their fakes' strides are what its generated code asserts),
    and a dynamic token count (the transform pads it to 16) with the monitor sampling each cast."""
    torch.manual_seed(0)
    model = Wrapped(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)))
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(9), requires_grad=True)
    expected = model(x)
    compiled = torch.compile(model, backend=fp8fx.backend(policy=Policy.from_recipe("nvfp4"), inner="inductor"))
    out = compiled(x)
    out.square().mean().backward()
    assert NVFP4_OUTPUT_SQNR_DB[0] < sqnr(out.detach(), expected.detach()) < NVFP4_OUTPUT_SQNR_DB[1]
    assert torch.isfinite(x.grad).all()
    backend = fp8fx.backend(policy=Policy.from_recipe("nvfp4"), inner="eager", monitor_every=1)
    dynamic = torch.compile(
        Wrapped(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))), backend=backend, dynamic=True
    )
    for tokens in (40, 77):
        dynamic(torch.randn(tokens, 64)).sum().backward()
    samples = [s for series in backend.monitor.samples.values() for s in series]
    assert samples and all(math.isfinite(s.scale) and s.scale > 0 for s in samples)
    assert "inner.2.grad_weight.grad_output" in backend.monitor.samples  # the transformed, stochastically rounded gradient


def test_ops_agree_with_their_fakes():
    """torch.library.opcheck: schema, fake shapes and strides (a transposed operand included), and
    the ops under AOT autograd's dynamic shapes."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(40, 64, generator=g)
    for dim in (-1, -2):
        torch.library.opcheck(ops.hadamard, (x, dim))
        torch.library.opcheck(ops.hadamard, (x.t(), dim))
    amax = ops.amax(x, [1, 16])
    torch.library.opcheck(ops.nvfp4_scale, (amax,))
    scale, _ = ops.nvfp4_scale(amax)
    torch.library.opcheck(ops.cast_nvfp4, (x, scale, [1, 16], False))
    scale_t, _ = ops.nvfp4_scale(ops.amax(x.t(), [16, 1]))
    torch.library.opcheck(ops.cast_nvfp4, (x.t(), scale_t, [16, 1], False))


# ---------------------------------------------------------------- recipe and policy


def test_recipe_and_granularity_row():
    spec = GRANULARITIES[Granularity.NVFP4]
    assert (spec.left, spec.right, spec.weight_left, spec.weight_right, spec.align) == ((1, 16), (16, 1), (16, 16), (16, 16), 32)
    d = Policy.from_recipe("nvfp4").defaults
    assert (d.format.value, d.granularity, d.stochastic_rounding, d.hadamard) == (
        "nvfp4",
        Granularity.NVFP4,
        True,
        Hadamard.WGRAD,
    )
    assert RECIPES["nvfp4"]["hadamard"] == "wgrad"
    assert (Fp8Format.NVFP4.max, Fp8Format.NVFP4.dtype) == (6.0, torch.float8_e4m3fn)
    # Without the keys, granularity nvfp4 takes TE's defaults; other granularities have none.
    assert Settings(format="nvfp4", granularity="nvfp4").hadamard is Hadamard.WGRAD
    assert Settings(granularity="rowwise").stochastic_rounding is None


def test_shape_reason_names_nvfp4_alignment():
    cap = compile_captured(Wrapped(nn.Linear(48, 64)), Policy.from_recipe("nvfp4"))
    cap.compiled(torch.randn(8, 48))
    (op,) = cap.report.find(role="output")
    assert op.precision == "high" and "K=48 is not a multiple of 32" in op.reason and "nvfp4" in op.reason


def test_policy_yaml_nvfp4():
    p = policy_from_yaml("version: 1\nrecipe: nvfp4\ndefaults:\n  stochastic_rounding: false\n  hadamard: none\n")
    assert (p.defaults.stochastic_rounding, p.defaults.hadamard) == (False, Hadamard.NONE)
    assert p.to_dict()["defaults"]["hadamard"] == "none"
    assert policy_from_yaml("version: 1\ndefaults:\n  format: nvfp4\n  granularity: nvfp4\n").defaults.stochastic_rounding is True
    # A rule may change the NVFP4 keys of nvfp4 defaults, or leave NVFP4 (and its keys) behind.
    p = policy_from_yaml(
        "version: 1\nrecipe: nvfp4\nrules:\n  - match: a\n    hadamard: none\n"
        "  - match: b\n    format: e4m3\n    granularity: blockwise\n"
    )
    assert p.resolve(("a",), "mm").settings.hadamard is Hadamard.NONE
    b = p.resolve(("b",), "mm").settings
    assert (b.granularity, b.stochastic_rounding, b.hadamard) == (Granularity.BLOCKWISE, None, None)


@pytest.mark.parametrize(
    "text, key_path, line, fragment",
    [
        ("version: 1\nrecipe: nvfp4\ndefaults:\n  hadamard: fprop\n", "defaults.hadamard", 4, "expected none|wgrad, got 'fprop'"),
        (
            "version: 1\nrecipe: nvfp4\ndefaults:\n  stochastic_rounding: 1\n",
            "defaults.stochastic_rounding",
            4,
            "expected true or false",
        ),
        (
            "version: 1\ndefaults:\n  format: nvfp4\n",
            "defaults.granularity",
            3,
            "NVFP4 needs format nvfp4 with granularity nvfp4",
        ),
        ("version: 1\ndefaults:\n  granularity: nvfp4\n", "defaults.format", 3, "got format hybrid"),
        (
            "version: 1\nrecipe: rowwise\ndefaults:\n  hadamard: wgrad\n",
            "defaults.hadamard",
            4,
            "needs granularity nvfp4, not rowwise",
        ),
        (
            "version: 1\nrules:\n  - match: x\n    stochastic_rounding: true\n",
            "rules[0].stochastic_rounding",
            4,
            "needs granularity nvfp4",
        ),
        ("version: 1\nrecipe: nvfp4\ndefaults:\n  margin: 1\n", "defaults.margin", 4, "take no margin"),
        (
            "version: 1\nrecipe: nvfp4\ndefaults:\n  power_of_two_scales: true\n",
            "defaults.power_of_two_scales",
            4,
            "not powers of two",
        ),
        ("version: 1\nrecipe: nvfp4\ndefaults:\n  scaling: delayed\n", "defaults.scaling", 4, "needs granularity tensorwise"),
    ],
)
def test_policy_yaml_nvfp4_errors(text, key_path, line, fragment):
    assert_policy_yaml_error(text, key_path, line, fragment)


def test_python_api_nvfp4_errors():
    with pytest.raises(PolicyError, match="hadamard: applies to NVFP4 casts; it needs granularity nvfp4, not blockwise"):
        Policy.from_recipe("blockwise", hadamard="wgrad")
    with pytest.raises(PolicyError, match=r"rules\[0\]\.granularity: NVFP4 needs format nvfp4"):
        Policy(rules=(Rule(match="x", format="nvfp4"),))
