"""End to end: real models train under fp8fx; every linear GEMM of forward and backward is FP8,
the graph agrees with the report, and the numerics stay close to fp32 eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import GRAD_SQNR_DB, OUTPUT_SQNR_DB, compile_captured, sqnr, tiny_gpt2, tiny_llama
from torch import nn

import fp8fx
from fp8fx.tools.demo import TinyTransformer


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


MODELS = {
    "transformer": lambda: TinyTransformer(vocab=256, dim=64, heads=4, layers=2, max_seq=32),
    "gpt2": tiny_gpt2,
    "llama": tiny_llama,
}


@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_with_every_linear_gemm_in_fp8(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    reference = copy.deepcopy(model)
    cap = compile_captured(model)
    tokens = torch.randint(0, 256, (2, 32))

    # One step compared with fp32 eager on identical weights.
    out = _logits(cap.compiled(tokens))
    out.float().pow(2).mean().backward()
    ref = _logits(reference(tokens))
    ref.float().pow(2).mean().backward()
    assert sqnr(out, ref) >= OUTPUT_SQNR_DB
    for (pname, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        if p.dim() == 2 and r.grad is not None and r.grad.abs().sum() > 0:
            assert sqnr(p.grad, r.grad) >= GRAD_SQNR_DB, pname

    report = cap.report
    linear_ops = [op for op in report.ops if op.op in ("mm", "addmm")]
    sites = {op.site for op in linear_ops}
    n_linear_modules = sum(isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D" for m in model.modules())
    assert len(sites) == n_linear_modules
    # Every linear site has its three GEMMs (token embeddings require grad, so grad_input exists too).
    assert len(linear_ops) == 3 * n_linear_modules
    assert all(op.precision == "fp8" for op in linear_ops), [op for op in linear_ops if op.precision != "fp8"]
    assert {op.role for op in linear_ops} == {"output", "grad_input", "grad_weight"}
    # The graph agrees with the report: one FP8 GEMM node per FP8 decision.
    assert cap.scaled_mm_nodes() == len(report.fp8_ops)
    # Nothing undecided: every matmul that is not FP8 says why.
    assert all(op.reason for op in report.ops)

    # A few more steps with an optimizer: losses stay finite.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        loss = F.cross_entropy(_logits(cap.compiled(tokens)).flatten(0, 1), tokens.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)


def test_backward_consumes_fp8_tensors_saved_by_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    cap = compile_captured(model, weight_fp8="keep")  # (the default casts the weights again in backward)
    x = torch.randn(4, 16, 64, requires_grad=True)
    cap.compiled(x).sum().backward()
    (bw,) = cap.backward
    saved = [n.meta["val"] for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    fp8_saved = [t for t in saved if t.dtype == torch.float8_e4m3fn]
    # Both weights and both layer inputs are saved as E4M3 (x, gelu output, w1, w2) ...
    assert len(fp8_saved) == 4
    # ... and no fp32 tensor of a GEMM operand's size is saved: the GELU input (the fused GEMM's
    # pre-activation output) is kept in BF16 (fp8fx.passes.saved_outputs).
    assert not [t for t in saved if t.dtype == torch.float32 and t.dim() >= 2]
    assert [t.numel() for t in saved if t.dtype == torch.bfloat16] == [64 * 128]
    # Backward casts only the incoming gradients (E5M2), never re-casts a forward tensor.
    casts = [n for n in bw.graph.nodes if n.target == torch.ops.fp8fx.cast.default]
    assert casts and all(n.args[2] == torch.float8_e5m2 for n in casts)


def test_weight_cast_is_shared_by_output_and_grad_input():
    model = nn.Linear(32, 48, bias=False)
    cap = compile_captured(model, weight_fp8="keep")
    cap.compiled(torch.randn(16, 32, requires_grad=True)).sum().backward()
    fw, bw = cap.forward[0], cap.backward[0]
    e4m3_casts = [n for g in (fw, bw) for n in g.graph.nodes if n.target == torch.ops.fp8fx.cast.default and n.args[2] == torch.float8_e4m3fn]
    assert len(e4m3_casts) == 2  # one for x, one for w - not one per GEMM
    # The default (weight_fp8="auto", dynamic scaling) casts w again in backward for grad_input.
    cap = compile_captured(nn.Linear(32, 48, bias=False))
    cap.compiled(torch.randn(16, 32, requires_grad=True)).sum().backward()
    e4m3_in_backward = [n for n in cap.backward[0].graph.nodes if n.target == torch.ops.fp8fx.cast.default and n.args[2] == torch.float8_e4m3fn]
    assert len(e4m3_in_backward) == 1


def test_autocast_bf16_training_casts_master_weights_directly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    reference = copy.deepcopy(model)
    cap = compile_captured(model)
    x = torch.randn(8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cap.compiled(x)
        ref = reference(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    assert sqnr(out, ref) >= OUTPUT_SQNR_DB
    assert len(cap.report.fp8_ops) == 5  # 2 outputs, 2 grad_weights, 1 grad_input
    # The FP8 cast reads the fp32 parameter, not its bf16 copy.
    casts = [n for n in cap.forward[0].graph.nodes if n.target == torch.ops.fp8fx.cast.default]
    assert any(n.args[0].op == "placeholder" and n.args[0].meta["val"].dtype == torch.float32 for n in casts)


def test_inference_under_no_grad():
    torch.manual_seed(0)
    model = TinyTransformer(layers=2, max_seq=32)
    cap = compile_captured(model)
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        out = cap.compiled(tokens)
        ref = model(tokens)
    report = cap.report
    assert {op.graph_kind for op in report.ops} == {"inference"}
    assert {op.role for op in report.ops} == {"output"}
    assert len(report.fp8_ops) == 9  # qkv, proj, up, down per block + lm_head
    assert cap.scaled_mm_nodes() == 9
    assert not cap.backward
    assert sqnr(out, ref) >= OUTPUT_SQNR_DB


def test_string_backend_and_report_of_compiled_module():
    """`backend="fp8fx"` with the default Inductor inner compiler: training, then no_grad inference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    compiled = torch.compile(model, backend="fp8fx")
    x = torch.randn(16, 32)
    out = compiled(x)
    out.sum().backward()
    assert sqnr(out, model(x)) >= OUTPUT_SQNR_DB
    report = fp8fx.report(compiled)
    assert len(report.fp8_ops) == 5 and {op.graph_kind for op in report.ops} == {"training"}
    with torch.no_grad():
        out = compiled(x)
    report = fp8fx.report(compiled)
    assert [op.graph_kind for op in report.ops].count("inference") == 2
    assert sqnr(out, model(x)) >= OUTPUT_SQNR_DB
    # Another model compiled with the same shared backend does not show up in this report.
    other = torch.compile(nn.Linear(32, 32), backend="fp8fx")
    with torch.no_grad():
        other(x)
    assert len(fp8fx.report(compiled)) == len(report)
    assert len(fp8fx.report(other)) == 1
