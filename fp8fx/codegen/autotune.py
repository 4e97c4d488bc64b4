"""Each GEMM's kernel measured where it runs: the measurements `kernels="auto"` decides by on one GPU
model (`Tables`), and the measuring, at the first compile that meets them, of the GEMMs they lack.

`fp8fx selftest` measures a fixed list of shapes, when someone runs it. Here a compile measures the
GEMMs it meets: for each kernel variant and shape that no entry covers, `measure` (the caller's:
`fp8fx.ops.gemm_bench.measure_gemm` runs the kernels) times the generated kernel,
`torch._scaled_mm` and the same GEMM in BF16, and the entry is stored in the selftest table's format
in a cache file per GPU model and versions (`measured_path`), as Inductor's max-autotune cache is. Later compiles, in this
process or another, read it as they read the selftest table. The rules:

- An entry covers a GEMM when it is of the same variant and its shape lies within `COVERED_LOG2` of
  the GEMM's (`fp8fx.codegen.dispatch.log_distance`: the sum over M, N, K of |log2(entry / GEMM)|;
  1.0 is a factor of 2 in one size). A dynamic size (M, or a weight gradient's K) is left out of
  the distance, and measured at the graph's size hint, or at `DYNAMIC_SIZE` without one.
- Both tables' entries decide, the nearest to the GEMM (`fp8fx.codegen.dispatch.nearest`); of
  equally near ones, the selftest table's.
- A process measures for at most `budget_s` seconds in all (`BackendOptions.measure_gemms`, default
  `MEASURE_GEMMS_S`; the measurement under way may end past it). Once spent, the GEMMs left keep
  the unmeasured rule, and their reasons say that the budget ran out.
- A measurement that fails (a kernel error, a file that cannot be written) stores nothing; the
  GEMM's reason gives the error, and this process does not try that GEMM again.
- Writes lock the file (where the OS can), merge what other processes wrote meanwhile (an entry
  already there stays) and replace the file with a renamed temporary one: no writer loses another's
  entries, and no reader sees a torn file.
- A measured file that is not a table of this GPU model and these versions is an error naming it,
  as a bad selftest table is: never a silent wrong choice.
- Files are read again whenever they change on disk, so a choice always follows the files whose
  digest keys Inductor's caches (`table_files`, `fp8fx.compiler.cache.tables_digest`).

Nothing here is CUDA-specific: the tests run it on CPU tensors, with a fake clock and bench.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fp8fx.codegen.dispatch import (
    TABLE_FORMAT,
    cache_dir,
    device_label,
    load_table,
    log_distance,
    nearest,
    read_json,
    table_entries,
    table_path,
)
from fp8fx.codegen.variants import GemmVariant
from fp8fx.codegen.versions import triton_version_string
from fp8fx.core.version import VERSION

MEASURE_GEMMS_S = 20.0  # seconds of measuring per process, by default (BackendOptions.measure_gemms)
COVERED_LOG2 = 1.0  # an entry within this log-distance of a GEMM's shape covers it
DYNAMIC_SIZE = 2048  # where a dynamic size without a size hint is measured

# (variant, (m, n, k)) -> (generated_ms, scaled_mm_ms, bf16_ms); raises when a kernel fails.
Measure = Callable[[GemmVariant, tuple[int, int, int]], tuple[float, float, float]]


def versions() -> dict[str, str]:
    """The versions a measurement holds for: torch's, Triton's and fp8fx's."""
    return {"torch": torch.__version__, "triton": triton_version_string() or "none", "fp8fx": VERSION}


def _versions_tag() -> str:
    return "-".join(f"{name}{re.sub(r'[^A-Za-z0-9.]+', '.', v)}" for name, v in versions().items())


def measured_path(device_name: str) -> Path:
    """The file of the GEMMs measured at compile on one GPU model with these versions:
    `cache_dir()`/measured-<device name>-torch<v>-triton<v>-fp8fx<v>.json."""
    return cache_dir() / f"measured-{device_label(device_name)}-{_versions_tag()}.json"


def table_files() -> list[Path]:
    """The tables `kernels="auto"` may read here: every GPU model's selftest table, and the measured
    ones of these versions."""
    root = cache_dir()
    return sorted([*root.glob("dispatch-*.json"), *root.glob(f"measured-*-{_versions_tag()}.json")])


def load_measured(path: Path, device_name: str) -> list[dict]:
    """The entries of a measured file ([] without one); ValueError naming the file when it is not a
    table measured on `device_name` with these versions."""
    if not path.exists():
        return []
    data = read_json(path)
    gemms = table_entries(data, path)
    if data.get("device") != device_name or data.get("versions") != versions():
        raise ValueError(
            f"{path}: measured on {data.get('device')!r} with {data.get('versions')}, not on {device_name!r} with "
            f"{versions()}; delete the file and fp8fx measures its GEMMs again"
        )
    return gemms


