"""The terminal form of a report: rich tables grouped by layer, red cells, and the summary."""

from __future__ import annotations

import re

from rich.console import Group
from rich.table import Table
from rich.text import Text

from fp8fx.reporting.records import Report


def layer_of(site: str) -> str:
    """The block a site belongs to: `model.layers.3.mlp.up_proj` -> `model.layers.3`."""
    found = re.match(r"(.*?\.\d+)(\.|:|$)", site)
    return found.group(1) if found else site.split(".")[0].split(":")[0]


def rich_report(report: Report) -> Group:
    columns = list(report.columns())
    keep = [i for i, name in enumerate(columns) if name != "graph" or len({op.graph for op in report.ops}) > 1]
    table = Table(title="fp8fx precision report", header_style="bold")
    for i in keep:
        wraps = columns[i] in ("reason", "epilogue", "site")
        table.add_column(columns[i], no_wrap=not wraps, overflow="fold", min_width=28 if columns[i] == "reason" else None)
    first_seen: dict[str, int] = {}
    for i, op in enumerate(report.ops):
        first_seen.setdefault(layer_of(op.site), i)
        first_seen.setdefault(op.site, i)
    roles = ("output", "grad_input", "grad_weight")
    ordered = sorted(
        zip(report.ops, report.rows()),
        key=lambda r: (first_seen[layer_of(r[0].site)], first_seen[r[0].site], roles.index(r[0].role), r[0].graph),
    )
    current = None
    for op, row in ordered:
        layer = layer_of(op.site)
        if layer != current:
            table.add_section()
            if layer != op.site:
                table.add_row(*[Text(layer, style="bold cyan"), *[""] * (len(keep) - 1)])
            current = layer
        cells = [Text(cell) for cell in row]
        if op.precision == "high":
            cells[columns.index("prec")].stylize("yellow")
        if op.slower:  # predicted slower in FP8 than BF16: the red cell
            cells[columns.index("fp8/bf16 x")].stylize("bold white on red")
        table.add_row(*[cells[i] for i in keep])
    return Group(table, Text("\n".join(report.summary_lines())))
