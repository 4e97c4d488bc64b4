"""The MXFP8 recipe: E4M3 data with one E8M0 (power-of-two) scale per 1x32 block along K, checked
bit for bit against torchao's MX implementation (torchao.prototype.mx_formats), through the graph
passes (alignment to 32, report rows) and in the policy file."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

from fp8fx.codegen.dispatch import scaled_mm_kind
from fp8fx.core import scaling
from fp8fx.core.policy import Policy, PolicyError, Rule, Settings
from fp8fx.core.policy_yaml import policy_from_yaml
from fp8fx.core.recipes import GRANULARITIES, RECIPES, Granularity, ScaleRounding
from fp8fx.ops import reference
from tests.helpers import assert_policy_yaml_error, compile_captured, sqnr

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
MODES = ("floor", "rceil")
ops = torch.ops.fp8fx


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    cases = {"normal": torch.randn(64, 256, generator=g)}
    # Per-element magnitudes from 2**-100 to 2**100: every block has its own scale exponent.
    wide = torch.randn(48, 128, generator=g) * torch.exp2((torch.randn(48, 128, generator=g) * 30).clamp(-100, 100))
    cases["wide_range"] = wide
    cases["zeros"] = torch.zeros(32, 64)
    with_zero_block = torch.randn(32, 128, generator=g)
    with_zero_block[5, 32:64] = 0.0
    cases["zero_block"] = with_zero_block
    # One element at 1 per block, the rest land in E4M3's subnormals (below 2**-6 once scaled).
    sub = torch.randn(32, 96, generator=g) * 2e-4
    sub[:, ::32] = 1.0
    cases["e4m3_subnormals"] = sub
    cases["tiny_fp32"] = torch.randn(16, 64, generator=g) * 1e-30  # normal fp32, scales near 2**100
    # Block maxima exactly at E4M3's max times a power of two, and just past it (FLOOR saturates them).
    at_max = torch.randn(32, 128, generator=g)
    at_max[:, 0] = E4M3_MAX
    at_max[:, 33] = -E4M3_MAX * 2.0**-5
    at_max[:, 64] = 480.0
    at_max[:, 100] = 511.9
    cases["at_e4m3_max"] = at_max
    cases["bf16_3d"] = torch.randn(2, 32, 160, generator=g).to(torch.bfloat16) * 7
    return cases


CASES = _cases()


def _torchao_mx(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's E8M0 exponents (biased, as int32, one per 32 of the last dim) and E4M3 bytes."""
    e8m0, data = to_mx(x.contiguous(), E4M3, 32, ScaleCalculationMode(mode))
    return e8m0.view(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] // 32).to(torch.int32), data.view(torch.uint8)


