"""bench/noise_study.py's smoke tests (no training, no compile): each run is built with the options
its name says, and the table pairs the runs' per-seed differences from fp32 against torchao's."""

from __future__ import annotations

import pytest
from helpers import bench_module
from torch import nn

from fp8fx.compiler.backend import DEFAULT_BACKEND, _find_backend


def _bench():
    return bench_module("noise_study")


def _tiny(bench) -> nn.Module:
    return bench.GPT(vocab=32, dim=32, heads=2, layers=1, seq=16)


def test_runs_are_built_as_named():
    bench = _bench()
    assert _find_backend(bench.prepare("fp8fx", _tiny(bench))) is DEFAULT_BACKEND
    expected = {
        "fp8fx-high": ("high", "recompute", "inductor"),
        "fp8fx-keep": ("bf16", "keep", "inductor"),
        "fp8fx-eager": ("bf16", "recompute", "eager"),
        "fp8fx-eager-high": ("high", "recompute", "eager"),
    }
    for name, options in expected.items():
        found = _find_backend(bench.prepare(name, _tiny(bench)))
        assert (found.saved_outputs, found.weight_fp8, found.inner) == options, name
    assert _find_backend(bench.prepare("fp32-inductor", _tiny(bench))) is None


def test_table_pairs_against_torchao():
    bench = _bench()
    vals = {"fp32": (2.0, 2.0), "fp8fx": (2.02, 1.99), "torchao": (2.01, 2.0)}
    rows = [{"run": r, "seed": str(s), "val_loss": str(v[s])} for r, v in vals.items() for s in (0, 1)]
    line = next(row for row in bench.summarize(rows).splitlines() if row.startswith("fp8fx "))
    fields = line.split()
    # fp8fx: +1.0% and -0.5% from fp32; against torchao's +0.5% and 0%: +0.5 and -0.5, mean 0, SE 0.5
    assert fields[1:9] == ["2", "+0.250", "1.061", "0.750", "-", "+0.000", "(0.500,", "n=2)"]
    assert "0: 2.0200 (+1.00)" in line


def test_torchao_runs_convert_the_linears_their_names_say():
    float8 = pytest.importorskip("torchao.float8.float8_linear")
    bench = _bench()
    for name, head_fp8 in (("torchao", True), ("torchao-no-lm-head", False)):
        model = _tiny(bench)
        bench.prepare(name, model)
        assert isinstance(model.lm_head, float8.Float8Linear) is head_fp8, name
        assert all(isinstance(b.qkv, float8.Float8Linear) and b.qkv.config.emulate for b in model.blocks), name
