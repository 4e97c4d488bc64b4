"""The runtime monitor (fp8fx.backend(monitor_every=N), fp8fx.stats): counts on crafted tensors,
sampling, the JSONL writer, and no graph change when it is off."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import count
from torch import nn

import fp8fx
from fp8fx.runtime.monitor import JsonlWriter

OBSERVE = torch.ops.fp8fx.tap.default  # the monitor's tap in front of each cast


def crafted() -> torch.Tensor:
    x = torch.ones(8, 32)
    x[:3, :5] = 1000.0  # 15 values: beyond E4M3 at the initial delayed scale of 1
    x[0, 6] = 1e-5  # below E4M3's smallest subnormal at any scale used here
    return x


def compiled_layer(recipe: str, every: int, **kw):
    torch.manual_seed(0)
    layer = nn.Linear(32, 16, bias=False)
    fp8fx.prepare(layer)
    backend = fp8fx.backend(policy=fp8fx.Policy.from_recipe(recipe), inner="eager", monitor_every=every, **kw)
    return torch.compile(layer, backend=backend), backend


def test_counts_on_crafted_tensors_with_delayed_scaling():
    model, _ = compiled_layer("delayed", every=1)
    for _ in range(2):
        model(crafted()).sum().backward()
    first, second = fp8fx.stats(model).series("<top>:mm#0.output.input")
    assert (first.step, first.scale, first.amax) == (0, 1.0, 1000.0)
    assert (first.saturated, first.underflow, first.non_finite, first.numel) == (15, 1, 0, 256)
    # the second step casts with the scale the first step's amax gave: nothing saturates
    assert second.scale == pytest.approx(448 / 1000) and (second.saturated, second.underflow) == (0, 1)
    summary = fp8fx.stats(model).summary()["<top>:mm#0.output.input"]
    assert summary["saturated_pct"] == pytest.approx(100 * 15 / 512) and summary["samples"] == 2


def test_non_finite_values_are_counted_and_the_scale_kept():
    model, _ = compiled_layer("delayed", every=1)
    model(crafted()).sum().backward()
    x = crafted()
    x[1, 7] = float("inf")
    x[2, 8] = float("nan")
    model(x).sum().backward()
    model(crafted()).sum().backward()
    samples = fp8fx.stats(model).series("<top>:mm#0.output.input")
    assert [s.non_finite for s in samples] == [0, 2, 0]
    assert samples[2].scale == samples[1].scale  # a non-finite amax keeps the previous scale


def test_dynamic_scaling_never_saturates_finite_values():
    model, _ = compiled_layer("tensorwise", every=1)
    model(crafted()).sum().backward()
    for samples in fp8fx.stats(model).samples.values():
        assert all(s.saturated == 0 and s.scale > 0 for s in samples)


@pytest.mark.parametrize("every,steps,expected", [(1, 3, [0, 1, 2]), (3, 7, [0, 3, 6]), (5, 4, [0])])
def test_sampling_every_n_calls(tmp_path, every, steps, expected):
    model, _ = compiled_layer("tensorwise", every=every)
    monitor = fp8fx.stats(model)
    monitor.add_writer(JsonlWriter(tmp_path / "fp8.jsonl"))
    for _ in range(steps):
        model(torch.randn(8, 32)).sum().backward()
    assert [s.step for s in monitor.series("<top>:mm#0.output.weight")] == expected
    lines = [json.loads(line) for line in (tmp_path / "fp8.jsonl").read_text().splitlines()]
    assert len(lines) == sum(len(s) for s in monitor.samples.values())
    assert {"key", "step", "amax", "scale", "saturated", "underflow", "non_finite", "numel"} <= set(lines[0])


def test_the_monitor_adds_one_observe_per_cast_and_nothing_when_off():
    # (weight_fp8="keep": a weight cast again in backward is sampled once, in forward)
    on, backend_on = compiled_layer("tensorwise", every=1, keep_graphs=True, weight_fp8="keep")
    off, backend_off = compiled_layer("tensorwise", every=0, keep_graphs=True, weight_fp8="keep")
    x = torch.randn(8, 32, requires_grad=True)
    on(x).sum().backward()
    off(x).sum().backward()
    casts = sum(count(gm, torch.ops.fp8fx.cast.default) for _, gm in backend_on.kept_graphs)
    assert sum(count(gm, OBSERVE) for _, gm in backend_on.kept_graphs) == casts > 0
    assert sum(count(gm, OBSERVE) for _, gm in backend_off.kept_graphs) == 0
    with pytest.raises(ValueError, match="monitor_every"):
        fp8fx.stats(off)
    with pytest.raises(ValueError, match="positive integer"):
        fp8fx.backend(monitor_every=-1)


def test_the_report_carries_the_samples_and_the_html_plots_them(tmp_path):
    from pathlib import Path

    from fp8fx.reporting.html import render_html

    model, _ = compiled_layer("delayed", every=1)
    for gain in (1, 10, 100):
        model(crafted() * gain).sum().backward()
    data = fp8fx.report(model).to_dict()
    assert {len(v) for v in data["monitor"].values()} == {3}
    page = render_html(data)
    assert page.count('<svg id="plot-monitor"') == 1 and page.count("<polyline") == 2 * len(data["monitor"])
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        pytest.skip("needs Chromium at /usr/bin/chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    path = tmp_path / "report.html"
    path.write_text(page, encoding="utf-8")
    errors = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(chromium))
        try:
            tab = browser.new_page()
            tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto(path.as_uri(), wait_until="load")
            box = tab.locator("svg#plot-monitor").bounding_box()
        finally:
            browser.close()
    assert errors == [] and box["width"] > 100 and box["height"] > 100
