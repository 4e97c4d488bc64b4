"""Shadow high-precision checks (policy `shadow`): a planted bad site is switched to high
precision within `patience` checks and training goes on; nothing is added when they are off."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import count
from torch import nn

import fp8fx

SHADOW_CHECK = torch.ops.fp8fx.tap.default  # the shadow check's tap after each FP8 GEMM


class Net(nn.Module):
    """Two linears; `gain` scales the second one's input (a buffer: changing it does not recompile)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 32)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * self.gain)


# `b` casts its input with the scale of the step before (delayed, history 1): when its input jumps
# 100x, most of it saturates and its FP8 result is far off.
PLANTED = """
version: 1
rules:
  - match: b
    scaling: delayed
    amax_history_len: 1
shadow: {every: 1, tolerance_db: 15, patience: 2}
"""


def train(policy, gains, **kw):
    torch.manual_seed(0)
    net = fp8fx.prepare(Net())
    backend = fp8fx.backend(policy=policy, inner="eager", **kw)
    model = torch.compile(net, backend=backend)
    opt = torch.optim.SGD(net.parameters(), lr=1e-9)  # gradients grow with the gain: a tiny step keeps training stable
    losses = []
    for gain in gains:
        net.gain.fill_(gain)
        loss = model(torch.randn(16, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, backend, losses


def test_a_planted_bad_site_is_switched_to_high_precision_within_patience():
    policy = fp8fx.policy_from_yaml(PLANTED)
    model, backend, losses = train(policy, gains=[1, 100, 10_000, 10_000, 10_000, 10_000, 10_000, 10_000])
    switched = {(c.site, c.role) for c in backend.shadow.switched}
    assert ("b", "output") in switched and not any(site == "a" for site, _ in switched)
    first_bad = min(c.step for c in backend.shadow.checks if c.site == "b" and c.role == "output" and c.sqnr_db < 15)
    (switch,) = [c for c in backend.shadow.switched if (c.site, c.role) == ("b", "output")]
    assert switch.step == first_bad + policy.shadow.patience - 1  # within `patience` checks
    assert all(c.site == "a" for c in backend.shadow.checks if c.step > switch.step)  # b is not FP8 any more
    assert all(math.isfinite(loss) for loss in losses)
    report = fp8fx.report(model)
    b = report.find(site="b", role="output")
    assert [op.precision for op in b] == ["high"] and b[0].reason_kind == "shadow" and f"at step {switch.step}" in b[0].reason
    assert {op.precision for op in report.find(site="a")} == {"fp8"}


def test_shadow_checks_add_one_node_per_fp8_gemm_and_none_when_off():
    on_policy = fp8fx.Policy(shadow=fp8fx.core.policy.Shadow(every=5))
    _, on, _ = train(on_policy, gains=[1], keep_graphs=True)
    _, off, _ = train(fp8fx.Policy(), gains=[1], keep_graphs=True)
    fp8_gemms = sum(count(gm, torch.ops.fp8fx.fp8_gemm.default) for _, gm in on.kept_graphs)
    assert sum(count(gm, SHADOW_CHECK) for _, gm in on.kept_graphs) == fp8_gemms > 0
    assert sum(count(gm, SHADOW_CHECK) for _, gm in off.kept_graphs) == 0 and off.shadow is None


@pytest.mark.parametrize(
    "text,where",
    [
        ("version: 1\nshadow: {every: 0}\n", "shadow.every"),
        ("version: 1\nshadow: {tolerance_db: loud}\n", "shadow.tolerance_db"),
        ("version: 1\nshadow: {patience: 2, often: 1}\n", "shadow.often"),
    ],
)
def test_bad_shadow_settings_name_the_key(text, where):
    with pytest.raises(fp8fx.PolicyError, match=where.replace(".", r"\.")):
        fp8fx.policy_from_yaml(text)
