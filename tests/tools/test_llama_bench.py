"""bench/llama_gpu.py's CPU smoke test: a tiny Llama, BF16 beside one fp8fx recipe, each variant in
its own process (inner="eager": no Inductor compile), read back from the JSON it writes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_llama_bench_tiny_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "llama.json"
    cmd = [sys.executable, str(ROOT / "bench" / "llama_gpu.py"), "--device", "cpu", "--tiny", "--steps", "2", "--warmup", "1",
           "--inner", "eager", "--variants", "bf16,fp8fx-tensorwise-auto,fp8fx-tensorwise-auto-keep", "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["variants"]}
    assert set(rows) == {"bf16", "fp8fx-tensorwise-auto", "fp8fx-tensorwise-auto-keep"}
    for r in rows.values():
        assert r["status"] == "ok", r
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"]), r["losses"]
        assert r["step_ms"] > 0 and r["first_step_s"] > 0 and r["peak_memory_bytes"] is None
    summary = rows["fp8fx-tensorwise-auto"]["fp8fx_report"]
    assert summary["fp8_gemms"] >= 1, summary
    assert rows["bf16"]["speedup_vs_bf16"] == 1.0
    assert "| fp8fx-tensorwise-auto | ok |" in run.stdout


def test_memory_at_peak_reads_the_allocators_trace():
    """The live set at the step's peak from an allocator trace (the CUDA branch records it, this
    reads it): freed blocks leave it, the peak is the most allocated at once, and each block is
    grouped by the generated code's line that allocated it."""
    sys.path.insert(0, str(ROOT / "bench"))
    import llama_gpu

    code = ROOT / "tests" / "tools" / "torchinductor_fake_code.py"  # a name with "torchinductor", as Inductor's files have

    def alloc(addr, size, line):
        frames = [{"filename": "/x/torch/_ops.py", "line": 1, "name": "op"}, {"filename": str(code), "line": line, "name": "call"}]
        return {"action": "alloc", "addr": addr, "size": size, "frames": frames}

    def free(addr):
        return {"action": "free_requested", "addr": addr, "size": 0}

    entries = [alloc(1, 100, 1), alloc(2, 50, 2), free(1), alloc(3, 70, 2), alloc(4, 10, 1), free(4), alloc(5, 5, 1), free(3)]
    out = llama_gpu.memory_at_peak(entries)
    assert out["peak_bytes"] == 150  # 100 + 50, before the first free (later: 50 + 70 + 10 = 130)
    assert [(r["count"], r["bytes"]) for r in out["live"]] == [(1, 100), (1, 50)]
    assert out["live"][0]["where"].startswith("torchinductor_fake_code.py:1 call")


def test_the_dispatch_table_the_steps_follow_is_recorded(tmp_path, monkeypatch):
    """The CUDA branch records the GPU model's `fp8fx selftest` table (kernels="auto" follows it)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import llama_gpu

    from fp8fx.codegen import dispatch
    from fp8fx.tools import selftest

    monkeypatch.setenv("FP8FX_CACHE_DIR", str(tmp_path))
    gpu = dict(name="NVIDIA H100 80GB HBM3", capability="9.0", target="sm_90a")
    assert llama_gpu.dispatch_table_of(gpu["name"]) is None
    row = dict(variant="v", m=8, n=8, k=16, generated_ms=1.0, scaled_mm_ms=2.0, generated_tflops=1.0, scaled_mm_tflops=1.0, bf16_ms=3.0,
               bf16_tflops=1.0, shape="s")  # fmt: skip
    selftest.write_json(selftest.dispatch_table({}, gpu, [row, row]), dispatch.table_path(gpu["name"]))
    assert llama_gpu.dispatch_table_of(gpu["name"]) == dict(path=str(tmp_path / "dispatch-NVIDIA-H100-80GB-HBM3.json"), gemms=2)