def _read(path: Path, device_name: str | None = None) -> list[dict]:
    """`load_table(path)`, or with `device_name` `load_measured`; [] without the file. Read again
    only when the file changed (a write replaces it: a new inode)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return []
    return _read_once(path, device_name, (st.st_ino, st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=32)
def _read_once(path: Path, device_name: str | None, stamp: tuple) -> list[dict]:
    return load_table(path) if device_name is None else load_measured(path, device_name)


def _key(e: dict) -> tuple:
    return e["variant"], e["m"], e["n"], e["k"]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` among processes, where the OS has `fcntl`."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; the rename still keeps the file whole
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield  # (closing the file releases the lock)


def save_measured(path: Path, device_name: str, new: list[dict]) -> None:
    """Add `new` entries to the measured file, merged with what is in it now (an entry already
    there for the same variant and shape stays), through a temporary file renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        old = load_measured(path, device_name)
        have = {_key(e) for e in old}
        gemms = [*old, *(e for e in new if _key(e) not in have)]
        data = {"format": TABLE_FORMAT, "device": device_name, "versions": versions(), "gemms": gemms}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(data, indent=1, allow_nan=False) + "\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


@dataclass
class Budget:
    """What this process has spent measuring, and the GEMMs whose measurement failed (why, by
    file, variant and shape), which it does not try again."""

    spent_s: float = 0.0
    failed: dict[tuple, str] = field(default_factory=dict)


PROCESS_BUDGET = Budget()


def _ms(value) -> float:
    """A measured time as stored (4 significant digits); ValueError unless finite and > 0."""
    ms = float(value)
    if not 0 < ms < float("inf"):
        raise ValueError(f"the timing gave {value!r} ms")
    return float(f"{ms:.4g}")


def _at(shape: tuple, hint: tuple | None) -> tuple[int, int, int]:
    """The sizes to measure `shape` at: a dynamic one at its hint, or DYNAMIC_SIZE."""
    hint = hint or (None,) * 3
    return tuple(s if s is not None else (h if isinstance(h, int) and h > 0 else DYNAMIC_SIZE) for s, h in zip(shape, hint))


class Tables:
    """The measurements of one GPU model (`fp8fx.codegen.dispatch.Measurements`): its selftest table
    and the GEMMs measured at compile, read again whenever a file changes. With `measure` and a
    budget, `entries` first measures the GEMMs no entry covers (the module's rules).

    Args:
        device_name: the GPU's name (`torch.cuda.get_device_name`), which names its files.
        measure: times one GEMM (`Measure`); None reads the tables only.
        budget_s: seconds of measuring this process may spend in all (0: none).
        budget: the process's spending (`PROCESS_BUDGET`; tests pass their own).
        clock: seconds, for the budget (tests pass a fake one).
    """

    def __init__(
        self,
        device_name: str,
        measure: Measure | None = None,
        budget_s: float = MEASURE_GEMMS_S,
        budget: Budget = PROCESS_BUDGET,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.device_name, self.measure, self.budget_s, self.budget, self.clock = device_name, measure, budget_s, budget, clock
        self.selftest_path, self.measured_path = table_path(device_name), measured_path(device_name)

    def read(self) -> list[dict]:
        """Both tables' entries, the selftest table's first, each with the file it came from
        (`source`) and, if measured at compile, the GPU (`compiled_on`)."""
        own = [dict(e, source=str(self.selftest_path)) for e in _read(self.selftest_path)]
        measured = _read(self.measured_path, self.device_name)
        return own + [dict(e, source=str(self.measured_path), compiled_on=self.device_name) for e in measured]

    def covers(self, variant: GemmVariant, shape: tuple) -> bool:
        e = nearest(self.read(), variant.name, shape)
        return e is not None and log_distance(e, shape) <= COVERED_LOG2

    def entries(self, variants: list[GemmVariant], shape: tuple, hint: tuple | None = None) -> tuple[list[dict], str]:
        """Both tables' entries (`read`) after measuring each of `variants` that none covers at
        `shape` (m, n, k; a dynamic size None, measured at `hint`'s), and why any was not ("")."""
        notes = []
        for variant in variants:
            if self.measure is not None and not self.covers(variant, shape):
                notes.append(self._measure(variant, _at(shape, hint)))
        return self.read(), "; ".join(n for n in dict.fromkeys(notes) if n)

    def _measure(self, variant: GemmVariant, at: tuple[int, int, int]) -> str:
        """Measure `variant` at `at` and store the entry: "", or why it was not stored."""
        failed = (str(self.measured_path), variant.name, *at)
        if failed in self.budget.failed:
            return self.budget.failed[failed]
        if self.budget_s <= 0:
            return "not measured at compile (measure_gemms=0)"
        if self.budget.spent_s >= self.budget_s:
            return f"not measured: this process's budget for measuring GEMMs ran out (measure_gemms={self.budget_s:g} s)"
        start = self.clock()
        try:
            generated_ms, scaled_mm_ms, bf16_ms = self.measure(variant, at)
            entry = {
                "variant": variant.name,
                "m": at[0],
                "n": at[1],
                "k": at[2],
                "generated_ms": _ms(generated_ms),
                "scaled_mm_ms": _ms(scaled_mm_ms),
                "bf16_ms": _ms(bf16_ms),
            }
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run here: recorded, the rule decides
            return self._failed(failed, f"not measured at {'x'.join(map(str, at))}: {error_line(e)}")
        finally:
            self.budget.spent_s += self.clock() - start
        try:
            save_measured(self.measured_path, self.device_name, [entry])
        except OSError as e:
            return self._failed(failed, f"not measured: could not write {self.measured_path}: {error_line(e)}")
        return ""

    def _failed(self, key: tuple, why: str) -> str:
        self.budget.failed[key] = why
        return why


def error_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:500]
