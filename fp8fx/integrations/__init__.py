"""fp8fx inside the training frameworks users already run: Hugging Face `Trainer`
(`fp8fx.integrations.transformers`), Accelerate (a model compiled with fp8fx goes through
`accelerator.prepare` unchanged), Lightning (`fp8fx.integrations.lightning`) and torchtitan
(`fp8fx.integrations.torchtitan`).

Each submodule imports its framework when it is imported itself; `import fp8fx` imports none of
them. What they share: the version check, the metrics a callback logs and the report it saves.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from fp8fx.reporting.records import Report
from fp8fx.runtime.monitor import Monitor

REPORT_FILE = "fp8fx_report.json"


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def require(module: str, minimum: str, extra: str, distribution: str | None = None) -> ModuleType:
    """Import `module`, or raise one ImportError line saying what to install (`pip install
    'fp8fx[extra]'`) when it is missing or older than `minimum` (the version of `distribution`,
    the package's name on PyPI, `module` by default)."""
    hint = f"pip install 'fp8fx[{extra}]'"
    try:
        found = importlib.metadata.version(distribution or module)
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"fp8fx.integrations: {distribution or module} is not installed; {hint}") from None
    if _version_tuple(found) < _version_tuple(minimum):
        raise ImportError(f"fp8fx.integrations: {distribution or module} {found} is too old, fp8fx needs >= {minimum}; {hint}")
    return importlib.import_module(module)


def summary_metrics(report: Report) -> dict[str, float]:
    """The report summary's numbers, as `fp8fx/<name>` scalars a logger takes (None values left out)."""
    summary = report.summary()
    out = {}
    for name, value in summary.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[f"fp8fx/{name}"] = float(value)
    for kind, n in summary["fallbacks_by_reason"].items():
        out[f"fp8fx/high_gemms/{kind}"] = float(n)
    return out


class MonitorLog:
    """What the monitor sampled since the last call, per cast: `fp8fx/<cast key>/<statistic>`
    scalars (the newest sample's amax and scale; saturated, underflowed and non-finite values
    summed over the new samples)."""

    def __init__(self, monitor: Monitor):
        self.monitor = monitor
        self.seen: dict[str, int] = {}

    def metrics(self) -> dict[str, float]:
        out = {}
        for key, samples in self.monitor.samples.items():
            new = samples[self.seen.get(key, 0) :]
            self.seen[key] = len(samples)
            if not new:
                continue
            out[f"fp8fx/{key}/amax"] = new[-1].amax
            out[f"fp8fx/{key}/scale"] = new[-1].scale
            for name in ("saturated", "underflow", "non_finite"):
                out[f"fp8fx/{key}/{name}"] = float(sum(getattr(s, name) for s in new))
        return out


def save_report(report: Report, directory: str | Path) -> Path:
    """Write the report's JSON as `directory/fp8fx_report.json` (through a temporary file, so a
    crash never leaves half a report); returns the path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / REPORT_FILE
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".fp8fx_report.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(report.to_json())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def find_backend(model: Any):
    """The fp8fx backend `model` was compiled with (`torch.compile` or `model.compile`), or None."""
    from fp8fx.compiler.backend import _find_backend

    return _find_backend(model)
