"""Dynamic shapes: a model compiled with symbolic batch and sequence sizes (dynamic=True, or the
automatic recompile a second sequence length triggers) fuses and runs its FP8 GEMMs as the
static-shape compile does, for 3-D and 4-D inputs."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import sqnr
from torch import nn

import fp8fx


class GatedMlp(nn.Module):
    def __init__(self, d=64, hidden=128):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.gate = nn.Linear(hidden, d, bias=False)
        self.up = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        h = nn.functional.gelu(self.fc(x))
        return x + self.gate(h) * nn.functional.silu(self.up(h))


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "recompiled"])
@pytest.mark.parametrize("shapes", [[(2, 5, 64), (3, 7, 64)], [(2, 3, 5, 64), (2, 3, 9, 64)]], ids=["3d", "4d"])
def test_symbolic_sizes_train_like_static_ones(dynamic, shapes):
    torch.manual_seed(0)
    model = GatedMlp()
    inputs = [torch.randn(*shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(shapes)]

    def step(fn, x):
        xi = x.clone().requires_grad_()
        out = fn(xi)
        out.square().sum().backward()
        return [out, xi.grad]

    refs = []
    for x in inputs:  # each shape compiled on its own, static
        torch._dynamo.reset()
        refs.append(step(torch.compile(copy.deepcopy(model), backend=fp8fx.backend(inner="eager"), dynamic=False), x))
    torch._dynamo.reset()
    backend = fp8fx.backend(inner="eager")
    compiled = torch.compile(copy.deepcopy(model), backend=backend, dynamic=dynamic)
    for x, ref in zip(inputs, refs):
        for ours, theirs in zip(step(compiled, x), ref):
            assert sqnr(ours, theirs) >= 60  # the same FP8 casts: equal up to fp32 summation order
    report = fp8fx.report(backend)
    assert any(not isinstance(op.m, int) for op in report.ops)  # a graph with a symbolic M was built
    assert all(op.precision == "fp8" for op in report.ops) and report.summary()["fused_epilogues"] >= 2
    json.loads(report.to_json())
