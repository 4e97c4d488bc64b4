"""Weights whose products never reached a compiled graph (eager code Dynamo skips, a loop it does
not trace) are named in the report instead of silently running in high precision."""

from __future__ import annotations

import torch
from torch import nn

import fp8fx


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.inner = nn.Linear(d, d)
        self.side = nn.Linear(d, d)

    @torch.compiler.disable
    def eager_side(self, x):  # runs outside any graph, as a loop over data-dependent experts would
        return self.side(x)

    def forward(self, x):
        return self.inner(x) + self.eager_side(x)


class Stack(nn.Module):
    def __init__(self, blocks=3, d=64):
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


EAGER = [f"layers.{i}.side.weight" for i in range(3)]


def test_report_names_weights_no_graph_took():
    torch.manual_seed(0)
    model = Stack()
    compiled = torch.compile(model, backend=fp8fx.backend(inner="eager"))
    compiled(torch.randn(4, 8, 64, requires_grad=True)).sum().backward()
    report = fp8fx.report(compiled)
    assert report.uncaptured_weights == EAGER  # biases and the norm's 1-D weight are not matrices
    assert report.summary()["uncaptured_weights"] == EAGER
    assert report.to_dict()["summary"]["uncaptured_weights"] == EAGER
    line = next(line for line in report.summary_lines() if "reached no compiled graph" in line)
    assert line.startswith("3 weight(s) reached no compiled graph") and "layers.0.side.weight" in line
    assert all(op.fqn.endswith("inner") for op in report.ops)


def test_analyze_names_them_in_every_folded_block():
    torch.manual_seed(0)
    report = fp8fx.analyze(Stack(), (torch.randn(4, 8, 64),), train=True)
    assert report.folded == {"layers": 3}
    assert sorted(report.uncaptured_weights) == EAGER


def test_a_fully_captured_model_has_none():
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    compiled = torch.compile(model, backend=fp8fx.backend(inner="eager"))
    compiled(torch.randn(8, 64)).sum().backward()
    report = fp8fx.report(compiled)
    assert report.uncaptured_weights == [] and not any("reached no compiled graph" in line for line in report.summary_lines())
