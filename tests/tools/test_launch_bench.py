"""bench/launch_overhead.py on the CPU (Triton's interpreter, the Triton launch replaced): it runs
the launcher both ways for both kernel families and writes what it printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench" / "launch_overhead.py"


def test_launch_bench_measures_both_families(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "launch.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(BENCH), "--calls", "20", "--json", str(out)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert rows.keys() == {"tma", "pointer"}
    assert all(r["planned_us"] > 0 and r["replanned_us"] > 0 for r in rows.values())
    assert "planned" in run.stdout and "tma" in run.stdout


def test_launch_bench_refuses_the_cpu_without_the_interpreter():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(BENCH), "--calls", "1"], env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "TRITON_INTERPRET=1" in run.stderr
