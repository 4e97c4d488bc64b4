"""Gathered-weight expert GEMMs (`bmm(W[expert_ids], x[:, :, None])`, transformers' `batched_mm`
experts) rewritten into grouped GEMMs before aot_autograd: the rewrite equals the bmm it replaces,
forward and backward, for sampled routings (experts with no tokens included); a compiled layer runs
all its expert GEMMs as FP8 grouped GEMMs; policies without FP8 grouped GEMMs keep the bmm."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import GRAD_SQNR_DB, OUTPUT_SQNR_DB, sqnr
from torch import nn

import fp8fx
from fp8fx.core.policy import Policy, Rule
from fp8fx.passes.gathered_experts import gathered_as_grouped

pytest.importorskip("transformers.integrations.moe")  # registers transformers' fp32 grouped-mm op


class GatheredExperts(nn.Module):
    """Top-k experts as transformers' batched_mm runs them: each routed token multiplies its own
    gathered copy of its expert's weights (weights [E, out, in], or [E, in, out] `transposed`)."""

    def __init__(self, experts=4, dim=64, hidden=96, top_k=2, transposed=False):
        super().__init__()
        self.top_k, self.transposed = top_k, transposed
        self.router = nn.Linear(dim, experts, bias=False)
        up, down = (experts, dim, hidden), (experts, hidden, dim)
        self.up = nn.Parameter(torch.randn(*(up if transposed else (experts, hidden, dim))) / dim**0.5)
        self.down = nn.Parameter(torch.randn(*(down if transposed else (experts, dim, hidden))) / hidden**0.5)

    def linear(self, x, w, ids):
        if self.transposed:
            return torch.bmm(x.unsqueeze(1), w[ids]).squeeze(1)
        return torch.bmm(w[ids], x.unsqueeze(-1)).squeeze(-1)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, ids = self.router(tokens).softmax(-1).topk(self.top_k, dim=-1)
        ids = ids.reshape(-1)
        h = nn.functional.silu(self.linear(tokens.repeat_interleave(self.top_k, dim=0), self.up, ids))
        out = self.linear(h, self.down, ids) * weights.reshape(-1, 1)
        return out.reshape(-1, self.top_k, x.shape[-1]).sum(1).reshape(x.shape)


def _routings(count: int, seed: int) -> list:
    """Sampled (experts, rows, k, n, transposed, ids): uneven groups, empty experts, one expert only."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        experts, rows = rng.randint(1, 8), rng.randint(1, 40)
        used = rng.sample(range(experts), rng.randint(1, experts)) if i else [experts - 1]
        ids = [rng.choice(used) for _ in range(rows)]
        cases.append((experts, rows, rng.choice((16, 48)), rng.choice((16, 32)), rng.random() < 0.5, ids))
    return cases


@pytest.mark.parametrize("experts,rows,k,n,transposed,ids", _routings(6, seed=7), ids=lambda v: str(v)[:20])
def test_grouped_form_equals_the_gathered_bmm(experts, rows, k, n, transposed, ids):
    g = torch.Generator().manual_seed(rows * 31 + experts)
    w = torch.randn((experts, k, n) if transposed else (experts, n, k), generator=g, requires_grad=True)
    x = torch.randn(rows, k, generator=g, requires_grad=True)
    ids = torch.tensor(ids)
    expected = torch.bmm(x.unsqueeze(1), w[ids]) if transposed else torch.bmm(w[ids], x.unsqueeze(-1))
    out = gathered_as_grouped(w, ids, x, transposed)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn(expected.shape, generator=g)
    for ours, ref in zip(torch.autograd.grad(out, (w, x), grad), torch.autograd.grad(expected, (w, x), grad)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_gathered_experts_train_as_fp8_grouped_gemms(transposed, inner):
    torch.manual_seed(0)
    model = GatheredExperts(transposed=transposed)
    reference = GatheredExperts(transposed=transposed)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 16, 64, requires_grad=True)  # (so the first expert GEMM has a grad_input too)
    backend = fp8fx.backend(inner=inner)
    out = torch.compile(model, backend=backend)(x)
    out.square().sum().backward()
    expected = reference(x.detach())
    expected.square().sum().backward()
    report = fp8fx.report(backend)
    experts = [op for op in report.ops if op.fqn == ""]  # the expert GEMMs belong to the top module
    assert sorted((op.op, op.role) for op in experts) == sorted(
        ("grouped_mm", role) for role in ("output", "grad_input", "grad_weight") for _ in range(2)
    )
    assert all(op.precision == "fp8" and op.groups == 4 for op in experts)
    assert not [op for op in report.ops if op.op == "bmm"]
    assert sqnr(out, expected) > OUTPUT_SQNR_DB
    for p, q in ((model.up, reference.up), (model.down, reference.down)):
        assert sqnr(p.grad, q.grad) > GRAD_SQNR_DB


@pytest.mark.parametrize(
    "policy,why",
    [
        (Policy(rules=(Rule(match="*", op=("grouped_mm",), precision="high"),)), "rule keeping grouped GEMMs high"),
        (Policy.from_recipe("nvfp4"), "NVFP4 has no grouped lowering"),
    ],
    ids=["high", "nvfp4"],
)
def test_gathered_bmm_stays_without_fp8_grouped_gemms(policy, why):
    torch.manual_seed(0)
    backend = fp8fx.backend(policy=policy, inner="eager")
    torch.compile(GatheredExperts(), backend=backend)(torch.randn(2, 16, 64, requires_grad=True)).sum().backward()
    report = fp8fx.report(backend)
    assert not [op for op in report.ops if op.op == "grouped_mm"], why
    bmms = [op for op in report.ops if op.op == "bmm"]
    assert len(bmms) == 6 and all(op.precision == "high" for op in bmms), why
