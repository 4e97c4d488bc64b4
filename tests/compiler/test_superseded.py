"""Recompiles in the report: a graph Dynamo replaced for the same frame is superseded (kept in the
JSON with the guard failure, counted nowhere); a graph break's graphs are not."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fp8fx
from fp8fx.reporting.html import render_html


class Attending(nn.Module):
    """Two linears; while `attend` is set, a bmm (kept high by default) between them."""

    def __init__(self, d=32):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.out = nn.Linear(d, d), nn.Linear(d, 16)
        self.attend = True

    def forward(self, x):
        h = torch.relu(self.fc(x))
        if self.attend:
            h = torch.bmm(torch.bmm(h, h.transpose(1, 2)), h)
        return self.out(h)


def _run(compiled, *shapes):
    with torch.no_grad():
        for shape in shapes:
            compiled(torch.randn(*shape))


def test_attribute_guard_recompile_supersedes_the_old_graph():
    model = Attending()
    compiled = torch.compile(model, backend=fp8fx.backend(inner="eager"))
    _run(compiled, (2, 8, 32))
    assert fp8fx.report(compiled).summary()["fp8_flop_share_forward"] < 1  # the bmms run high
    model.attend = False
    _run(compiled, (2, 8, 32), (2, 8, 32))
    report = fp8fx.report(compiled)
    s = report.summary()
    assert (s["graphs"], s["superseded_graphs"], s["gemms"], s["fp8_gemms"]) == (1, 1, 2, 2)
    assert s["fp8_flop_share_forward"] == 1.0 and s["fallbacks_by_reason"] == {}
    fp8fx.assert_coverage(report, 1.0)  # the superseded graph's high bmms are not counted
    text = str(report)
    assert "2/2 GEMMs in FP8 over 1 graph(s) (1 superseded graph(s) not counted)" in text
    assert "superseded: graph 0 (Dynamo 0/0, recompiled as 0/1: self.attend == True" in text
    assert " bmm " not in text and "bmm" not in report.markdown().split("| graph |")[1]  # no superseded rows

    data = json.loads(report.to_json())
    assert data["schema"] == "fp8fx.report/4" and data["summary"]["superseded_graphs"] == 1
    old = [op for op in data["ops"] if op["graph_state"] == "superseded"]
    new = [op for op in data["ops"] if op["graph_state"] == "in_use"]
    assert [op["op"] for op in old] == ["addmm", "bmm", "bmm", "addmm"] and [op["op"] for op in new] == ["addmm", "addmm"]
    assert {(op["compile_id"], op["superseded_by"], op["flop_share"]) for op in old} == {("0/0", "0/1", None)}
    assert all(op["recompile_reason"].startswith("self.attend == True") for op in old)
    assert {(op["compile_id"], op["superseded_by"], op["recompile_reason"]) for op in new} == {("0/1", None, None)}
    assert sum(op["flop_share"] for op in new) == pytest.approx(1.0)
    page = render_html(data)
    assert "<h2>GEMMs (2)</h2>" in page and "Superseded graphs" in page and "self.attend == True" in page


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


def test_a_graph_break_supersedes_nothing():
    compiled = torch.compile(Broken(), backend=fp8fx.backend(inner="eager"))
    _run(compiled, (4, 32), (4, 32))
    report = fp8fx.report(compiled)
    assert (report.summary()["graphs"], report.summary()["superseded_graphs"]) == (2, 0)
    assert [(op.site, op.compile_id, op.graph_state) for op in report.ops] == [("a", "0/0", "in_use"), ("b", "1/0", "in_use")]
    assert "superseded" not in str(report)


def test_dynamic_shape_recompile_supersedes_the_static_graph():
    backend = fp8fx.backend(inner="eager")
    compiled = torch.compile(Attending(), backend=backend)
    _run(compiled, (2, 8, 32), (2, 12, 32), (2, 8, 32))  # the third call runs the dynamic graph
    report = fp8fx.report(compiled)
    assert (report.summary()["graphs"], report.summary()["superseded_graphs"]) == (1, 1)
    assert all(isinstance(op.m, str) for op in report.ops)  # only the dynamic graph is counted
    assert all(op.m == 16 for op in report.superseded if op.op == "addmm")
    (reason,) = {op.recompile_reason for op in report.superseded}
    assert reason == "tensor 'x' size mismatch at index 1. expected 8, actual 12"


def test_a_superseded_graph_that_runs_again_is_back_in_use():
    compiled = torch.compile(Attending(), backend=fp8fx.backend(inner="eager"), dynamic=False)
    _run(compiled, (2, 8, 32), (2, 12, 32))
    assert (fp8fx.report(compiled).summary()["graphs"], fp8fx.report(compiled).summary()["superseded_graphs"]) == (1, 1)
    _run(compiled, (2, 8, 32))  # static shapes taking turns: the first graph's guards pass again
    report = fp8fx.report(compiled)
    assert (report.summary()["graphs"], report.summary()["superseded_graphs"]) == (2, 0)
    assert sorted({op.m for op in report.find(site="fc")}) == [16, 24]
