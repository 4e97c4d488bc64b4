"""bench/llama_gpu.py's CPU smoke test: a tiny Llama, BF16 beside one fp8fx recipe, each variant in
its own process (inner="eager": no Inductor compile), read back from the JSON it writes; the TE-shaped
layer, the bound, the variant sets and the memory estimate. On CPU the timings mean nothing: the
tests check that the code paths run and fit together."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8fx.core.recipes import RECIPES

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
    assert "| fp8fx-tensorwise-auto | ok |" in run.stdout and "memory estimate:" in run.stdout
    # The bound: the BF16 step's profiled GEMMs, and each GEMM of the FP8 step's report timed bare.
    assert rows["bf16"]["profile"]["gemm_ms"] > 0 and rows["bf16"]["fraction_of_bound"] is None
    fp8 = rows["fp8fx-tensorwise-auto"]
    assert len(fp8["gemms"]) == summary["fp8_gemms"] == sum(g["fp8_ms"] is not None for g in fp8["gemms"])  # the tiny Llama's GEMMs are all FP8
    assert fp8["bound_ms"] == pytest.approx(rows["bf16"]["step_ms"] - rows["bf16"]["profile"]["gemm_ms"] + fp8["gemm_bound_ms"])
    assert fp8["fraction_of_bound"] == pytest.approx(fp8["bound_ms"] / fp8["step_ms"])


def test_te_layer_and_the_bound_in_process():
    """The TE-shaped layer (forward and backward, no optimizer) under BF16 and fp8fx, run in this
    process, and the bound from their rows."""
    sys.path.insert(0, str(ROOT / "bench"))
    import llama_gpu

    args = llama_gpu.parse_args(["--device", "cpu", "--tiny", "--model", "te-layer", "--steps", "1", "--warmup", "1", "--inner", "eager"])
    assert (args.layers, args.kv_heads, args.vocab) == (1, args.heads, 0)
    rows = [dict(name=n, kind=n.split("-")[0], recipe="tensorwise", status="ok", **llama_gpu.run_variant(n, args))
            for n in ("bf16", "fp8fx-tensorwise-auto")]  # fmt: skip
    assert llama_gpu.make_optimizer(torch.nn.Linear(2, 2), args) is None
    bf16, fp8 = rows
    assert bf16["losses"] == pytest.approx(fp8["losses"], rel=0.05)  # one batch, no optimizer: the same output each step
    report = fp8["fp8fx_report"]
    assert (report["fp8_gemms"], report["gemms"]) == (12, 14)  # qkv, proj, fc1, fc2 x 3 in FP8; attention's two rows high
    assert {g["site"] for g in fp8["gemms"]} == {"0.qkv", "0.proj", "0.fc1", "0.fc2"}  # attention is not a GEMM of the bound
    llama_gpu.add_ratios(rows)
    llama_gpu.add_bounds(rows)
    assert fp8["fraction_of_bound"] > 0 and bf16["bound_ms"] is None
    assert llama_gpu.memory_estimate(args)["params"] == sum(p.numel() for p in llama_gpu.build_model(args, torch.device("meta")).parameters())


def test_variant_sets_and_memory_estimate():
    """`--variants cudagraphs` names every recipe under CUDA graphs (a Hopper GPU skips NVFP4), and
    the memory estimate bounds the 2-layer step's measured BF16 peak (8.00 GiB) from above and fits
    8 layers on an H200 (139 GiB) and an H100 (79 GiB)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import llama_gpu

    args = llama_gpu.parse_args(["--variants", "cudagraphs"])
    assert args.variants[:2] == ["bf16", "bf16-cudagraphs"]
    assert {llama_gpu.parse_variant(v)[1] for v in args.variants[2:]} == set(RECIPES)
    hopper = dict(torchao="0.18", target="sm_90a", capability="9.0")
    assert [v for v in args.variants if llama_gpu.skip_reason(v, hopper)] == ["fp8fx-nvfp4-auto-cudagraphs"]
    two = llama_gpu.memory_estimate(args)
    assert 8.0 < two["bytes"] / 2**30 < 11
    eight = llama_gpu.memory_estimate(llama_gpu.parse_args(["--layers", "8"]))
    assert eight["bytes"] == two["fixed_bytes"] + 8 * two["layer_bytes"] < 79 * 2**30


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
