"""The HTML report (fp8fx.reporting.html): content checks on real analyses with synthetic predictions and
numerics, and a render in headless Chromium."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from helpers import meta_llama

import fp8fx
from fp8fx.reporting.html import MAX_BARS, MAX_POINTS, render_html

CHROMIUM = Path("/usr/bin/chromium")
RECIPES = ("tensorwise", "rowwise")


def analysed(layers: int) -> dict:
    """The JSON dict of a shape-only training analysis of a small Llama (fused attention stays high)."""
    inputs = (torch.randint(0, 512, (1, 64), device="meta"),)
    return fp8fx.analyze(meta_llama(layers), inputs, train=True).to_dict()


def with_extras(data: dict, target: str = "H100") -> dict:
    """`data` with deterministic predictions and numerics on every op, as `--target` and `--numerics`
    add them; GEMMs of repeated layers get equal values. Speedups cycle through 1/0.6 ... 1/1.1."""
    data = copy.deepcopy(data)
    kinds: dict[tuple[str, str], int] = {}
    for op in data["ops"]:
        i = kinds.setdefault((re.sub(r"\.\d+", ".*", op["site"]), op["role"]), len(kinds))
        bf16 = 10.0 + i % 7
        op["predicted"] = {"bf16_us": bf16, "fp8_us": bf16 * (0.6 + 0.1 * (i % 6)), "speedup": 1 / (0.6 + 0.1 * (i % 6))}
        fp8 = op["precision"] == "fp8"
        sqnr = 300.0 if i == 3 else 18.0 + i % 12  # 300: an exact product
        operand = {"amax": 1.0 + i, "scale": 448.0 / (1 + i), "underflow_pct": 0.25 * (i % 5), "saturation_pct": 0.01 * (i % 3)}
        op["numerics"] = {
            "sqnr_db": sqnr if fp8 else None,
            "operands": [operand, {**operand, "underflow_pct": 0.1 * (i % 4)}] if fp8 else None,
            "what_if": {"tensorwise": sqnr - 1.5, "rowwise": None if i % 4 == 0 else sqnr + 4},
            "batches": 2,
        }
    data["summary"].update(target=target, predicted_step_speedup=1.31, predicted_gemm_speedup=1.52, fp8_saved_activation_bytes=3 << 20)
    data["summary"]["slower_in_fp8"] = sum(slower(op) for op in data["ops"])
    return data


def slower(op: dict) -> bool:
    return op["precision"] == "fp8" and op["predicted"]["speedup"] < 1


@pytest.fixture(scope="module")
def plain() -> dict:
    return analysed(2)


@pytest.fixture(scope="module")
def full(plain) -> dict:
    return with_extras(plain)


def test_plots_present_with_data(full):
    page = render_html(full)
    for pid in ("plot-sqnr", "plot-range", "plot-speedup"):
        assert page.count(f'<svg id="{pid}"') == 1
    assert "--numerics" not in page and "--target" not in page
    assert "H100" in page and "×1.31" in page and "3.0 MiB" in page  # summary: target, step speedup, memory
    assert all(f"what-if: {r}" in page for r in RECIPES)


def test_notes_replace_plots_without_data(plain):
    page = render_html(plain)
    assert "<svg" not in page
    assert page.count("`fp8fx analyze --numerics`") == 2 and page.count("`fp8fx analyze --target GPU`") == 1
    assert "FP8 share of GEMM FLOPs" in page and "op_kind" in page  # summary and fallbacks still there


def test_one_red_cell_per_fp8_gemm_predicted_slower(full):
    full = copy.deepcopy(full)
    high = next(op for op in full["ops"] if op["precision"] == "high")
    high["predicted"]["speedup"] = 0.5  # a high-precision GEMM predicted slower gets no red cell
    page = render_html(full)
    expected = sum(slower(op) for op in full["ops"])
    high_slower = sum(op["precision"] == "high" and op["predicted"]["speedup"] < 1 for op in full["ops"])
    assert expected > 0 and high_slower > 0  # the data has both, so high rows are really left out
    assert len(re.findall(r'<td class="[^"]*\bslower\b', page)) == expected
    assert page.count('<tr class="high">') == sum(op["precision"] == "high" for op in full["ops"]) > 0
    assert page.count("<tr class=") == len(full["ops"])


def test_text_is_escaped(full):
    data = copy.deepcopy(full)
    for op in data["ops"][:3]:
        op["site"] = 'evil.<script>alert("x")</script>.0'
    data["ops"][0]["reason"] = "<img src=x onerror=alert(1)>"
    page = render_html(data)
    assert page.count("<script") == 1  # the page's own sorting/filter script only
    assert "&lt;script&gt;" in page and "<img" not in page


def test_self_contained(full, plain):
    for page in (render_html(full), render_html(plain)):
        assert not re.search(r"https?://|<link[^>]+href=\"(?!data:)|src=", page)


def test_absent_and_null_fields():
    page = render_html({"summary": {}, "ops": []})
    assert "GEMMs (0)" in page and "<svg" not in page
    op = {"site": "fc", "op": "mm", "role": "output", "m": "s0", "n": 16, "k": 16, "flops": 1, "flop_share": 1.0, "precision": "fp8", "reason": "r"}
    nulls = {"predicted": None, "numerics": {"sqnr_db": None, "operands": None, "what_if": {}}, "formats": None}
    page = render_html({"summary": {"target": "L4", "predicted_step_speedup": None, "fp8_flop_share_backward": None}, "ops": [op, {**op, **nulls}]})
    assert "<svg" not in page and "Predicted speedup on L4" in page and "backward n/a" in page


def test_a_70b_sized_report_stays_small():
    data = with_extras(analysed(80))
    assert len(data["ops"]) == 80 * 23 + 3
    page = render_html(data)
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) == 3
    for svg in svgs:
        assert len(svg) < 200_000 and svg.count("<circle") + svg.count("<rect") + svg.count("<path") < 12 * MAX_POINTS
    assert "one point per layer" in page
    speedup = next(s for s in svgs if 'id="plot-speedup"' in s)
    assert 0 < speedup.count("<rect") <= MAX_BARS and "×80" in speedup  # identical layers share a bar
    assert page.count("<tr class=") == len(data["ops"])


def test_more_layers_than_points_are_merged_into_runs(full):
    op = next(op for op in full["ops"] if op["precision"] == "fp8")
    page = render_html({"summary": {}, "ops": [{**op, "site": f"block{i}_fc"} for i in range(3 * MAX_POINTS)]})
    sqnr = re.search(r'<svg id="plot-sqnr".*?</svg>', page, re.S).group(0)
    assert "one point per 3 consecutive layers" in page and "block0_fc +2" in sqnr
    assert sqnr.count("<circle") <= (1 + len(RECIPES)) * (MAX_POINTS + 1)  # series markers and legend


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Chromium at /usr/bin/chromium (apt-get install chromium)")
def test_renders_in_headless_chromium(full, tmp_path):
    from playwright.sync_api import sync_playwright

    path = tmp_path / "report.html"
    path.write_text(render_html(full), encoding="utf-8")
    errors = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM))
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("requestfailed", lambda r: errors.append(r.url))
            page.goto(path.as_uri(), wait_until="load")
            for pid in ("plot-sqnr", "plot-range", "plot-speedup"):
                box = page.locator(f"svg#{pid}").bounding_box()
                assert box and box["width"] > 100 and box["height"] > 100, pid
            assert page.locator("#gemms tbody tr").count() == len(full["ops"])
            assert page.evaluate("document.scripts.length") == 1
            page.fill("#filter", "lm_head")  # the filter box and column sorting work
            assert page.locator("#gemms tbody tr:visible").count() == 3
            page.fill("#filter", "")
            page.click("#gemms th:nth-child(12)")  # FP8/BF16 speedup, ascending: a slower GEMM first
            assert float(page.locator("#gemms tbody tr >> nth=0 >> td >> nth=11").inner_text()) < 1
            shot = page.screenshot(full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 10_000
