"""The command line: the demo trains and prints the report; `python -m fp8fx` works; bad input is
one error line, exit code 1 and no file written."""

from __future__ import annotations

import errno
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import fp8fx
from fp8fx.cli import app

ASSETS = Path(__file__).parents[1] / "assets"


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


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


class _CurrentStderr:
    """Writes wherever sys.stderr points at the time (CliRunner swaps it during a run)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@pytest.fixture
def torch_logs_to_stderr(monkeypatch):
    """PyTorch's log handlers hold the stderr of import time: point them at the one a run captures."""
    loggers = [v for k, v in logging.root.manager.loggerDict.items() if k.split(".")[0] == "torch" and isinstance(v, logging.Logger)]
    for handler in {h for logger in loggers for h in logger.handlers if type(h) is logging.StreamHandler}:  # not pytest's own
        monkeypatch.setattr(handler, "stream", _CurrentStderr())


OUTPUT_ERRORS = [
    (["analyze", "missing.py", "-o", "nodir/o.json"], "--output: cannot write nodir/o.json: directory nodir does not exist"),
    (["analyze", "missing.py", "--format", "json", "-o", "adir"], "--output: adir is a directory; give a file name"),
    (["analyze", "missing.py", "--target", "h100", "--suggest-policy", "nodir/s.yaml"], "--suggest-policy: cannot write nodir/s.yaml: directory nodir does not exist"),
    (["policy", "init", "nodir/p.yaml"], "policy init: cannot write nodir/p.yaml: directory nodir does not exist"),
    (["policy", "init", "adir", "--force"], "policy init: adir is a directory; give a file name"),
    (["export", ASSETS / "mlp.py", "--onnx", "adir"], "--onnx: adir is a directory; give a file name"),
    (["bisect", "missing.py", "-o", "nodir/b.yaml"], "--output: cannot write nodir/b.yaml: directory nodir does not exist"),
]


@pytest.mark.parametrize("args,message", OUTPUT_ERRORS, ids=[" ".join(map(str, a[:2])) + f" {a[-1]}" for a, _ in OUTPUT_ERRORS])
def test_an_output_path_that_cannot_be_written_fails_before_any_work(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    result = run(*args)  # checked first: the missing model file is never looked at
    assert (result.exit_code, result.stdout, result.stderr) == (1, "", f"error: {message}\n")
    assert files_under(tmp_path) == []


def test_a_write_that_fails_leaves_no_partial_file(tmp_path, monkeypatch):
    def disk_full(self, target):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "replace", disk_full)
    out = tmp_path / "p.yaml"
    result = run("policy", "init", out)
    assert (result.exit_code, result.stdout, result.stderr) == (1, "", f"error: cannot write {out}: No space left on device\n")
    assert files_under(tmp_path) == []


SHAPE_BUG = """import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(64, 32), nn.Linear(48, 16))


def example_inputs():
    return (torch.randn(2, 64),)
"""


@pytest.mark.parametrize(
    "source,error",
    [
        (SHAPE_BUG, "RuntimeError: a and b must have same reduction dim, but got [2, 32] X [48, 16]. in module '1' (Linear)"),
        (SHAPE_BUG.replace("48", "32").replace("torch.randn(2, 64)", "torch.randn(2, 64, dtype=torch.float64)"),
         "RuntimeError: mat1 and mat2 must have the same dtype, but got Double and Float in module '0' (Linear)"),
    ],
    ids=["shapes", "dtypes"],
)  # fmt: skip
def test_a_model_bug_is_one_line_with_its_cause_and_module(tmp_path, monkeypatch, torch_logs_to_stderr, source, error):
    monkeypatch.chdir(tmp_path)
    Path("m.py").write_text(source)
    result = run("analyze", "m.py")
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == f"error: m.py: running the model raised {error} (--debug for the traceback)\n"


def test_the_line_of_the_model_file_where_it_fails(tmp_path):
    source = SHAPE_BUG.replace("def build_model", "class Twice(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                               "        self.a = nn.Linear(32, 32)\n\n    def forward(self, x):\n        return self.a(self.a(x)[:, :16])\n\n\ndef build_model")
    (tmp_path / "m.py").write_text(source.replace("nn.Linear(48, 16)", "Twice()"))  # fmt: skip
    result = run("analyze", tmp_path / "m.py")
    assert result.exit_code == 1
    assert "but got [2, 16] X [32, 32]. (line 11) in module '1.a' (Linear)" in result.stderr


def test_eager_dtype_rules_hold_in_analysis_on_the_meta_device():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False))
    with pytest.raises(RuntimeError, match="expected m1 and m2 to have the same dtype, but got: double != float"):
        fp8fx.analyze(model, (torch.randn(4, 16, dtype=torch.float64),))
    report = fp8fx.analyze(model, (torch.randn(4, 16),))  # the same model analyses on fp32 inputs
    assert [op.precision for op in report.ops] == ["fp8"]


BAD_MODEL_FILES = {
    "syntax.py": "def build_model(:\n    pass\n",
    "raises.py": "import torch\ndef build_model():\n    raise ValueError('no config')\ndef example_inputs():\n    return torch.randn(2, 2)\n",
    "not_a_tensor.py": "from torch import nn\ndef build_model():\n    return nn.Linear(16, 16)\ndef example_inputs():\n    return [1, 2]\n",
}


@pytest.mark.parametrize(
    "args,message",
    [
        (["missing.py"], "missing.py: no such file"),
        (["syntax.py"], "syntax.py: importing it raised SyntaxError: invalid syntax"),
        (["raises.py"], "raises.py: build_model() raised ValueError: no config (line 3)"),
        (["not_a_tensor.py"], "example_inputs() must give a tensor or a tuple of tensors, got list"),
        ([ASSETS / "mlp.py", "--policy", "nope.yaml"], "nope.yaml"),
        ([ASSETS / "mlp.py", "--recipe", "fast"], "unknown recipe 'fast'"),
        ([ASSETS / "mlp.py", "--target", "gtx480"], "unknown GPU target 'gtx480'"),
        ([ASSETS / "mlp.py", "--fail-under", "2"], "Invalid value for '--fail-under'"),
        ([ASSETS / "mlp.py", "--format", "xml"], "--format must be one of table, json, md, html, got 'xml'"),
    ],
)
def test_bad_input_is_one_line_exit_1_and_no_file(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    for name, source in BAD_MODEL_FILES.items():
        Path(name).write_text(source)
    result = run("analyze", *args, "-o", "report.txt")
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not Path("report.txt").exists()