def _fp8fx_mx(x: torch.Tensor, mode: str, block: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8fx's MX cast through its ops: (biased E8M0 exponents, E4M3 bytes, scale)."""
    amax = ops.amax(x, block)
    scale = scaling.amax_to_scale(amax, E4M3_MAX, rounding=mode)
    data = ops.cast(x, scale, E4M3, block)
    exponent = scaling.E8M0_BIAS - (((scale.view(torch.int32) >> 23) & 0xFF) - scaling.E8M0_BIAS)  # scale = 2**-exponent
    return exponent, data.view(torch.uint8), scale


# ---------------------------------------------------------------- the cast, bit for bit


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_mx_cast_matches_torchao_bit_for_bit(case, mode):
    x = CASES[case]
    ref_e8m0, ref_data = _torchao_mx(x, mode)
    e8m0, data, _ = _fp8fx_mx(x, mode, [1, 32])
    assert torch.equal(e8m0, ref_e8m0)
    assert torch.equal(data, ref_data)
    # The right operand (K x N) takes 32x1 blocks: the same cast as torchao's of its transpose.
    if x.dim() == 2:
        e8m0_t, data_t, _ = _fp8fx_mx(x.t().contiguous(), mode, [32, 1])
        assert torch.equal(e8m0_t.t(), ref_e8m0)
        assert torch.equal(data_t.t(), ref_data)


@pytest.mark.parametrize("case", list(CASES))
def test_graph_scales_are_rceil(case):
    """Compiled graphs compute MX scales as amax_to_scale(amax, fp8_max, 0, power_of_two=True):
    the same bytes as torchao's RCEIL, and the same exponents for every nonzero block (a zero
    block keeps scale 1 there; its data is zero either way)."""
    x = CASES[case]
    ref_e8m0, ref_data = _torchao_mx(x, "rceil")
    amax = ops.amax(x, [1, 32])
    scale = ops.amax_to_scale(amax, E4M3_MAX, 0, True)
    assert torch.equal(ops.cast(x, scale, E4M3, [1, 32]).view(torch.uint8), ref_data)
    nonzero = amax > 0
    assert torch.equal(scale[nonzero], scaling.amax_to_scale(amax, E4M3_MAX, rounding="rceil")[nonzero])
    exponent = scaling.E8M0_BIAS - (((scale.view(torch.int32) >> 23) & 0xFF) - scaling.E8M0_BIAS)
    assert torch.equal(exponent[nonzero], ref_e8m0[nonzero])


def test_rounding_modes_differ_as_specified():
    amax = torch.tensor([1.0, 1.5, 448.0, 480.0, 0.0, 2.0**-130])
    # FLOOR: floor(log2(amax)) - 8; RCEIL: ceil(log2(amax / 448)); both clamped to [-127, 127].
    assert scaling.e8m0_exponent(amax, E4M3_MAX, "floor").tolist() == [-8, -8, 0, 0, -127, -127]
    assert scaling.e8m0_exponent(amax, E4M3_MAX, "rceil").tolist() == [-8, -8, 0, 1, -127, -127]
    # RCEIL's ceil is exact (as cvt.rp.satfinite.ue8m0x2.f32): a quotient one ulp above 2**10
    # rounds up, so that block's largest value does not saturate.
    above = torch.tensor([E4M3_MAX * 2.0**10]).nextafter(torch.tensor([math.inf]))
    assert scaling.e8m0_exponent(above, E4M3_MAX, "rceil").item() == 11
    assert scaling.mx_scale(torch.tensor([math.inf, math.nan]), E4M3_MAX, "floor").tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="floor or rceil"):
        scaling.e8m0_exponent(amax, E4M3_MAX, "even")


# ---------------------------------------------------------------- the GEMM


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(64, 96, 128), (32, 64, 256)])
def test_mx_gemm_matches_torchao_dequantize_then_matmul(shape, mode):
    m, n, k = shape
    g = torch.Generator().manual_seed(1)
    a = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)  # outlier channels: blocks matter
    w = torch.randn(n, k, generator=g)
    b = w.t()
    _, _, sa = _fp8fx_mx(a, mode, [1, 32])
    _, _, sb = _fp8fx_mx(b, mode, [32, 1])
    qa, qb = ops.cast(a, sa, E4M3, [1, 32]), ops.cast(b, sb, E4M3, [32, 1])
    out = ops.scaled_mm(qa, qb, sa.reciprocal(), sb.reciprocal(), None, torch.float32, [1, 32], [32, 1])

    ea, da = to_mx(a, E4M3, 32, ScaleCalculationMode(mode))
    ew, dw = to_mx(w, E4M3, 32, ScaleCalculationMode(mode))
    a_dq = to_dtype(da, ea, E4M3, 32, torch.float32)
    w_dq = to_dtype(dw, ew, E4M3, 32, torch.float32)
    # The operands fp8fx multiplies are exactly torchao's dequantized ones...
    assert torch.equal(qa.float() * reference.scaling.expand_blocks(sa.reciprocal(), (1, 32), a.shape), a_dq)
    assert torch.equal((qb.float() * reference.scaling.expand_blocks(sb.reciprocal(), (32, 1), b.shape)).t(), w_dq)
    # ...so the products differ only in fp32 summation order (fp8fx adds one scaled partial
    # product per 32 of K, torchao one matmul): within the worst-case bound 2 * K * 2**-24 of
    # the sum of |products|. Measured: at most 1.5 * 2**-24 of it, SQNR 146-149 dB.
    expected = a_dq @ w_dq.t()
    magnitude = a_dq.abs() @ w_dq.abs().t()
    assert ((out - expected).abs() <= k * 2.0**-23 * magnitude).all()
    assert ((out - expected).abs() <= 4 * 2.0**-24 * magnitude).all()
    assert sqnr(out, expected) > 130


# ---------------------------------------------------------------- compiled training


