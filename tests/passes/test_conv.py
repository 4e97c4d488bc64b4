"""Convolutions are report rows: op kind `conv`, `output` for the forward and `grad_input` /
`grad_weight` for what `convolution_backward` computes, kept high with reason kind `conv`, their
implicit-GEMM FLOPs counted in the FP8 share and the coverage check."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import compile_captured, sqnr
from torch import nn

import fp8fx
from fp8fx.reporting.costmodel import gpu
from fp8fx.reporting.html import render_html


class PatchEmbed(nn.Module):
    """ViT's front: 8x8 patches of a 3-channel image to 64 features, then a linear layer."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 64, 8, stride=8)
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        return self.proj(self.patch(x).flatten(2).transpose(1, 2))


OPERANDS = {"output": ("input", "weight"), "grad_input": ("grad_output", "weight"), "grad_weight": ("input", "grad_output")}


def conv_flops(n, c_out, out_positions, c_in, groups, kernel_taps) -> int:
    return 2 * n * c_out * out_positions * (c_in // groups) * kernel_taps


def test_patch_embedding_conv_rows_flops_share_and_coverage():
    torch.manual_seed(0)
    model = PatchEmbed()
    reference = copy.deepcopy(model)
    backend = fp8fx.backend(inner="eager")
    compiled = torch.compile(model, backend=backend)
    image = torch.randn(2, 3, 32, 32, requires_grad=True)
    image_ref = image.detach().clone().requires_grad_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled(image).square().mean().backward()
    reference(image_ref).square().mean().backward()
    opt.step()
    # The convolution's gradients still come out right next to the FP8 linear layer.
    assert sqnr(image.grad, image_ref.grad) > 20 and sqnr(model.patch.weight.grad, reference.patch.weight.grad) > 20

    report = fp8fx.report(backend)
    conv = {op.role: op for op in report.find(site="patch")}
    assert set(conv) == {"output", "grad_input", "grad_weight"}
    flops = conv_flops(2, 64, 4 * 4, 3, 1, 8 * 8)
    assert {role: op.flops for role, op in conv.items()} == dict.fromkeys(conv, flops)
    # Implicit GEMM: M = batch x output positions, N = C_out, K = C_in x kernel taps; backward transposes it.
    assert (conv["output"].m, conv["output"].n, conv["output"].k, conv["output"].batch) == (32, 64, 192, 1)
    assert (conv["grad_input"].m, conv["grad_input"].n, conv["grad_input"].k) == (32, 192, 64)
    assert (conv["grad_weight"].m, conv["grad_weight"].n, conv["grad_weight"].k) == (192, 64, 32)
    for op in conv.values():
        assert (op.op, op.precision, op.reason_kind) == ("conv", "high", "conv")
        assert op.operands == OPERANDS[op.role]
    assert conv["output"].reason == (
        "aten.convolution(float32[2, 3, 32, 32], float32[64, 3, 8, 8], float32[64]) -> float32[2, 64, 4, 4]: "
        "convolution: fp8fx runs convolutions in high precision; its patches do not overlap: add conv_patch to ops to run it in FP8"
    )
    assert all(op.reason.endswith("add conv_patch to ops to run it in FP8") for op in conv.values())
    linear = report.find(site="proj")
    assert len(linear) == 3 and all(op.precision == "fp8" for op in linear)
    linear_flops = 2 * 32 * 64 * 64
    summary = report.summary()
    assert summary["fp8_flop_share_forward"] == pytest.approx(linear_flops / (linear_flops + flops))
    assert summary["fp8_flop_share_backward"] == pytest.approx(2 * linear_flops / (2 * linear_flops + 2 * flops))
    assert summary["fallbacks_by_reason"] == {"conv": 3}
    share = linear_flops / (linear_flops + flops)
    fp8fx.assert_coverage(report, share - 0.01)
    with pytest.raises(fp8fx.CoverageError, match=r"largest high-precision GEMMs: patch\.\w+ \(conv: aten\.convolution"):
        fp8fx.assert_coverage(report, share + 0.01)
    # The convolution's output is GEMM work, not the module's elementwise traffic.
    assert "patch" not in report.non_gemm_bytes
    # A prediction like any GEMM kept high; the HTML report lists the rows.
    predicted = report.with_predictions("h100").find(site="patch")
    assert all(op.predicted.bf16_us == op.predicted.fp8_us > 0 for op in predicted)
    assert render_html(report.to_dict()).count("<td>conv</td>") == 3


def test_depthwise_conv1d_reason_in_training_and_inference():
    torch.manual_seed(0)
    conv = nn.Conv1d(16, 16, 4, groups=16, padding=3)  # Mamba's causal depthwise conv
    backend = fp8fx.backend(inner="eager")
    compiled = torch.compile(conv, backend=backend)
    x = torch.randn(2, 16, 32)  # not requiring grad: no grad_input
    compiled(x).sum().backward()
    with torch.no_grad():
        compiled(x)
    report = fp8fx.report(backend)
    rows = {(op.graph_kind, op.role): op for op in report.ops}
    assert set(rows) == {("training", "output"), ("training", "grad_weight"), ("inference", "output")}
    flops = conv_flops(2, 16, 35, 16, 16, 4)
    for op in rows.values():
        assert (op.op, op.precision, op.reason_kind, op.flops, op.batch) == ("conv", "high", "conv", flops, 16)
        assert "convolution (depthwise: groups == C_in == 16; overlapping windows: stride 1 < kernel 4; padded: padding 3): " in op.reason
    assert rows["inference", "output"].reason.startswith("aten.convolution(float32[2, 16, 32], float32[16, 1, 4], float32[16]) -> float32[2, 16, 35]")
    assert rows["training", "grad_weight"].reason.startswith("aten.convolution_backward(")
    # Sixteen 70 x 1 x 4 GEMMs in one memory-bound kernel, not sixteen waves of 128 x 128 tiles.
    h100 = gpu("h100")
    predicted = report.with_predictions(h100).find(role="output")[0].predicted
    assert predicted.bf16_us == predicted.fp8_us < h100.gemm_us(70, 1, 4, 16, h100.bf16_tflops, 2)


def test_numerics_analysis_skips_convolutions():
    torch.manual_seed(0)
    image = torch.randn(2, 3, 32, 32)
    report = fp8fx.analyze(PatchEmbed(), (image,), calibration=[(image,)])
    assert {op.site: op.numerics is not None for op in report.ops} == {"patch": False, "proj": True}


def test_conv_flops_match_torch_flop_counter():
    """Transposed, grouped, dilated and padded convolutions count the FLOPs torch's FlopCounterMode
    counts (its backward count multiplies a grouped conv's grad_weight by the groups, so the backward
    is compared for the ungrouped conv and checked equal to the forward for the others)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    convs = [nn.ConvTranspose1d(8, 16, 3, stride=2, groups=2), nn.Conv1d(16, 16, 5, padding=2, dilation=2, groups=4), nn.Conv1d(16, 8, 5, padding=2)]
    model = nn.Sequential(*convs)
    x = torch.randn(2, 8, 10, requires_grad=True)
    counted = []
    for conv in convs:  # each conv alone, on the input it gets in the model
        x = x.detach().requires_grad_()
        with FlopCounterMode(display=False) as counter:
            y = conv(x)
            y.sum().backward()
        counted.append({str(op): n for op, n in counter.get_flop_counts()["Global"].items()})
        x = y
    backend = fp8fx.backend(inner="eager")
    torch.compile(model, backend=backend)(torch.randn(2, 8, 10, requires_grad=True)).sum().backward()
    report = fp8fx.report(backend)
    for i, flops in enumerate(counted):
        rows = {op.role: op.flops for op in report.find(site=str(i))}
        assert rows == dict.fromkeys(("output", "grad_input", "grad_weight"), flops["aten.convolution"])
    assert 2 * report.find(site="2", role="output")[0].flops == counted[2]["aten.convolution_backward"]
    assert "(transposed; grouped: groups=2; overlapping windows: stride 2 < kernel 3)" in report.find(site="0")[0].reason
    assert "(grouped: groups=4; overlapping windows: stride 1 < kernel 5; padded: padding 2; dilated: dilation 2)" in report.find(site="1")[0].reason


def convolutions(graphs) -> int:
    conv_ops = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
    return sum(n.target in conv_ops for g in graphs for n in g.graph.nodes)


def test_patch_conv_runs_in_fp8_as_gemms():
    """With conv_patch in ops, a patch embedding's convolution becomes an addmm and its backward
    two mms, all FP8, with the FP8 error of any GEMM against eager's convolution."""
    torch.manual_seed(0)
    model = PatchEmbed()
    reference = copy.deepcopy(model)
    captured = compile_captured(model, fp8fx.Policy(defaults=fp8fx.Settings(ops=("mm", "addmm", "conv_patch"))))
    image = torch.randn(2, 3, 32, 32, requires_grad=True)
    image_ref = image.detach().clone().requires_grad_()
    out = captured.compiled(image)
    out.square().mean().backward()
    expected = reference(image_ref)
    expected.square().mean().backward()
    for actual, ref in ((out, expected), (image.grad, image_ref.grad), (model.patch.weight.grad, reference.patch.weight.grad)):
        assert 20 < sqnr(actual, ref) < 40
    assert sqnr(model.patch.bias.grad, reference.patch.bias.grad) > 20

    assert convolutions(captured.forward + captured.backward) == 0
    assert captured.scaled_mm_nodes() == 6  # three GEMMs of the patch conv, three of the linear layer
    conv = {op.role: op for op in captured.report.find(site="patch")}
    assert set(conv) == {"output", "grad_input", "grad_weight"}
    for op in conv.values():
        assert (op.op, op.precision, op.flops) == ("conv_patch", "fp8", conv_flops(2, 64, 4 * 4, 3, 1, 8 * 8))
    assert (conv["output"].m, conv["output"].n, conv["output"].k) == (32, 64, 192)
    assert conv["output"].operands == ("input", "weight") and conv["grad_input"].operands == ("grad_output", "weight")


def test_conv_patch_lowers_conv1d_and_leaves_overlapping_convs_high():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(16, 32, 4, stride=4), nn.Conv1d(32, 32, 3, stride=2))
    captured = compile_captured(model, fp8fx.Policy(defaults=fp8fx.Settings(ops=("conv_patch",))))
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        assert 20 < sqnr(captured.compiled(x), model(x)) < 40
    rows = {op.site: op for op in captured.report.ops}
    assert (rows["0"].op, rows["0"].precision) == ("conv_patch", "fp8")
    assert (rows["1"].op, rows["1"].precision, rows["1"].reason_kind) == ("conv", "high", "conv")
    assert rows["1"].reason.endswith("convolution (overlapping windows: stride 2 < kernel 3): fp8fx runs convolutions in high precision")
    assert convolutions(captured.forward) == 1
