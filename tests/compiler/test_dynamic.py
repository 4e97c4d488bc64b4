"""Dynamic shapes: a model compiled with symbolic batch and sequence sizes (dynamic=True, or the
automatic recompile a second sequence length triggers) fuses and runs its FP8 GEMMs as the
static-shape compile does, for 3-D and 4-D inputs."""

from __future__ import annotations

import copy
import dataclasses
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


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "recompiled"])
def test_flops_of_symbolic_sizes_come_from_the_compiles_hints(dynamic):
    """After a recompile to symbolic sizes (a padded-batch training run), the rows' FLOPs are those
    of the sizes the graph was compiled for, the shares and coverage check keep working, and the
    report says where the FLOPs came from."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    backend = fp8fx.backend(inner="eager")
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    for tokens in (5, 9) if dynamic is None else (9,):
        compiled(torch.randn(2, tokens, 64, requires_grad=True)).sum().backward()
    report = fp8fx.report(backend)
    ops = [op for op in report.ops if op.graph_state == "in_use"]
    assert len(ops) == 6 and all(op.flops_hinted and op.flops_known for op in ops)
    first, second = [op for op in ops if op.role == "output"]
    assert not isinstance(first.m, int) and (first.flops, second.flops) == (2 * 18 * 128 * 64, 2 * 18 * 32 * 128)
    summary = report.summary()
    assert summary["gemms_without_flops"] == 0 and summary["gemms_flops_from_hints"] == 6
    assert summary["fp8_flop_share_forward"] == summary["fp8_flop_share_backward"] == 1.0
    assert "6 GEMM(s) of dynamic dimensions: FLOPs from the sizes the graph was compiled for" in str(report)
    fp8fx.assert_coverage(report, 1.0)
    all_high = type(report)([dataclasses.replace(op, precision="high") for op in report.ops])
    with pytest.raises(fp8fx.CoverageError, match=r"FP8 covers 0.0% of GEMM FLOPs"):
        fp8fx.assert_coverage(all_high, 0.5)
