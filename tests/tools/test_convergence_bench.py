"""bench/convergence.py's smoke tests: the default runs are built as their names say (no compile:
Inductor's takes a minute on CPU), so are the options' (-savedfp8, -o2), and a tiny --autocast
training writes its rows and reports the gaps to the bf16 run."""

from __future__ import annotations

import csv
import sys

import pytest
import torch
from helpers import bench_module
from torch import nn

import fp8fx
from fp8fx.compiler.backend import DEFAULT_BACKEND, _find_backend


def _bench():
    return bench_module("convergence")


def _tiny(bench) -> nn.Module:
    return bench.GPT(vocab=32, dim=32, heads=2, layers=1, seq=16)


def test_default_runs_are_the_defaults():
    bench = _bench()
    run, context = bench.prepare_run("fp8fx-default", _tiny(bench))
    assert _find_backend(run) is DEFAULT_BACKEND and not context._enabled
    run, context = bench.prepare_run("fp8fx-default-high", _tiny(bench), autocast=True)
    found = _find_backend(run)
    assert (found.saved_outputs, found.inner, found.policy) == ("high", "inductor", fp8fx.Policy())
    assert context._enabled and context.fast_dtype == torch.bfloat16


def test_option_suffixes(tmp_path, monkeypatch):
    """-savedfp8 sets fp8fx's backend option, -o2 trains with Fp8AdamW; -savedfp8 is fp8fx's only."""
    from fp8fx.runtime.optim import Fp8AdamW

    bench = _bench()
    assert bench.split_run("fp8fx-rowwise-savedfp8-o2") == ("fp8fx-rowwise", True, True)
    run, _ = bench.prepare_run("fp8fx-rowwise-savedfp8-o2", _tiny(bench))
    found = _find_backend(run)
    assert (found.saved_activations, found.inner, found.policy.defaults.granularity.value) == ("fp8", "eager", "rowwise")
    made = []
    monkeypatch.setattr(bench, "Fp8AdamW", lambda *args, **kwargs: made.append(Fp8AdamW(*args, **kwargs)) or made[-1])
    args = ["--runs", "bf16-o2", "--steps", "1", "--eval-batches", "1", "--seeds", "1", "--layers", "1", "--dim", "32",
            "--heads", "2", "--seq", "16", "--batch", "2", "--out-dir", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["convergence.py", *args])
    bench.main()
    assert len(made) == 1 and made[0].state  # it stepped
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--runs", "bf16-savedfp8", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"unknown run\(s\) \['bf16-savedfp8'\]"):
        bench.main()


def test_torchao_default_converts_every_linear():
    float8 = pytest.importorskip("torchao.float8.float8_linear")
    bench = _bench()
    model = _tiny(bench)
    run, context = bench.prepare_run("torchao-default", model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert isinstance(model.lm_head, float8.Float8Linear)
    assert all(isinstance(m, float8.Float8Linear) and m.config.emulate for m in linears), linears
    assert run._orig_mod is model and _find_backend(run) is None and not context._enabled


def test_tiny_autocast_training_reports_gaps_to_bf16(tmp_path, monkeypatch, capsys):
    bench = _bench()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    args = ["--autocast", "--runs", "bf16", "--steps", "4", "--eval-every", "2", "--eval-batches", "1", "--seeds", "2",
            "--layers", "1", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "2", "--out-dir", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["convergence.py", *args])
    bench.main()
    with (tmp_path / "convergence.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["run", "seed", "step", "train_loss", "val_loss", "seconds"]
    assert [(r[0], r[1], r[2]) for r in rows[1:]] == [("bf16", s, t) for s in "01" for t in ("2", "4")]
    assert "bf16 seed-to-seed spread" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["convergence.py", *args[:2], "fp32,bf16", *args[3:]])
    with pytest.raises(SystemExit, match="baseline is the bf16 run"):
        bench.main()
