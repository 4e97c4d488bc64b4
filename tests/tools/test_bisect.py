"""Divergence bisection (fp8fx.tools.bisect, `fp8fx bisect`): a planted bad GEMM is found, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import fp8fx
from fp8fx.cli import app
from fp8fx.tools.bisect import bisect

ASSETS = Path(__file__).parents[1] / "assets"
# Layer "2" casts with its scale divided by 2**24: every forward value underflows to zero in E4M3.
PLANTED = "version: 1\nrules:\n  - match: '2'\n    margin: 24\n"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))


def batches(n: int = 4) -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 32, generator=g),) for _ in range(n)]


def test_bisection_returns_exactly_the_planted_site():
    policy = fp8fx.policy_from_yaml(PLANTED)
    result = bisect(mlp, batches(), policy, lr=0.1)
    assert result.culprits == [("2", "output")]
    assert result.gap > 0.1 and result.remaining_gap <= 0.1 * result.gap
    patched = fp8fx.policy_from_yaml(result.policy_yaml)  # a valid policy, first rule for the culprit
    assert patched.rules[0].match == "2" and patched.rules[0].gemms["output"] == "high" and patched.rules[0].margin == 24
    # 8 candidate GEMMs (3 sites x 3 roles, no grad_input for the first): far fewer runs than 2**8
    assert result.runs <= 12


def test_cli_bisect_writes_the_patch(tmp_path):
    policy = tmp_path / "planted.yaml"
    policy.write_text(PLANTED)
    out = tmp_path / "patch.yaml"
    result = CliRunner().invoke(app, ["bisect", str(ASSETS / "mlp_train.py"), "--steps", "4", "--policy", str(policy), "--lr", "0.1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "2  output" in result.stdout and "FP8 loss gap to fp32" in result.stdout
    patch = fp8fx.load_policy(out)
    assert [(r.match, dict(r.gemms or {})) for r in patch.rules][0] == ("2", {"output": "high"})


def test_a_diverged_run_counts_as_the_largest_gap():
    from fp8fx.tools.bisect import DIVERGED, _gap

    reference = [2.0, 1.0]
    assert _gap([2.2, 1.0], reference) == pytest.approx(0.05)
    assert _gap([2.0, float("nan")], reference) == DIVERGED / 2 > _gap([4.0, 3.0], reference)


def test_delayed_scaling_policies_are_prepared_for():
    policy = fp8fx.Policy.from_recipe("delayed", rules=(fp8fx.Rule(match="2", margin=24),))
    assert bisect(mlp, batches(3), policy, lr=0.1).culprits == [("2", "output")]
