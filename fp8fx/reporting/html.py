"""The precision report as one self-contained HTML page: summary, inline SVG plots, sortable table.

`render_html(report.to_dict())` needs nothing outside the page (no URL, font or script file), so the
file can be opened anywhere, attached to a CI run or mailed. The plots stay small for any model:
per-site plots switch to one point per layer (its worst site) beyond `MAX_POINTS` sites, and the
speedup plot draws one bar per distinct GEMM (identical layers share it), at most `MAX_BARS`."""

from __future__ import annotations

import math
import re
from html import escape
from typing import Any

from fp8fx.reporting.op_record import repeated_site
from fp8fx.reporting.records import mib

MAX_POINTS = 100  # x positions of a per-site plot
MAX_BARS = 60  # bars of the speedup plot
SQNR_AXIS = (0.0, 60.0)  # SQNR beyond it (an exact product reports 300 dB) is drawn at the edge
WIDTH = 960
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
RED, GREEN = "#d62728", "#2ca02c"

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1f2328}
h1{margin:0 0 4px}h2{margin:28px 0 8px;font-size:18px}
.summary td{padding:2px 16px 2px 0;vertical-align:top}.summary td:first-child{color:#57606a}
.note{color:#57606a;font-style:italic}.caption{color:#57606a;font-size:12px;margin:2px 0 0}
svg{display:block;max-width:100%;height:auto;font:11px system-ui,sans-serif}
#gemms{border-collapse:collapse;font-size:12px}
#gemms th{background:#eaeef2;cursor:pointer;position:sticky;top:0;text-align:left}
#gemms th,#gemms td{padding:2px 6px;border-bottom:1px solid #d0d7de;white-space:nowrap}
#gemms td.num{text-align:right}#gemms td.reason{white-space:normal;min-width:200px}
#gemms td.epi{white-space:normal}
#gemms tr.high td{background:#fff4e5}#gemms tr.high td.prec{color:#b35900;font-weight:bold}
#gemms td.slower{background:#fde2e2;color:#b3261e;font-weight:bold}
#filter{margin:0 0 8px;padding:4px;width:320px}
"""

SCRIPT = """
const body = document.querySelector('#gemms tbody');
document.querySelectorAll('#gemms th').forEach((th, i) => th.addEventListener('click', () => {
  const dir = th.dataset.dir = th.dataset.dir === 'up' ? 'down' : 'up';
  const key = r => { const t = r.cells[i].textContent, x = parseFloat(t); return isNaN(x) ? t : x; };
  const cmp = (a, b) => typeof a !== typeof b ? (typeof a === 'number' ? -1 : 1) : a < b ? -1 : a > b ? 1 : 0;
  const rows = [...body.rows].sort((a, b) => cmp(key(a), key(b)) * (dir === 'up' ? 1 : -1));
  body.append(...rows);
}));
document.getElementById('filter').addEventListener('input', e => {
  const q = e.target.value.toLowerCase();
  for (const r of body.rows) r.hidden = !r.textContent.toLowerCase().includes(q);
});
"""


def _e(x: Any) -> str:
    return escape(str(x))


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _short(text: str, n: int) -> str:
    """`text` cut to `n` characters from the left: the end of a site name tells sites apart."""
    return text if len(text) <= n else "…" + text[1 - n :]


def _layer(site: str) -> str:
    """The layer a site belongs to: its name up to the first numeric component ("model.layers.3")."""
    found = re.match(r"(.*?\.\d+)(?=[.:]|$)", site)
    return found.group(1) if found else site


def _ticks(lo: float, hi: float) -> list[float]:
    """Round tick values covering [lo, hi], about five of them."""
    if hi - lo < 1e-9:
        hi = lo + 1
    raw = (hi - lo) / 5
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 5, 10) if s * mag >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 10) for i in range(first, last + 1)]


# --- summary ---------------------------------------------------------------------------------------


def _summary(s: dict, superseded: list[dict]) -> str:
    rows = [
        ("GEMMs in FP8", f"{s.get('fp8_gemms', 0)} of {s.get('gemms', 0)} over {s.get('graphs', 0)} graph(s)"),
        (
            "FP8 share of GEMM FLOPs",
            f"forward {_pct(s.get('fp8_flop_share_forward'))}, backward {_pct(s.get('fp8_flop_share_backward'))}",
        ),
    ]
    if s.get("target"):
        parts = [
            f"{label} ×{s[key]:.2f}"
            for label, key in (("step", "predicted_step_speedup"), ("GEMMs", "predicted_gemm_speedup"))
            if _finite(s.get(key))
        ]
        if s.get("slower_in_fp8") is not None:
            parts.append(f"{s['slower_in_fp8']} FP8 GEMM(s) predicted slower than BF16")
        rows.append((f"Predicted speedup on {s['target']}", "; ".join(parts) or "n/a"))
    fallbacks = s.get("fallbacks_by_reason") or {}
    rows.append(("Kept in high precision", ", ".join(f"{k}: {v}" for k, v in sorted(fallbacks.items())) or "none"))
    if s.get("fp8_saved_activation_bytes") is not None:
        of = f" of {mib(s['saved_for_backward_bytes'])} saved for backward" if s.get("saved_for_backward_bytes") else ""
        rows.append(("Activation memory FP8 saves", mib(s["fp8_saved_activation_bytes"]) + of))
    for u in s.get("uncaptured_modules") or ():  # GEMMs outside every graph: in no share above
        rows.append(
            (
                f"Not captured: {u['module'] or '<root>'} ({u['kind']})",
                "; ".join(filter(None, (", ".join(u["weights"]), u["cause"], u["fix"]))),
            )
        )
    if s.get("traced_on_real_tensors"):
        rows.append(("Shapes traced on real tensors", s["traced_on_real_tensors"]))
    if s.get("folded_blocks"):
        rows.append(("Repeated blocks traced once", ", ".join(f"{k} ×{v}" for k, v in s["folded_blocks"].items())))
    if s.get("fused_epilogues") is not None:
        rows.append(("Fused epilogues", str(s["fused_epilogues"])))
    if s.get("memory_passes_added") is not None:
        rows.append(
            ("Memory passes FP8 adds / fusion saves", f"+{s['memory_passes_added']} / -{s.get('memory_passes_saved', 0)}")
        )
    if s.get("non_finite_amax_events"):
        rows.append(("Non-finite amax (scale kept)", ", ".join(f"{k}: {v}" for k, v in s["non_finite_amax_events"].items())))
    graphs = {op.get("graph"): op for op in reversed(superseded)}
    if graphs:
        rows.append(
            (
                "Superseded graphs (not counted, rows only in the JSON)",
                "; ".join(
                    f"graph {i} (Dynamo {op.get('compile_id')}, recompiled as {op.get('superseded_by')}: "
                    f"{op.get('recompile_reason') or 'reason not recorded'})"
                    for i, op in sorted(graphs.items())
                ),
            )
        )
    return '<table class="summary">' + "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in rows) + "</table>"


# --- plots -----------------------------------------------------------------------------------------


def _items(ops: list[dict]) -> tuple[list[tuple[str, str, list[dict]]], str, str]:
    """The x positions of a per-site plot, (label, layer, ops) in layer order; what one is (the x
    axis title) and how its value is chosen (a caption)."""
    layers: dict[str, dict[str, list[dict]]] = {}
    for op in ops:
        layers.setdefault(_layer(op["site"]), {}).setdefault(op["site"], []).append(op)
    items = [(site, layer, site_ops) for layer, sites in layers.items() for site, site_ops in sites.items()]
    if len(items) <= MAX_POINTS:
        return items, "site", "one point per site (the worst of its GEMMs), layers in shaded bands"
    items = [(layer, layer, [op for site_ops in sites.values() for op in site_ops]) for layer, sites in layers.items()]
    if len(items) <= MAX_POINTS:
        return items, "layer", f"{sum(map(len, layers.values()))} sites: one point per layer (its worst GEMM)"
    n = math.ceil(len(items) / MAX_POINTS)
    runs = [items[i : i + n] for i in range(0, len(items), n)]
    merged = [(f"{run[0][0]} +{len(run) - 1}", run[0][1], [op for item in run for op in item[2]]) for run in runs]
    return merged, "layers", f"{len(items)} layers: one point per {n} consecutive layers (their worst GEMM)"


def _legend(names: list[str], left: float, y: float) -> tuple[str, float]:
    """The series' markers and names in rows from (left, y), and the last row's y."""
    out, x = [], left
    for j, name in enumerate(names):
        width = 30 + 6.5 * len(name)
        if x + width > WIDTH and x > left:
            x, y = left, y + 16
        out.append(
            f'<circle cx="{x + 5:.1f}" cy="{y - 4}" r="4" {_marker_style(j)}/><text x="{x + 13:.1f}" y="{y}">{_e(name)}</text>'
        )
        x += width
    return "".join(out), y


def _marker_style(j: int) -> str:
    color = COLORS[j % len(COLORS)]
    return f'fill="{color}"' if j == 0 else f'fill="none" stroke="{color}" stroke-width="1.5"'


def _point_chart(pid: str, title: str, items: list, x_title: str, panels: list[tuple[str, tuple | None, dict[str, list]]]) -> str:
    """Markers per x position; `panels` stacked, each (y label, clip range or None, {series: values})."""
    names = list(panels[0][2])
    labels = [_short(label, 32) for label, _, _ in items]
    longest = max(map(len, labels))  # x labels are rotated by 60 degrees
    left, right, panel_h, gap = max(64, 2.8 * longest), 16, 200, 56
    legend, legend_y = _legend(names, left, 40)
    top = legend_y + 12
    bottom = 34 + 5.6 * longest * 0.87
    height = top + len(panels) * (panel_h + gap) - gap + bottom
    plot_w = WIDTH - left - right
    step = plot_w / len(items)
    every = max(1, math.ceil(14 / step))
    out = [
        f'<svg id="{pid}" width="{WIDTH}" height="{height:.0f}" viewBox="0 0 {WIDTH} {height:.0f}" role="img">',
        f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="15" font-weight="bold">{_e(title)}</text>',
        legend,
    ]
    y0 = top
    for y_label, clip, series in panels:
        values = [v for vals in series.values() for v in vals if _finite(v)]
        if clip:
            values = [min(max(v, clip[0]), clip[1]) for v in values]
        ticks = _ticks(min(values, default=0.0) if clip else 0.0, max(values, default=1.0))
        lo, hi = ticks[0], ticks[-1]

        def y(v: float) -> float:
            return y0 + panel_h * (hi - v) / (hi - lo)

        shade, start = 0, 0  # every other layer's band shaded
        for i in range(1, len(items) + 1):
            if i == len(items) or items[i][1] != items[start][1]:
                if shade:
                    out.append(
                        f'<rect x="{left + start * step:.1f}" y="{y0}" width="{(i - start) * step:.1f}" '
                        f'height="{panel_h}" fill="#f3f5f7"/>'
                    )
                shade, start = 1 - shade, i
        for t in ticks:
            out.append(f'<line x1="{left}" x2="{WIDTH - right}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#d0d7de"/>')
            out.append(f'<text x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
        mid = y0 + panel_h / 2
        out.append(f'<text transform="translate(16 {mid}) rotate(-90)" text-anchor="middle">{_e(y_label)}</text>')
        for j, (name, vals) in enumerate(series.items()):
            nudge = (j - (len(series) - 1) / 2) * min(4.0, step / (len(series) + 1))  # series side by side
            for i, v in enumerate(vals):
                if not _finite(v):
                    continue
                shown = min(max(v, lo), hi)
                tip = f"<title>{_e(items[i][0])} · {_e(name)}: {v:.3g}</title>"
                cx, cy = left + (i + 0.5) * step + nudge, y(shown)
                if shown != v:  # beyond the axis: a triangle at its edge
                    d = -7 if v > hi else 7
                    out.append(
                        f'<path d="M{cx - 4:.1f} {cy - d / 2:.1f}h8L{cx:.1f} {cy + d / 2:.1f}z" {_marker_style(j)}>{tip}</path>'
                    )
                else:
                    out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3.5" {_marker_style(j)}>{tip}</circle>')
        y0 += panel_h + gap
    axis_y = y0 - gap
    out.append(f'<line x1="{left}" x2="{WIDTH - right}" y1="{axis_y}" y2="{axis_y}" stroke="#57606a"/>')
    for i in range(0, len(items), every):
        x = left + (i + 0.5) * step
        out.append(
            f'<text transform="translate({x:.1f} {axis_y + 10}) rotate(-60)" '
            f'text-anchor="end">{_e(labels[i])}<title>{_e(items[i][0])}</title></text>'
        )
    out.append(f'<text x="{left + plot_w / 2}" y="{height - 6:.0f}" text-anchor="middle">{x_title}</text>')
    return "".join(out) + "</svg>"


def _sqnr_plot(ops: list[dict]) -> str | None:
    measured = [op for op in ops if op.get("numerics")]
    if not any(_finite(op["numerics"].get("sqnr_db")) for op in measured):
        return None
    recipes = list(dict.fromkeys(r for op in measured for r in op["numerics"].get("what_if") or {}))
    items, x_title, what = _items(measured)

    def worst(item_ops: list[dict], get) -> float | None:
        return min((v for v in map(get, item_ops) if _finite(v)), default=None)

    series = {
        "this policy (FP8 GEMMs)": [
            worst(o, lambda op: op["numerics"].get("sqnr_db") if op.get("precision") == "fp8" else None) for _, _, o in items
        ]
    }
    for r in recipes:
        series[f"what-if: {r}"] = [worst(o, lambda op, r=r: (op["numerics"].get("what_if") or {}).get(r)) for _, _, o in items]
    svg = _point_chart(
        "plot-sqnr", "SQNR of the FP8 product against fp64 (higher is better)", items, x_title, [("SQNR (dB)", SQNR_AXIS, series)]
    )
    return (
        svg + f'<p class="caption">{_e(what)}; values beyond {SQNR_AXIS[1]:g} dB (exact products) are triangles at the edge.</p>'
    )


def _range_plot(ops: list[dict]) -> str | None:
    measured = [op for op in ops if op.get("precision") == "fp8" and (op.get("numerics") or {}).get("operands")]
    if not measured:
        return None
    items, x_title, what = _items(measured)
    roles = list(dict.fromkeys(role for op in measured for role in op.get("operands") or ("left", "right")))

    def worst(item_ops: list[dict], role: str, key: str) -> float | None:
        found = [
            stats[key]
            for op in item_ops
            for name, stats in zip(op.get("operands") or ("left", "right"), op["numerics"]["operands"])
            if name == role and stats and _finite(stats.get(key))
        ]
        return max(found, default=None)

    panels = [
        (label, None, {role: [worst(o, role, key) for _, _, o in items] for role in roles})
        for label, key in (("underflow (% flushed to 0)", "underflow_pct"), ("saturation (% clamped)", "saturation_pct"))
    ]
    svg = _point_chart("plot-range", "FP8 range: operand values lost to underflow and saturation", items, x_title, panels)
    return svg + f'<p class="caption">{_e(what)}; one marker per operand role.</p>'


def _speedup_plot(ops: list[dict]) -> str | None:
    groups: dict[tuple, list[dict]] = {}  # identical GEMMs of repeated layers share a bar
    for op in ops:
        p = op.get("predicted") or {}
        if op.get("precision") == "fp8" and _finite(p.get("speedup")):
            key = (repeated_site(op["site"]), op["role"], p.get("bf16_us"), p.get("fp8_us"), p["speedup"])
            groups.setdefault(key, []).append(op)
    if not groups:
        return None
    keys = list(groups)
    if len(keys) > MAX_BARS:
        largest = set(sorted(keys, key=lambda k: -sum(op.get("flops", 0) for op in groups[k]))[:MAX_BARS])
        keys = [k for k in keys if k in largest]
    labels = [_short(f"{k[0]} {k[1]}" + (f" ×{len(groups[k])}" if len(groups[k]) > 1 else ""), 60) for k in keys]
    left, right, top, row, bottom = 16 + 6.2 * max(map(len, labels)), 60, 40, 16, 44
    height = top + row * len(keys) + bottom
    ticks = _ticks(0.0, max(1.1, *(k[4] for k in keys)))
    hi = ticks[-1]

    def x(v: float) -> float:
        return left + (WIDTH - left - right) * v / hi

    axis_y = top + row * len(keys)
    out = [
        f'<svg id="plot-speedup" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img">',
        (
            f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="15" font-weight="bold">'
            "Predicted FP8 speedup over BF16 per GEMM</text>"
        ),
    ]
    for t in ticks:
        out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top}" y2="{axis_y}" stroke="#d0d7de"/>')
        out.append(f'<text x="{x(t):.1f}" y="{axis_y + 14}" text-anchor="middle">{t:g}</text>')
    for i, (k, label) in enumerate(zip(keys, labels)):
        y, s = top + i * row, k[4]
        us = f" (BF16 {k[2]:.3g} µs, FP8 {k[3]:.3g} µs)" if _finite(k[2]) and _finite(k[3]) else ""
        out.append(f'<text x="{left - 6:.1f}" y="{y + 12}" text-anchor="end">{_e(label)}</text>')
        out.append(
            f'<rect x="{left:.1f}" y="{y + 2}" width="{max(0.0, x(s) - left):.1f}" height="{row - 4}" '
            f'fill="{RED if s < 1 else GREEN}"><title>{_e(label)}: ×{s:.3f}{us}</title></rect>'
        )
        out.append(f'<text x="{x(s) + 4:.1f}" y="{y + 12}">{s:.2f}</text>')
    out.append(f'<line x1="{x(1):.1f}" x2="{x(1):.1f}" y1="{top - 6}" y2="{axis_y}" stroke="#1f2328" stroke-dasharray="4 3"/>')
    out.append(f'<text x="{x(1):.1f}" y="{top - 9}" text-anchor="middle">1.0 = BF16</text>')
    out.append(
        f'<text x="{left + (WIDTH - left - right) / 2:.1f}" y="{height - 8}" text-anchor="middle">predicted speedup '
        "(BF16 time / FP8 time)</text>"
    )
    shown = (
        f"the {len(keys)} largest by FLOPs of {len(groups)} distinct FP8 GEMMs"
        if len(keys) < len(groups)
        else f"{len(keys)} distinct FP8 GEMMs"
    )
    caption = f"{shown}; ×N: N identical GEMMs of repeated layers; red: slower in FP8 than in BF16."
    return "".join(out) + f'</svg><p class="caption">{_e(caption)}</p>'


MAX_SERIES = 8  # casts drawn in the monitor plot


def _monitor_plot(monitor: dict[str, list[dict]]) -> str | None:
    """Runtime monitor samples over steps: amax (log scale) and the share of values lost to
    saturation and underflow, for the casts that lost most (at most MAX_SERIES)."""
    series = {k: [s for s in v if _finite(s.get("amax")) and s.get("numel")] for k, v in (monitor or {}).items()}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None

    def lost(samples: list[dict]) -> float:
        return sum(s["saturated"] + s["underflow"] for s in samples) / sum(s["numel"] for s in samples)

    keys = sorted(series, key=lambda k: -lost(series[k]))[:MAX_SERIES]
    steps = [s["step"] for k in keys for s in series[k]]
    x_lo, x_hi = min(steps), max(max(steps), min(steps) + 1)
    left, right, top, panel, gap = 70, 20, 40, 150, 50
    legend, last_row = _legend(keys, left, top + 2 * panel + gap + 48)
    height = last_row + 12

    def x(step: float) -> float:
        return left + (WIDTH - left - right) * (step - x_lo) / (x_hi - x_lo)

    amax = [math.log10(max(s["amax"], 1e-30)) for k in keys for s in series[k]]
    panels = [
        ("log10 amax", lambda s: math.log10(max(s["amax"], 1e-30)), (min(amax), max(amax))),
        ("% lost (saturated + underflow)", lambda s: 100 * (s["saturated"] + s["underflow"]) / s["numel"], None),
    ]
    out = [
        f'<svg id="plot-monitor" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img">',
        (
            f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="15" font-weight="bold">'
            "Runtime monitor: FP8 casts over training steps</text>"
        ),
    ]
    for p, (label, value, bounds) in enumerate(panels):
        y0 = top + p * (panel + gap)
        values = [value(s) for k in keys for s in series[k]]
        ticks = _ticks(*(bounds or (0.0, max(values + [1.0]))))

        def y(v: float) -> float:
            return y0 + panel - panel * (v - ticks[0]) / (ticks[-1] - ticks[0] or 1)

        for t in ticks:
            out.append(f'<line x1="{left}" x2="{WIDTH - right}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#d0d7de"/>')
            out.append(f'<text x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
        out.append(f'<text transform="translate(16 {y0 + panel / 2}) rotate(-90)" text-anchor="middle">{_e(label)}</text>')
        for j, k in enumerate(keys):
            points = " ".join(f"{x(s['step']):.1f},{y(value(s)):.1f}" for s in series[k])
            out.append(
                f'<polyline points="{points}" fill="none" stroke="{COLORS[j % len(COLORS)]}" '
                f'stroke-width="1.5"><title>{_e(k)}</title></polyline>'
            )
    for t in _ticks(x_lo, x_hi):
        if x_lo <= t <= x_hi:
            out.append(f'<text x="{x(t):.1f}" y="{top + 2 * panel + gap + 4}" text-anchor="middle">{t:g}</text>')
    out.append(
        f'<text x="{left + (WIDTH - left - right) / 2}" y="{top + 2 * panel + gap + 24}" text-anchor="middle">step '
        "(calls of the cast)</text>"
    )
    caption = f"{len(keys)} of {len(series)} monitored casts, those losing most values first."
    return "".join(out) + legend + f'</svg><p class="caption">{_e(caption)}</p>'


# --- table -----------------------------------------------------------------------------------------

COLUMNS = (
    "site",
    "op",
    "role",
    "M",
    "N",
    "K",
    "FLOP %",
    "precision",
    "formats",
    "scaling",
    "epilogue",
    "FP8/BF16 speedup",
    "SQNR dB",
    "reason",
)


def _row(op: dict) -> str:
    fp8 = op.get("precision") == "fp8"
    speedup = (op.get("predicted") or {}).get("speedup")
    sqnr = (op.get("numerics") or {}).get("sqnr_db")
    cells = [
        (op.get("site"), ""),
        (op.get("op") if op.get("groups") is None else f"{op['op']} ({op['groups']} groups)", ""),
        (op.get("role"), ""),
        (op.get("m"), "num"),
        (op.get("n"), "num"),
        (op.get("k"), "num"),
        (f"{100 * op.get('flop_share', 0):.2f}", "num"),
        (op.get("precision"), "prec"),
        ("×".join(op["formats"]) if op.get("formats") else "-", ""),
        (f"{op.get('scaling')} {op.get('granularity')}" if fp8 else "-", ""),
        (op.get("epilogue") or "-" if fp8 else "-", "epi"),
        (f"{speedup:.2f}" if _finite(speedup) else "-", "num slower" if fp8 and _finite(speedup) and speedup < 1 else "num"),
        (f"{sqnr:.1f}" if _finite(sqnr) else "-", "num"),
        (op.get("reason"), "reason"),
    ]
    tds = "".join(
        f'<td class="{cls}">{_e(text).replace(",", ",<wbr>")}</td>' if cls == "epi"  # wraps after the commas of "bias,gelu,..."
        else f'<td class="{cls}">{_e(text)}</td>' if cls
        else f"<td>{_e(text)}</td>"
        for text, cls in cells
    )
    return f'<tr class="{"fp8" if fp8 else "high"}">{tds}</tr>'


def _table(ops: list[dict]) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in COLUMNS)
    return (
        '<input id="filter" type="search" placeholder="filter rows (site, op, reason…)">'
        f'<table id="gemms"><thead><tr>{head}</tr></thead><tbody>{"".join(map(_row, ops))}</tbody></table>'
    )


def render_html(data: dict) -> str:
    """The report dict (`Report.to_dict()`) as one self-contained HTML page."""
    history = data.get("ops") or []
    ops = [op for op in history if op.get("graph_state") != "superseded"]
    plots = [
        (_sqnr_plot(ops), "SQNR per site: no numerics in this report; `fp8fx analyze --numerics` measures them."),
        (
            _range_plot(ops),
            "Underflow and saturation per operand: no numerics in this report; `fp8fx analyze --numerics` measures them.",
        ),
        (
            _speedup_plot(ops),
            "Predicted speedup per GEMM: no predictions in this report; `fp8fx analyze --target GPU` adds them.",
        ),
    ]
    body = "".join(svg if svg else f'<p class="note">{_e(note)}</p>' for svg, note in plots)
    body += _monitor_plot(data.get("monitor") or {}) or ""  # only for compiled models with a monitor
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">'
        f"<title>fp8fx precision report</title><style>{CSS}</style></head><body>"
        f'<h1>fp8fx precision report</h1><p class="caption">{_e(data.get("schema", ""))}</p>'
        f"<h2>Summary</h2>{_summary(data.get('summary') or {}, [op for op in history if op.get('graph_state') == 'superseded'])}"
        f"<h2>Plots</h2>{body}"
        f"<h2>GEMMs ({len(ops)})</h2>{_table(ops)}<script>{SCRIPT}</script></body></html>"
    )
