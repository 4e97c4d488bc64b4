"""bench/optim_step.py on the CPU with tiny sizes: it times both optimizers and reports the states'
bytes (the moments take 3/8 of AdamW's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "optim_step.py"


def test_optim_bench_runs_on_the_cpu(tmp_path):
    out = tmp_path / "optim.json"
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--tensors", "20", "--width", "16", "--steps", "2", "--json", str(out)]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    row = json.loads(out.read_text())
    assert row["tensors"] == 20 and row["fp8_adamw_ms"] > 0 and row["torch_adamw_ms"] > 0
    assert row["moment_bytes_ratio"] == 3 / 8 and row["fp8_scale_bytes"] == 20 * 8
    assert "ratio Fp8AdamW / AdamW" in run.stdout
