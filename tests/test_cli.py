"""The command line: the demo trains and prints the report; `python -m fp8fx` works."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from fp8fx.cli import app


def test_demo_trains_and_prints_the_report():
    result = CliRunner().invoke(app, ["demo", "--steps", "3", "--inner", "eager"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["step", "loss(fp8fx)", "loss(fp32)"]
    losses = [tuple(map(float, line.split()[1:])) for line in lines[1:4]]
    assert all(abs(a - b) < 0.05 * b for a, b in losses)  # FP8 tracks fp32
    assert "blocks.1.down" in result.output and "GEMMs in FP8" in result.output


def test_demo_json():
    result = CliRunner().invoke(app, ["demo", "--steps", "1", "--inner", "eager", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["summary"]["fp8_gemms"] == 27


def test_demo_rejects_unknown_inner():
    result = CliRunner().invoke(app, ["demo", "--inner", "tvm"])
    assert result.exit_code == 1
    assert "--inner must be one of inductor, eager" in result.output


def test_python_dash_m_help():
    out = subprocess.run([sys.executable, "-m", "fp8fx", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert "demo" in out.stdout and "policy" in out.stdout
