"""Numerics of an analysis (`fp8fx.analyze(..., calibration=...)`): the probes' stats and SQNR
against an independent quantization written here, crafted underflow and saturation, what-ifs,
and the suggested policy reproducing its decisions."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_llama
from torch import nn

import fp8fx
from fp8fx.tools.suggest import suggest_policy

E4M3 = torch.float8_e4m3fn


def independent_fp8(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Quantize-dequantize to E4M3 with the amax over `dim` (None: the whole tensor); per-row
    scales rounded down to powers of two, as the rowwise recipe (torchao's) does."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = (448.0 / amax.double()).float()
    if dim is not None:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (x * scale).clamp(-448, 448).to(E4M3).float() / scale


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    return 10 * math.log10(ref.square().sum().item() / (ref - approx).square().sum().item())


@pytest.mark.parametrize("recipe,dim", [("tensorwise", None), ("rowwise", 1)])
@pytest.mark.parametrize("m,k,n", [(16, 64, 32), (48, 128, 80), (32, 256, 16)])
def test_forward_sqnr_and_stats_match_an_independent_quantization(recipe, dim, m, k, n):
    torch.manual_seed(m + k + n)
    layer = nn.Linear(k, n, bias=False)
    x = torch.randn(m, k) * 3
    policy = fp8fx.Policy.from_recipe(recipe, format="e4m3")
    report = fp8fx.analyze(layer, (x,), policy, calibration=[(x,)])
    (op,) = report.ops
    ref = x.double() @ layer.weight.detach().double().t()
    approx = independent_fp8(x, dim).double() @ independent_fp8(layer.weight.detach(), dim).double().t()
    assert op.numerics.sqnr_db == pytest.approx(sqnr(ref, approx), abs=0.05)
    a, w = op.numerics.operands
    assert a.amax == pytest.approx(x.abs().max().item()) and w.amax == pytest.approx(layer.weight.abs().max().item())
    assert a.saturation_pct == 0 and w.saturation_pct == 0  # current scaling cannot saturate
    if recipe == "tensorwise":
        assert a.scale == pytest.approx(448 / x.abs().max().item(), rel=1e-6)


def test_underflow_is_counted_on_a_crafted_tensor():
    # One large value sets the tensorwise scale; the tiny ones fall below E4M3's smallest subnormal.
    x = torch.full((16, 32), 1e-6)
    x[0, 0] = 1e4
    report = fp8fx.analyze(nn.Linear(32, 16, bias=False), (x,), fp8fx.Policy.from_recipe("tensorwise"), calibration=[(x,)])
    left, _ = report.ops[0].numerics.operands
    assert left.underflow_pct == pytest.approx(100 * (x.numel() - 1) / x.numel())


def test_delayed_scaling_replays_its_history_and_counts_saturation():
    # Delayed scaling casts the first batch with the initial scale 1: |x| > 464 saturates in E4M3.
    # The second batch uses the first batch's amax, so the same values fit.
    x = torch.ones(16, 32)
    x[:3, :5] = 1000.0  # 15 values
    report = fp8fx.analyze(nn.Linear(32, 16, bias=False), (x,), fp8fx.Policy.from_recipe("delayed"), calibration=[(x,), (x,)])
    left, _ = report.ops[0].numerics.operands
    assert left.saturation_pct == pytest.approx(100 * 15 / (2 * x.numel()))
    assert report.ops[0].numerics.batches == 2


def test_training_numerics_cover_every_gemm_with_what_ifs():
    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    policy = fp8fx.Policy.from_recipe("tensorwise", rules=(fp8fx.Rule(match="lm_head", precision="high"),))
    report = fp8fx.analyze(model, (ids,), policy, train=True, calibration=[(ids,)])
    linear = [op for op in report.ops if op.op in ("mm", "addmm")]
    assert linear and all(op.numerics is not None for op in linear)
    for op in linear:
        what_if = op.numerics.what_if
        assert set(what_if) == set(fp8fx.core.recipes.RECIPES)
        if op.precision == "fp8":
            assert 10 < op.numerics.sqnr_db < 60
            assert what_if["tensorwise"] == pytest.approx(op.numerics.sqnr_db)  # the chosen recipe
        else:  # lm_head: kept high, its FP8 what-ifs still measured
            assert op.numerics.sqnr_db is None and op.numerics.operands is None and what_if["tensorwise"] is not None
        # rowwise_gw_hp keeps weight gradients high
        assert (what_if["rowwise_gw_hp"] is None) == (op.role == "grad_weight")
    assert report.summary()["numerics_batches"] == 1
    # the numerics run does not change the report's decisions or fusion
    plain = fp8fx.analyze(model, (ids,), policy, train=True)
    assert sorted((o.site, o.role, o.precision, o.epilogue or "") for o in plain.ops) == sorted((o.site, o.role, o.precision, o.epilogue or "") for o in report.ops)


def test_numerics_need_real_weights():
    with torch.device("meta"):
        layer = nn.Linear(32, 32)
    with pytest.raises(ValueError, match="numerics need real weights"):
        fp8fx.analyze(layer, (torch.randn(4, 32, device="meta"),), calibration=[(torch.randn(4, 32),)])


def test_suggested_policy_keeps_low_sqnr_gemms_high_and_reproduces_decisions():
    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    policy = fp8fx.Policy.from_recipe("tensorwise", rules=(fp8fx.Rule(match="lm_head", precision="high"), fp8fx.Rule(match="*mlp*", format="e4m3")))
    report = fp8fx.analyze(model, (ids,), policy, train=True, calibration=[(ids,)])
    threshold = sorted(op.numerics.sqnr_db for op in report.fp8_ops)[len(report.fp8_ops) // 3]  # flag a third
    text, added = suggest_policy(report, policy, min_sqnr_db=threshold)
    flagged = {(op.site, op.role) for op in report.fp8_ops if op.numerics.sqnr_db < threshold}
    assert flagged and added >= 1 and "SQNR" in text and "# the analysed policy's own rules" in text
    again = fp8fx.analyze(model, (ids,), fp8fx.policy_from_yaml(text), train=True)
    after_by_gemm = {(op.site, op.role): op for op in again.ops}
    assert len(after_by_gemm) == len(report.ops)
    for before in report.ops:
        after = after_by_gemm[(before.site, before.role)]
        expected = "high" if (before.site, before.role) in flagged else before.precision
        assert after.precision == expected, (after.site, after.role, after.reason)
        if after.precision == "fp8":
            assert after.formats == before.formats  # the copied rule keeps the mlp's e4m3


def test_progress_reports_every_stage_to_completion():
    calls = []
    x = torch.randn(8, 32)
    fp8fx.analyze(nn.Linear(32, 32), (x,), train=True, calibration=[(x,)] * 3, progress=lambda *a: calls.append(a))
    assert [c for c in calls if c[1] == c[2]] == [("analysis", 1, 1), ("baseline", 1, 1), ("numerics", 3, 3)]
    assert ("numerics", 0, 3) in calls and ("numerics", 2, 3) in calls
