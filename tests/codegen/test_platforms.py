"""Where fp8fx runs. Without Triton (macOS, Windows, a broken install): import, CPU emulation,
training under both inner compilers, `analyze`, `export` and the report all work, GPUs would run
torch._scaled_mm and the report says why (checked in a subprocess that blocks the import). And
which GPUs are taken: NVIDIA's with FP8 tensor cores, not ROCm's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

BLOCK_TRITON = """
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTriton())
"""

SCRIPT = BLOCK_TRITON + """
import json, tempfile, torch, fp8fx
from fp8fx.codegen.dispatch import triton_available
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
out = {"triton_available": triton_available()}
for inner in ("eager", "inductor"):
    backend = fp8fx.backend(inner=inner)
    x = torch.randn(4, 64, requires_grad=True)
    torch.compile(model, backend=backend)(x).sum().backward()
    out[inner] = sorted({(op.gpu_kernel, op.gpu_kernel_reason) for op in fp8fx.report(backend).fp8_ops})
    out[inner + "_grad_finite"] = bool(x.grad.isfinite().all())
    torch._dynamo.reset()
out["analyze_fp8"] = len(fp8fx.analyze(model, (torch.randn(4, 64),)).fp8_ops)
with tempfile.TemporaryDirectory() as d:
    out["export_fp8"] = sum(s.precision == "fp8" for s in fp8fx.export_onnx(model, (torch.randn(4, 64),), d + "/m.onnx").sites)
try:
    fp8fx.backend(kernels="triton")
    out["forced"] = "accepted"
except Exception as e:
    out["forced"] = str(e).splitlines()[-1]
out["triton_imported"] = "triton" in sys.modules
print(json.dumps(out))
"""


def test_fp8fx_works_without_triton():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["triton_available"] is False and out["triton_imported"] is False
    for inner in ("eager", "inductor"):
        assert out[inner] == [["scaled_mm", "Triton is not installed"]] and out[inner + "_grad_finite"]
    assert out["analyze_fp8"] == 2 and out["export_fp8"] == 2
    assert "needs Triton, which is not installed" in out["forced"]


def test_cli_analyze_without_triton(tmp_path):
    cli = BLOCK_TRITON + "import sys; from fp8fx.cli import main; sys.argv = ['fp8fx'] + sys.argv[1:]; main()"
    run = subprocess.run(
        [sys.executable, "-c", cli, "analyze", str(ROOT / "tests" / "assets" / "mlp.py"), "--format", "json"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["summary"]["fp8_gemms"] > 0


def test_gpu_targets_by_capability():
    """NVIDIA capabilities map to the kernels' targets; ROCm (whose gfx942 reports 9.4) and GPUs
    without FP8 tensor cores are refused with one line naming why."""
    import pytest

    from fp8fx.codegen.variants import arch_of

    assert [arch_of(c) for c in ((8, 9), (9, 0), (10, 0), (10, 3), (12, 0))] == ["sm_89", "sm_90a", "sm_100a", "sm_100a", "sm_89"]
    with pytest.raises(RuntimeError, match="ROCm GPUs are not supported"):
        arch_of((9, 4), hip=True)
    with pytest.raises(RuntimeError, match="capability 8.0 has no FP8 tensor cores"):
        arch_of((8, 0))
