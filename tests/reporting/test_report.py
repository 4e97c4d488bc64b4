"""The report: found from the compiled object, grows with recompiles, renders as JSON and a table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import fp8fx
from fp8fx.tools.demo import TinyTransformer


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))


def test_report_of_compiled_module_function_and_backend():
    backend = fp8fx.backend(inner="eager")
    model = _mlp()
    compiled = torch.compile(model, backend=backend)
    assert len(fp8fx.report(compiled)) == 0
    assert "no matmul compiled yet" in str(fp8fx.report(compiled))
    compiled(torch.randn(8, 32)).sum().backward()
    assert len(fp8fx.report(compiled)) == 5  # 2 outputs + 2 grad_weights + 1 grad_input

    fn = torch.compile(lambda x: model(x), backend=backend)
    with torch.no_grad():
        fn(torch.randn(8, 32))
    # The backend (and everything compiled with it) holds both graphs.
    assert len(fp8fx.report(fn)) == len(fp8fx.report(backend)) == 7


def test_recompiles_add_graphs():
    backend = fp8fx.backend(inner="eager")
    compiled = torch.compile(_mlp(), backend=backend, dynamic=False)
    for batch in (8, 16, 8):  # static shapes taking turns: both graphs stay in use
        compiled(torch.randn(batch, 32)).sum().backward()
    report = fp8fx.report(compiled)
    assert report.summary()["graphs"] == 2
    assert sorted({op.m for op in report.find(role="output")}) == [8, 16]


def test_report_of_something_else_is_a_clear_error():
    with pytest.raises(ValueError, match="not compiled with an fp8fx backend"):
        fp8fx.report(torch.compile(_mlp(), backend="eager"))
    with pytest.raises(ValueError, match="not compiled with an fp8fx backend"):
        fp8fx.report(_mlp())


def test_json_and_table():
    compiled = torch.compile(TinyTransformer(layers=1, max_seq=16), backend=fp8fx.backend(inner="eager"))
    compiled(torch.randint(0, 256, (2, 16))).sum().backward()
    report = fp8fx.report(compiled)
    data = json.loads(report.to_json())
    assert len(data["ops"]) == len(report) == 4 * 3 + 3 + 2 * 3  # 4 linears + lm_head, 2 bmm sites
    assert sum(op["flop_share"] for op in data["ops"]) == pytest.approx(1.0)
    summary = data["summary"]
    assert summary["fp8_gemms"] == 15 and summary["fallbacks_by_reason"] == {"op_kind": 6}
    # bmm FLOPs are the only high ones: the FP8 share is what the linears carry.
    linear_fwd = sum(op.flops for op in report.ops if op.role == "output" and op.op != "bmm")
    all_fwd = sum(op.flops for op in report.ops if op.role == "output")
    assert summary["fp8_flop_share_forward"] == pytest.approx(linear_fwd / all_fwd)
    first = data["ops"][0]
    for key in ("site", "fqn", "op", "role", "m", "n", "k", "flops", "precision", "reason", "formats", "scaling", "granularity"):
        assert key in first
    assert (first["site"], first["role"], first["scaling"], first["granularity"]) == ("blocks.0.qkv", "output", "dynamic", "tensorwise")
    table = str(report)
    assert table.count("\n") >= len(report) + 2
    assert "blocks.0.qkv" in table and "15/21 GEMMs in FP8" in table and "kept high: op_kind 6" in table


def test_entry_point_registers_the_backend_without_importing_fp8fx():
    code = (
        "import sys, torch\n"
        "from torch._dynamo.backends.registry import lookup_backend, list_backends\n"
        "assert 'fp8fx' in list_backends(exclude_tags=()), list_backends(exclude_tags=())\n"
        "b = lookup_backend('fp8fx')\n"
        "print(type(b).__name__, b.inner)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Fp8fxBackend inductor"


def test_backend_options_are_checked():
    with pytest.raises(ValueError, match="inner must be one of inductor, eager"):
        fp8fx.backend(inner="tvm")
    with pytest.raises(TypeError, match="policy must be a Policy"):
        fp8fx.backend(policy=42)
    with pytest.raises(fp8fx.PolicyError, match="cannot read policy file"):
        fp8fx.backend(policy="/nonexistent/policy.yaml")
