"""bench/llama_gpu.py's CPU smoke test: a tiny Llama, BF16 beside one fp8fx recipe with and without
the options, each variant in its own process (inner="eager": no Inductor compile), read back from the
JSON it writes; the TE-shaped layer, the bound, the variant names and sets, the memory estimate and
the search for the largest batch under a memory cap (with made-up peaks: a CPU measures none). On
CPU the timings mean nothing: the tests check that the code paths run and fit together."""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8fx.core.recipes import RECIPES

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = "fp8fx-tensorwise-auto-keep-savedfp8-o2"  # every option suffix but -cudagraphs, in one process


def test_llama_bench_tiny_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "llama.json"
    cmd = [sys.executable, str(ROOT / "bench" / "llama_gpu.py"), "--device", "cpu", "--tiny", "--steps", "2", "--warmup", "1",
           "--inner", "eager", "--variants", f"bf16,fp8fx-tensorwise-auto,{OPTIONS}", "--memory-cap", "1", "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["variants"]}
    assert set(rows) == {"bf16", "fp8fx-tensorwise-auto", OPTIONS}
    for r in rows.values():
        assert r["status"] == "ok", r
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"]), r["losses"]
        assert r["step_ms"] > 0 and r["first_step_s"] > 0 and r["peak_memory_bytes"] is None and "cap_batch" not in r
    # Each variant steps with its optimizer; -savedfp8 keeps saved activations in FP8; -o2 times its step beside fused AdamW's.
    assert [r["optimizer"] for r in rows.values()] == ["AdamW", "AdamW", "Fp8AdamW"]
    assert rows[OPTIONS]["fp8fx_report"]["saved_activations"]["fp8_tensors"] > 0
    assert rows["fp8fx-tensorwise-auto"]["fp8fx_report"]["saved_activations"] is None
    assert rows[OPTIONS]["optimizer_ms"] > 0 and rows[OPTIONS]["fused_adamw_ms"] > 0
    assert f"{OPTIONS}: Fp8AdamW step" in run.stdout and "--memory-cap: not measured on CPU" in run.stdout
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
    assert llama_gpu.make_optimizer(torch.nn.Linear(2, 2), "bf16-o2", args) is None
    bf16, fp8 = rows
    assert bf16["losses"] == pytest.approx(fp8["losses"], rel=0.05)  # one batch, no optimizer: the same output each step
    report = fp8["fp8fx_report"]
    assert (report["fp8_gemms"], report["gemms"]) == (12, 14)  # qkv, proj, fc1, fc2 x 3 in FP8; attention's two rows high
    assert {g["site"] for g in fp8["gemms"]} == {"0.qkv", "0.proj", "0.fc1", "0.fc2"}  # attention is not a GEMM of the bound
    llama_gpu.add_ratios(rows)
    llama_gpu.add_bounds(rows)
    # (Its sign is the timings': one step each on a CPU, where BF16's step less its profiled GEMMs can come out below 0.)
    assert fp8["bound_ms"] == pytest.approx(bf16["step_ms"] - bf16["profile"]["gemm_ms"] + fp8["gemm_bound_ms"])
    assert fp8["fraction_of_bound"] == pytest.approx(fp8["bound_ms"] / fp8["step_ms"]) and bf16["bound_ms"] is None
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


def test_option_suffixes_and_the_rows_they_are_set_against():
    """Option suffixes in any order, each once, -keep and -savedfp8 on fp8fx only; -o2 steps with
    Fp8AdamW; an option variant is set against the same variant without -savedfp8 and -o2."""
    sys.path.insert(0, str(ROOT / "bench"))
    import llama_gpu

    from fp8fx.runtime.optim import Fp8AdamW

    assert llama_gpu.split_options("fp8fx-rowwise-auto-o2-savedfp8-cudagraphs") == ("fp8fx-rowwise-auto", {"o2", "savedfp8", "cudagraphs"})
    assert llama_gpu.parse_variant("torchao-rowwise-o2") == ("torchao", "rowwise", None)
    for bad in ("bf16-savedfp8", "torchao-rowwise-keep", "fp8fx-rowwise-auto-o2-o2", "fp8fx-rowwise-o2"):
        with pytest.raises(ValueError, match="unknown variant"):
            llama_gpu.parse_variant(bad)
    args = llama_gpu.parse_args(["--device", "cpu", "--tiny"])
    assert isinstance(llama_gpu.make_optimizer(torch.nn.Linear(2, 2), "bf16-o2-cudagraphs", args), Fp8AdamW)
    assert type(llama_gpu.make_optimizer(torch.nn.Linear(2, 2), "fp8fx-rowwise-auto-savedfp8", args)) is torch.optim.AdamW

    def row(name, step_ms, peak, **more):
        kind, recipe, _ = llama_gpu.parse_variant(name)
        return dict(name=name, kind=kind, recipe=recipe, status="ok", step_ms=step_ms, peak_memory_bytes=peak, **more)

    rows = [row("bf16", 10.0, 100, cap_batch=8), row("torchao-rowwise", 8.0, 90, cap_batch=8, cap_tokens_per_s=1000.0),
            row("fp8fx-rowwise-auto", 8.0, 80), row("fp8fx-rowwise-auto-savedfp8-o2", 8.2, 60, cap_batch=12, cap_tokens_per_s=1200.0)]  # fmt: skip
    llama_gpu.add_ratios(rows[1:], earlier=rows[:1])  # BF16's row from an earlier run (--beside)
    options = rows[-1]
    assert options["plain"] == "fp8fx-rowwise-auto" and (options["step_vs_plain"], options["memory_vs_plain"]) == (8.2 / 8, 0.75)
    assert (options["speedup_vs_bf16"], options["memory_vs_bf16"]) == (10 / 8.2, 0.6)
    assert (options["cap_batch_vs_bf16"], options["cap_tokens_per_s_vs_torchao"]) == (1.5, 1.2)
    assert "plain" not in rows[2] and rows[1]["cap_tokens_per_s_vs_torchao"] is None
    assert "fp8fx-rowwise-auto-savedfp8-o2 against fp8fx-rowwise-auto: step 1.025x, peak 0.750x" in llama_gpu.notes(rows, 40)


@pytest.mark.parametrize("seed", range(40))
def test_the_largest_batch_under_a_cap_with_made_up_peaks(seed):
    """`largest_batch` against trying every batch: peaks growing linearly with the batch (found in 3
    runs beyond the first), faster or slower, or failing (None, as out of memory) from some batch on."""
    sys.path.insert(0, str(ROOT / "bench"))
    import llama_gpu

    rng = random.Random(seed)
    base, fixed, per_sample, power = rng.choice([1, 2, 4]), rng.uniform(1, 8), rng.uniform(0.05, 2), rng.choice([1, 1, 1.3, 0.8])
    oom, cap = rng.choice([None, rng.randrange(1, 200)]), 40

    def peak(batch):
        return None if oom is not None and batch >= oom else fixed + per_sample * batch**power

    fits = list(itertools.takewhile(lambda b: peak(b) is not None and peak(b) <= cap, itertools.count(base, base)))
    found, tried = llama_gpu.largest_batch(peak, base, cap)
    assert found == (fits[-1] if fits else None), tried
    assert all(b % base == 0 and p == peak(b) for b, p in tried.items()) and base in tried
    if power == 1 and oom is None:
        assert len(tried) <= 4, tried
