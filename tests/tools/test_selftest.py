"""`fp8fx selftest`: the CPU branch end to end, and the GPU branch's pieces on CPU tensors.

The GPU branch cannot run here: its shape and variant planning, inputs, comparisons, timing loops
(with a fake clock), JSON and dispatch table are exercised with the same functions, on the CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fp8fx.cli import app
from fp8fx.codegen import dispatch, versions
from fp8fx.tools import selftest


@pytest.fixture(scope="module")
def uses():
    """The variants of the selftest model's training step under the three recipes."""
    found = selftest.collect_variants()
    torch._dynamo.reset()
    return found


def by_recipe(uses, recipe):
    return [u for u in uses if recipe in u.recipes]


@pytest.mark.slow  # offline builds (ptxas) and the interpreter process: about a minute on 2 cores
def test_cli_selftest_without_a_gpu(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "FP8FX_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-m", "fp8fx", "selftest", "--out", str(out)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("no GPU: no CUDA GPU found") and "CPU checks only" in lines[0]
    (builds_line,) = [line for line in lines if line.startswith("offline builds")]
    done, total = re.search(r": (\d+)/(\d+) passed", builds_line).groups()
    assert done == total and int(total) >= 3, builds_line
    assert "no dispatch table written (no GPU)" in run.stdout and "all " in lines[-1] and "checks passed" in lines[-1]

    data = json.loads(out.read_text())
    assert data["schema"] == "fp8fx.selftest/1" and data["gpu"] is None and data["speed"] is None and data["dispatch_table"] is None
    assert data["passed"] is True and data["environment"]["triton"] and data["no_gpu_reason"]
    assert {r for v in data["variants"] for r in v["recipes"]} == {"tensorwise", "rowwise", "blockwise"}
    builds = [c for c in data["checks"] if c["kind"] == "build"]
    assert {c["arch"] for c in builds} == {"sm_89", "sm_90a", "sm_100a"}  # each of the arch's kernel families
    for c in builds:
        assert c["passed"] and c["spill_bytes"] == 0 and c["fp8_mma"].startswith(selftest.FP8_MMA_PREFIX[c["arch"]]), c
    built = {b["variant"] for b in builds}
    assert {tuple(v["block_a"]) for v in data["variants"] if v["name"] in built} == {(), (1, 0), (1, 128)}  # every granularity built
    gemms = [c for c in data["checks"] if c["kind"] == "gemm" and c["where"] == "interpreter"]
    assert len(gemms) == 6 and all(c["passed"] and c["out"]["passed"] for c in gemms)
    assert {c["m"] for c in gemms} == {7, 37}
    (step,) = [c for c in data["checks"] if c["kind"] == "step"]
    assert step["passed"] and step["kernels"] == "triton" and step["max_shortfall_db"] <= selftest.STEP_SQNR_MARGIN_DB
    assert not (tmp_path / "cache").exists()  # no GPU, no table


@pytest.mark.parametrize("case", ["directory", "missing_parent", "parent_is_a_file"])
def test_bad_out_path_is_one_clear_error(tmp_path, case):
    (tmp_path / "file").write_text("")
    out = {"directory": tmp_path, "missing_parent": tmp_path / "nope" / "r.json", "parent_is_a_file": tmp_path / "file" / "r.json"}[case]
    expected = {"directory": "is a directory", "missing_parent": "does not exist", "parent_is_a_file": "is not a directory"}[case]
    result = CliRunner().invoke(app, ["selftest", "--out", str(out)])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [result.output.strip()]  # one line, before any work
    assert result.output.startswith("error: ") and expected in result.output, result.output


def test_variant_collection_and_planning(uses):
    names = [u.name for u in uses]
    assert len(names) == len(set(names)) >= 12
    for recipe in selftest.RECIPES:
        assert any(u.variant.epilogue.spec() == "" for u in by_recipe(uses, recipe)), recipe  # plain GEMMs
        assert any(u.variant.epilogue.residual for u in by_recipe(uses, recipe)), recipe  # residual adds
    assert any(u.variant.a_dtype == torch.float8_e5m2 for u in by_recipe(uses, "tensorwise"))  # E5M2 gradients in backward
    picks = selftest.heaviest_per_recipe(uses)
    assert [p.variant.block_a for p in picks] == [(), (1, 0), (1, 128)]
    assert all(p.variant.epilogue.activation == "gelu" and p.variant.epilogue.aux != "none" for p in picks)
    plan = selftest.build_plan(picks)
    assert [arch for _, arch in plan] == list(selftest.BUILD_ARCHS) and [u for u, _ in plan] == picks
    timed = selftest.speed_uses(uses)
    (plain_role, plain), (fused_role, fused) = timed[:2]
    assert (plain_role, fused_role) == ("plain", "fused")
    assert plain.variant.epilogue.spec() == "" and plain.variant.a_dtype == torch.float8_e4m3fn and not plain.variant.block_a
    assert fused.variant.epilogue.ops() >= 2 and not fused.variant.block_a
    # Every GEMM of the step as Inductor leaves it (without epilogue) that cuBLAS runs too is timed
    # once, so kernels="auto" can choose each from a measurement: forward and backward, every recipe.
    names = [u.name for _, u in timed]
    assert len(names) == len(set(names)) and {role for role, _ in timed[2:]} == {"bare"}
    assert all(u.variant.epilogue == dispatch.PLAIN for _, u in timed[2:])
    bare = {dispatch.bare_variant(u.variant) for u in uses}
    assert {u.variant for _, u in timed} - {fused.variant} == {v for v in bare if not dispatch.scaled_mm_supports(v)}
    assert {r for _, u in timed[2:] for r in u.recipes} == set(selftest.RECIPES)
    assert any(u.variant.a_dtype == torch.float8_e5m2 for _, u in timed[2:])  # the backward's E5M2 gradients
    for u in uses:  # what the interpreter process is sent comes back equal
        assert selftest.use_from_dict(json.loads(json.dumps(selftest.use_to_dict(u)))) == u


def test_gemm_shapes_are_the_benchmarks():
    shapes = selftest.gemm_shapes()
    mnk = [s[1:] for s in shapes]
    assert len(mnk) == len(set(mnk))
    assert (16384, 16384, 16384) in mnk
    assert (2048, 12288, 4096) in mnk and (2048, 4096, 12288) in mnk and (12288, 4096, 2048) in mnk  # 6.7B qkv: fprop, dgrad, wgrad
    assert (4096, 5120, 20480) in mnk  # 13B mlp_down at sequence 4096
    quick = selftest.gemm_shapes(quick=True)
    assert len(shapes) == 53 and len(quick) == 12 and set(quick) <= set(shapes)  # unique (m, n, k) only


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_gemm_checks_run_the_scaled_mm_path_on_cpu(uses, recipe):
    """torch._scaled_mm has CPU kernels for tensorwise and rowwise scales: the GPU branch's check
    runs whole here, padding of odd shapes included."""
    if recipe == "rowwise" and not versions.cpu_rowwise_scaled_mm():
        pytest.skip("this torch's CPU torch._scaled_mm takes no rowwise scales (torch 2.13's does)")
    for use in by_recipe(uses, recipe):
        for m, n, k in ((7, 64, 256), (37, 48, 144)):
            (check,) = selftest.check_gemm(use, m, n, k, ("scaled_mm",), "cpu", where="test")
            assert check["passed"] and check["path"] == "scaled_mm", check
            assert check["out"]["sqnr_db"] >= selftest.GEMM_SQNR_DB or check["out"]["within_ulps"]


def test_the_gemms_timed_on_a_gpu_run_in_the_interpreter(uses, tmp_path):
    """Every GEMM the GPU branch times (the dispatch table's entries), through the generated kernel
    with the selftest's own inputs, against the exact emulation: in the interpreter's process."""
    timed = [u for _, u in selftest.speed_uses(uses)]
    proc = selftest.start_interpreter(selftest.interpreter_job(timed, shapes=((37, 48, 144),), step_recipe=None), tmp_path)
    checks = selftest.finish_interpreter(proc, tmp_path)
    assert [c.get("variant") for c in checks] == [u.name for u in timed], checks
    assert all(c["passed"] and c["path"] == "generated" for c in checks), checks


def test_a_generated_kernel_failure_is_a_failed_check(uses):
    (check,) = selftest.check_gemm(uses[0], 7, 64, 256, ("generated",), "cpu", where="test")  # no interpreter in this process
    assert not check["passed"] and "TRITON_INTERPRET=1" in check["error"]


def test_comparison_tolerances(uses):
    use = next(u for u in by_recipe(uses, "tensorwise") if u.variant.epilogue.out_amax)
    t = selftest.make_inputs(use, 33, 64, 128)
    ref = selftest.run_reference(use, t)
    assert ref[1] is not None and ref[2] is not None  # aux and amax present
    assert selftest.compare_outputs(ref, ref)["passed"]
    assert selftest.compare_outputs(ref, ref)["out"]["sqnr_db"] == selftest.EXACT_DB
    one_ulp = (ref[0].float() * (1 + 2**-8)).to(ref[0].dtype)
    assert selftest.compare_outputs((one_ulp, ref[1], ref[2]), ref)["out"]["within_ulps"]
    off = (ref[0].float() * 1.05).to(ref[0].dtype)  # 26 dB
    assert not selftest.compare_outputs((off, ref[1], ref[2]), ref)["passed"]
    assert not selftest.compare_outputs((ref[0], ref[1], ref[2] * 1.1), ref)["amax"]["passed"]
    assert not selftest.compare_outputs((ref[0], None, ref[2]), ref)["passed"]
    nan = ref[0].clone()
    nan[0, 0] = float("nan")
    assert not selftest.compare_tensor(nan, ref[0])["passed"]
    assert not selftest.compare_tensor(ref[0].float(), ref[0])["passed"]  # wrong dtype


def test_timing_loops_with_a_fake_clock(uses):
    calls = []

    def fake_bench(fn, grad_to_none=None):
        fn()  # run it once, so a failing kernel fails here
        calls.append(grad_to_none)
        return 2.0

    chosen = selftest.speed_uses(uses)
    rows = selftest.time_gemms(chosen, [("tiny", 7, 64, 256)], "cpu", bench=fake_bench)
    assert [(r["role"], r["variant"]) for r in rows] == [(role, u.name) for role, u in chosen]
    for r in rows[:2]:
        assert r["generated_ms"] is None and "TRITON_INTERPRET" in r["errors"]["generated"]  # CPU, no interpreter
        assert r["scaled_mm_ms"] == r["bf16_ms"] == 2.0 and r["scaled_mm_tflops"] == round(2 * 7 * 64 * 256 / 2e-3 / 1e12, 1)
    summary = selftest.speed_summary(rows)
    assert [(s["role"], s["variant"]) for s in summary] == [(role, u.name) for role, u in chosen]
    assert summary[0]["compared"] == 0 and summary[1]["median_tflops"]["generated"] is None

    dims = selftest.ModelDims(32, 2, 64, 1, 9)
    block = selftest.time_block(dims, "cpu", bench=fake_bench, inner="eager", baseline_backend="eager")
    assert "errors" not in block, block
    assert block["fp8fx_auto_ms"] == block["fp8fx_scaled_mm_ms"] == block["bf16_ms"] == 2.0 and block["fp8fx_auto_speedup_over_bf16"] == 1.0
    assert all(grads and grads[0].shape == (1, 9, 32) for grads in calls[-3:])  # gradients reset between timed steps


def test_dispatch_table_round_trips_and_decides(uses, tmp_path, monkeypatch):
    monkeypatch.setenv("FP8FX_CACHE_DIR", str(tmp_path / "cache"))
    (_, plain), (_, fused) = selftest.speed_uses(uses)[:2]

    def row(use, m, generated, scaled):
        return dict(variant=use.name, role="x", shape=f"square {m}", m=m, n=m, k=m, generated_ms=generated, scaled_mm_ms=scaled,
                    generated_tflops=1.0, scaled_mm_tflops=1.0, bf16_ms=9.0, bf16_tflops=1.0)  # fmt: skip

    rows = [row(plain, 1024, 0.5, 1.0), row(plain, 8192, 3.0, 2.0), row(fused, 1024, None, 1.0)]  # the last one failed: left out
    gpu = dict(name="NVIDIA H100 80GB HBM3", capability="9.0", target="sm_90a", sms=132, memory_gib=79.2)
    table = selftest.dispatch_table(selftest.environment(), gpu, rows)
    path = dispatch.table_path("NVIDIA H100 80GB HBM3")
    selftest.write_json(table, path)
    assert path == tmp_path / "cache" / "dispatch-NVIDIA-H100-80GB-HBM3.json"
    loaded = dispatch.load_table(path)
    assert [(e["m"], e["generated_ms"]) for e in loaded] == [(1024, 0.5), (8192, 3.0)]
    assert json.loads(path.read_text())["device"] == gpu["name"]

    def kernel(variant, shape):
        timing = dispatch.measured_choice(loaded, variant, shape)
        return timing and timing.kernel

    assert kernel(plain.variant, (1000, 1024, 1024)) == "triton"
    assert kernel(plain.variant, (8000, 8192, 8192)) == "scaled_mm"
    assert kernel(plain.variant, (None, 8192, 8192)) == "scaled_mm"  # dynamic M: nearest in N and K
    assert kernel(fused.variant, (1024, 1024, 1024)) is None  # not measured: the default rule decides
    assert dispatch.measured_choice(loaded, plain.variant, (1000, 1024, 1024)).bf16_ms == 9.0  # read as a compile's are


def test_fused_epilogue_against_cublas_bare_gemm(uses, monkeypatch):
    """Under Inductor the generated kernel keeps an epilogue only where it measured faster than
    cuBLAS's bare GEMM (the variant without epilogue): fused and bare at their nearest shapes."""
    (_, plain), (_, fused) = selftest.speed_uses(uses)[:2]
    bare = dispatch.bare_variant(fused.variant)
    assert bare.epilogue == dispatch.PLAIN and bare.out_dtype.itemsize > 1 and dispatch.bare_variant(bare) == bare

    def row(name, m, generated, scaled):
        return dict(variant=name, m=m, n=m, k=m, generated_ms=generated, scaled_mm_ms=scaled)

    table = [row(fused.name, 1024, 0.5, 0.9), row(fused.name, 8192, 3.0, 3.5), row(bare.name, 1024, 0.7, 0.4), row(bare.name, 8192, 9.9, 3.2)]
    fuse, where = dispatch.measured_fusion(table, fused.variant, (1000, 1024, 1024))
    assert not fuse and where == "generated kernel with the epilogue 0.5 ms at 1024x1024x1024, cuBLAS's bare GEMM 0.4 ms at 1024x1024x1024"
    assert dispatch.measured_fusion(table, fused.variant, (8192, 8192, 8192))[0]  # 3.0 ms against 3.2
    assert dispatch.measured_fusion(table[:2], fused.variant, (8192, 8192, 8192)) is None  # the bare GEMM not measured
    shape = (64, 64, 64)  # no tables: a GEMM off a GPU, where no measurement applies
    assert dispatch.epilogue_to_inductor("auto", bare, shape) == ""  # nothing to leave
    assert dispatch.epilogue_to_inductor("triton", fused.variant, shape) == ""
    assert dispatch.epilogue_to_inductor("auto", fused.variant, shape) == dispatch.UNMEASURED_TO_INDUCTOR
    assert "kernels='scaled_mm'" in dispatch.epilogue_to_inductor("scaled_mm", fused.variant, shape)
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert dispatch.epilogue_to_inductor("auto", fused.variant, shape).startswith("Triton is not installed")


def test_report_json(uses, tmp_path):
    status = selftest.GpuStatus(None, "no CUDA GPU found", "cpu")
    ok = [dict(kind="gemm", where="gpu", passed=True, out=dict(passed=True, sqnr_db=55.0)), dict(kind="step", where="gpu", passed=True, min_sqnr_db=float("inf"))]
    bad = ok + [dict(kind="build", where="offline", passed=False, error="x")]
    env = selftest.environment()
    assert selftest.build_report(env, status, uses, ok, None, 1.0, None)["passed"] is True
    assert selftest.build_report(env, status, uses, bad, None, 1.0, None)["passed"] is False
    assert selftest.build_report(env, status, uses, [], None, 1.0, None)["passed"] is False  # nothing checked is no pass
    data = selftest.build_report(env, status, uses, bad, None, 1.0, None)
    assert data["checks"][1]["min_sqnr_db"] is None  # JSON has no inf
    groups = {(g["kind"], g["where"]): g for g in data["summary"]}
    assert groups["gemm", "gpu"] == dict(kind="gemm", where="gpu", passed=1, total=1, min_sqnr_db=55.0)
    assert groups["build", "offline"]["passed"] == 0
    selftest.write_json(data, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["variants"][0]["name"] == uses[0].name


def test_interpreter_process_failure_is_a_failed_check(tmp_path):
    log = open(tmp_path / "child.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    (check,) = selftest.finish_interpreter(proc, tmp_path)
    assert not check["passed"] and "exited with code 3" in check["error"] and "boom" in check["error"]


def test_no_gpu_here():
    status = selftest.gpu_status()
    assert status.info is None and status.label == "cpu" and "torch.cuda.is_available() is False" in status.reason
    assert selftest.default_output(status) == Path.cwd() / "fp8fx-selftest-cpu.json"


def test_summary_lines_of_a_gpu_run(uses, tmp_path):
    """The CLI's summary of a GPU run (fake measurements): groups, each failure, timings, files."""
    from fp8fx.cli import _selftest_lines

    gpu = dict(name="NVIDIA H100 80GB HBM3", capability="9.0", target="sm_90a", sms=132, memory_gib=79.2)
    checks = [
        dict(kind="gemm", where="gpu", variant="v1", path="generated", m=7, n=512, k=256, passed=True, out=dict(passed=True, sqnr_db=61.0)),
        dict(kind="gemm", where="gpu", variant="v2", path="scaled_mm", m=7, n=512, k=256, passed=False, out=dict(passed=False, sqnr_db=12.0)),
        dict(kind="step", where="gpu", recipe="rowwise", kernels="auto", passed=False, min_sqnr_db=21.5, baseline_min_sqnr_db=23.0,
             max_shortfall_db=2.5),
        dict(kind="gemm", where="gpu", variant="v3", path="generated", m=7, n=512, k=256, passed=False, error="RuntimeError: boom"),
    ]
    rows = [
        dict(variant="v1", role="plain", shape="square 1024", m=1024, n=1024, k=1024, generated_ms=0.01, scaled_mm_ms=0.02, bf16_ms=0.03,
             generated_tflops=214.7, scaled_mm_tflops=107.4, bf16_tflops=71.6),
    ]  # fmt: skip
    block = dict(fp8fx_auto_ms=10.0, fp8fx_scaled_mm_ms=11.0, bf16_ms=15.0)
    speed = dict(gemms=rows, summary=selftest.speed_summary(rows), block=block)
    data = selftest.build_report(selftest.environment(), selftest.GpuStatus(gpu, "", "NVIDIA-H100-80GB-HBM3"), uses, checks, speed, 300.0, "/x/t.json")
    result = selftest.SelftestResult(data, tmp_path / "r.json", Path("/x/t.json"), None)
    text = "\n".join(_selftest_lines(result))
    assert "GEMMs vs the CPU reference (generated kernel and torch._scaled_mm): 1/3 passed, min SQNR 12.0 dB" in text
    assert "FAILED gemm v2 scaled_mm 7x512x256: out SQNR 12.0 dB" in text
    assert "FAILED step rowwise auto: min SQNR vs fp32 21.5 dB (kernels='scaled_mm': 23.0 dB), a tensor 2.5 dB short" in text and "FAILED gemm v3 generated 7x512x256: RuntimeError: boom" in text
    assert "plain FP8 GEMM (v1), median TFLOP/s over 1 shapes: generated 214.7, torch._scaled_mm 107.4, BF16 torch.mm 71.6" in text
    assert "generated faster on 1/1" in text and "fp8fx 10.0, fp8fx kernels='scaled_mm' 11.0, BF16 torch.compile 15.0" in text
    assert "dispatch table written to /x/t.json" in text and text.endswith("3 of 4 checks FAILED (300 s)")


def test_gpu_plan():
    plan = selftest.gpu_plan()
    assert plan.timing_shapes == tuple(selftest.gemm_shapes()) and plan.recipes == ("tensorwise", "rowwise", "blockwise")
    assert {m for m, _, _ in plan.check_shapes} >= {7, 1000} and any(k % 16 for _, _, k in plan.check_shapes)  # odd tokens; a token-count K
    assert plan.step_kernels == ("auto", "triton") and plan.inner == "inductor"
    quick = selftest.gpu_plan(quick=True)
    assert len(quick.timing_shapes) == 12 and quick.block_dims.seq < plan.block_dims.seq


def test_gpu_branch_runs_on_cpu_tensors(uses):
    """The GPU branch's loop, on CPU tensors with a fake clock: torch._scaled_mm runs (CPU kernels
    for tensorwise and rowwise), the generated kernel fails without a GPU or the interpreter."""
    tiny = selftest.ModelDims(32, 2, 64, 1, 9)
    plan = selftest.GpuPlan(check_shapes=((7, 64, 256),), recipes=("tensorwise",), step_kernels=("scaled_mm",), step_dims=tiny,
                            timing_shapes=(("tiny", 7, 64, 256),), block_dims=tiny, inner="eager", baseline="eager")  # fmt: skip
    mine = [u for _, u in selftest.speed_uses(uses)[:2]] + by_recipe(uses, "blockwise")[:1]  # plain, fused, blockwise
    seen = []
    checks, speed = selftest.gpu_checks(mine, plan, "cpu", bench=lambda fn, **kw: (fn(), 1.5)[1], progress=lambda *a: seen.append(a[0]))
    gemms = [c for c in checks if c["kind"] == "gemm"]
    assert [(c["variant"], c["path"]) for c in gemms] == [(u.name, p) for u in mine for p in selftest.scaled_mm_paths(u)]
    for c in gemms:  # torch._scaled_mm's CPU kernels have no block scales: blockwise fails here, runs on a GPU
        assert c["passed"] == (c["path"] == "scaled_mm" and c["variant"] != mine[-1].name), c
    (step,) = [c for c in checks if c["kind"] == "step"]
    assert step["passed"] and step["max_shortfall_db"] == 0  # scaled_mm against itself: identical
    assert [r["role"] for r in speed["gemms"]] == ["plain", "fused", "bare"] and speed["block"]["bf16_ms"] == 1.5  # bare: blockwise's GEMM
    assert set(seen) == {"GEMMs against the CPU reference", "training steps against kernels=scaled_mm", "timing GEMMs", "timing a transformer block"}


def test_a_non_finite_step_is_a_failed_check(monkeypatch):
    """A NaN in the checked step fails the check (it has no SQNR), rather than raising."""
    def fake_step(recipe, kernels, *args, **kwargs):
        t = torch.ones(4)
        return [t * float("nan")] if recipe and kernels == "triton" else [t]

    monkeypatch.setattr(selftest, "step_tensors", fake_step)
    check = selftest.check_step("tensorwise", "triton", selftest.INTERPRETER_STEP_DIMS, "cpu", where="test")
    assert check["passed"] is False and "non-finite" in check["error"]