class Mlp(nn.Module):
    """The first layer has K=48, which MX's 32-element blocks cannot tile."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(48, 64)
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 32)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(torch.nn.functional.gelu(self.inp(x)))))


# Measured on this model with seeds 0-2 (E4M3 everywhere: 3 mantissa bits): outputs 26.8-29.4 dB
# over 8 steps, gradients at the first step 25.4-28.5 dB (the last bias, 40-45 dB); the floors
# leave 2-3 dB of margin. Losses stay within 0.05% of fp32's; the bound below is 1%.
MX_OUTPUT_SQNR_DB = 24.0
MX_GRAD_SQNR_DB = 22.0


def test_mlp_trains_under_mxfp8_close_to_fp32():
    torch.manual_seed(0)
    model = Mlp()
    reference_model = Mlp()
    reference_model.load_state_dict(model.state_dict())
    cap = compile_captured(model, Policy.from_recipe("mxfp8"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference_model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    target_w = torch.randn(32, 48, generator=g) / 7
    x = torch.randn(64, 48, generator=g)
    y = x @ target_w.t()
    losses, ref_losses = [], []
    for step in range(8):
        out, ref_out = cap.compiled(x), reference_model(x)
        loss, ref_loss = ((out - y) ** 2).mean(), ((ref_out - y) ** 2).mean()
        opt.zero_grad(), ref_opt.zero_grad()
        loss.backward(), ref_loss.backward()
        assert sqnr(out.detach(), ref_out.detach()) > MX_OUTPUT_SQNR_DB
        if step == 0:
            for (name, p), ref_p in zip(model.named_parameters(), reference_model.parameters()):
                assert sqnr(p.grad, ref_p.grad) > MX_GRAD_SQNR_DB, name
        opt.step(), ref_opt.step()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert all(abs(v - r) <= 0.01 * r for v, r in zip(losses, ref_losses)), (losses, ref_losses)
    assert all(b < a for a, b in itertools.pairwise(losses)), losses

    report = cap.report
    fp8 = report.fp8_ops
    assert {(op.site, op.role) for op in fp8} == {(s, r) for s in ("fc1", "fc2") for r in ("output", "grad_input", "grad_weight")}
    assert all(op.granularity == "mx" and op.blocks == ((1, 32), (32, 1)) and op.power_of_two_scales for op in fp8)
    inp = report.find(site="inp")
    assert inp and all(op.precision == "high" and op.reason_kind == "shape" for op in inp)
    assert all("K=48 is not a multiple of 32" in op.reason for op in inp)


def test_scaled_mm_is_not_claimed_for_mx_blocks():
    assert scaled_mm_kind([1, 32], [32, 1]) is None
    assert scaled_mm_kind([1, 128], [128, 128]) == "blockwise"


@pytest.mark.parametrize("mode", MODES)
def test_compiled_mx_linear_matches_torchao(mode):
    """The compiled graph's MX GEMMs, forward and both backward ones, against torchao's
    dequantize-then-matmul with the same scale rounding."""
    lin = nn.Linear(96, 64, bias=False)
    g = torch.Generator().manual_seed(2)
    # Scaled so that FLOOR and RCEIL pick different exponents for many blocks.
    x, grad_out = torch.randn(32, 96, generator=g) * 3, torch.randn(32, 64, generator=g)
    x.requires_grad_(True)
    cap = compile_captured(lin, Policy.from_recipe("mxfp8", scale_rounding=mode))
    out = cap.compiled(x)
    out.backward(grad_out)
    assert {op.scale_rounding for op in cap.report.fp8_ops} == {mode}

    def mx(t):  # MX blocks of 32 along t's last dim, dequantized as torchao does
        e, d = to_mx(t.detach().contiguous(), E4M3, 32, ScaleCalculationMode(mode))
        return to_dtype(d, e, E4M3, 32, torch.float32)

    w = lin.weight.detach()
    # Each GEMM's operands blocked along its own K: forward K=96, grad_input K=64 (N of the
    # forward), grad_weight K=32 (the tokens).
    products = {
        "output": (out, mx(x), mx(w)),
        "grad_input": (x.grad, mx(grad_out), mx(w.t())),
        "grad_weight": (lin.weight.grad, mx(grad_out.t()), mx(x.detach().t())),
    }
    for role, (got, a, b) in products.items():
        expected = a @ b.t()
        bound = a.shape[1] * 2.0**-23 * (a.abs() @ b.abs().t())
        assert ((got.detach() - expected).abs() <= bound).all(), role


def test_floor_and_rceil_differ_in_a_compiled_graph():
    """FLOOR's scales are a power of two larger than RCEIL's for blocks whose amax is not E4M3's
    max times a power of two: the same input gives other FP8 values."""
    lin = nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    outs = {}
    for mode in MODES:
        with torch.no_grad():
            outs[mode] = compile_captured(lin, Policy.from_recipe("mxfp8", scale_rounding=mode)).compiled(x)
        torch._dynamo.reset()
    assert not torch.equal(outs["floor"], outs["rceil"])
    assert sqnr(outs["floor"], lin(x).detach()) > MX_OUTPUT_SQNR_DB


# ---------------------------------------------------------------- recipe and policy


def test_recipe_and_granularity_row():
    spec = GRANULARITIES[Granularity.MX]
    assert (spec.left, spec.right, spec.weight_left, spec.weight_right, spec.align) == ((1, 32), (32, 1), (1, 32), (32, 1), 32)
    assert all(GRANULARITIES[g].align == 16 for g in Granularity if g not in (Granularity.MX, Granularity.NVFP4))
    d = Policy.from_recipe("mxfp8").defaults
    assert (d.format.value, d.granularity, d.scale_rounding) == ("e4m3", Granularity.MX, ScaleRounding.RCEIL)
    assert RECIPES["mxfp8"]["scale_rounding"] == "rceil"  # torchao's MXFP8 training default
    assert Settings(granularity="mx").scale_rounding is ScaleRounding.RCEIL
    assert Settings(granularity="rowwise").scale_rounding is None


def test_policy_yaml_mxfp8():
    p = policy_from_yaml("version: 1\nrecipe: mxfp8\ndefaults:\n  scale_rounding: rceil\n")
    assert (p.defaults.granularity, p.defaults.scale_rounding) == (Granularity.MX, ScaleRounding.RCEIL)
    p = policy_from_yaml("version: 1\nrecipe: mxfp8\ndefaults:\n  scale_rounding: FLOOR\n")
    assert p.defaults.scale_rounding is ScaleRounding.FLOOR
    assert p.to_dict()["defaults"]["scale_rounding"] == "floor"
    assert policy_from_yaml("version: 1\ndefaults:\n  granularity: mx\n").defaults.scale_rounding is ScaleRounding.RCEIL
    # A rule may change the rounding of mx defaults, or leave mx (and its rounding) behind.
    p = policy_from_yaml(
        "version: 1\nrecipe: mxfp8\nrules:\n  - match: a\n    scale_rounding: floor\n  - match: b\n    granularity: rowwise\n"
    )
    assert p.resolve(("a",), "mm").settings.scale_rounding is ScaleRounding.FLOOR
    b = p.resolve(("b",), "mm").settings
    assert (b.granularity, b.scale_rounding) == (Granularity.ROWWISE, None)


@pytest.mark.parametrize(
    "text, key_path, line, fragment",
    [
        (
            "version: 1\nrecipe: mxfp8\ndefaults:\n  scale_rounding: nearest\n",
            "defaults.scale_rounding",
            4,
            "expected floor|rceil, got 'nearest'",
        ),
        (
            "version: 1\nrecipe: rowwise\ndefaults:\n  scale_rounding: floor\n",
            "defaults.scale_rounding",
            4,
            "needs granularity mx, not rowwise",
        ),
        (
            "version: 1\ndefaults:\n  scale_rounding: rceil\n",
            "defaults.scale_rounding",
            3,
            "needs granularity mx, not tensorwise",
        ),
        (
            "version: 1\nrules:\n  - match: x\n    scale_rounding: floor\n",
            "rules[0].scale_rounding",
            4,
            "needs granularity mx, not tensorwise",
        ),
        ("version: 1\nrecipe: mxfp8\ndefaults:\n  margin: 1\n", "defaults.margin", 4, "take no margin"),
    ],
)
def test_policy_yaml_scale_rounding_errors(text, key_path, line, fragment):
    assert_policy_yaml_error(text, key_path, line, fragment)


def test_python_api_scale_rounding_errors():
    with pytest.raises(
        PolicyError, match="scale_rounding: rounds MX's E8M0 block scales; it needs granularity mx, not blockwise"
    ):
        Policy.from_recipe("blockwise", scale_rounding="floor")
    with pytest.raises(PolicyError, match=r"rules\[0\]\.scale_rounding: .*needs granularity mx"):
        Policy(rules=(Rule(match="x", scale_rounding="rceil"),))
