"""Each GEMM's kernel measured where it runs (`fp8fx.codegen.autotune`): on CPU tensors, with a fake
clock and a fake bench, everything but "is this a CUDA device, which bench, which name" runs here:
what is measured and when, the file per GPU model and versions, the budget, failures, concurrent
writers, the choices and reasons that follow, the pass that asks, and Inductor's cache key."""

from __future__ import annotations

import functools
import itertools
import json
import re
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

import fp8fx
from fp8fx.codegen import autotune, dispatch
from fp8fx.codegen.autotune import Budget, Tables, measured_path, save_measured
from fp8fx.codegen.variants import GemmVariant
from fp8fx.core.epilogue import Epilogue
from fp8fx.ops import gemm_bench
from fp8fx.passes.options import BackendOptions

E4M3 = torch.float8_e4m3fn
PLAIN = GemmVariant(E4M3, E4M3)  # no epilogue: the rule gives it to cuBLAS
FUSED = GemmVariant(E4M3, E4M3, epilogue=Epilogue(bias=True, activation="relu"))
GPU = "Fake GPU 80GB"
SHAPE = (1000, 1024, 1024)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """An empty cache directory, and no table read before this test kept in memory."""
    monkeypatch.setenv("FP8FX_CACHE_DIR", str(tmp_path))
    autotune._read_once.cache_clear()
    yield tmp_path
    autotune._read_once.cache_clear()


class FakeBench:
    """`Measure` with set times (generated_ms, scaled_mm_ms, bf16_ms) per variant, or the same for
    every variant; counts its calls and advances a fake clock by `seconds` per call."""

    def __init__(self, times: dict | tuple, seconds: float = 0.5):
        self.times, self.seconds, self.now, self.calls = times, seconds, 0.0, []

    def clock(self) -> float:
        return self.now

    def __call__(self, variant: GemmVariant, shape: tuple) -> tuple[float, float, float]:
        self.calls.append((variant.name, shape))
        self.now += self.seconds
        return self.times if isinstance(self.times, tuple) else self.times[variant.name]

    def tables(self, budget_s: float = 20.0, budget: Budget | None = None) -> Tables:
        return Tables(GPU, self, budget_s, budget or Budget(), self.clock)


def test_a_new_gemm_is_measured_once_stored_and_read_back(cache):
    bench = FakeBench({PLAIN.name: (0.5, 0.8, 0.6)})
    kernel, reason, timing = choice = dispatch.choose_kernel("auto", PLAIN, SHAPE, bench.tables())
    path = measured_path(GPU)
    assert bench.calls == [(PLAIN.name, SHAPE)] and kernel == "triton"
    assert reason == (
        f"measured at first compile on {GPU} at 1000x1024x1024: generated 0.5 ms, torch._scaled_mm 0.8 ms, BF16 0.6 ms ({path})"
    )
    assert (timing.generated_ms, timing.scaled_mm_ms, timing.bf16_ms, timing.fp8_ms) == (0.5, 0.8, 0.6, 0.5)
    assert path.parent == cache and path.name.startswith("measured-Fake-GPU-80GB-torch") and "-triton" in path.name
    stored = [(e["variant"], e["m"], e["generated_ms"], e["bf16_ms"]) for e in dispatch.load_table(path)]
    assert stored == [(PLAIN.name, 1000, 0.5, 0.6)]

    tables = bench.tables()  # a later compile of this process: a shape within a factor of 2 is covered
    assert dispatch.choose_kernel("auto", PLAIN, (2000, 1024, 1024), tables) == choice
    assert len(bench.calls) == 1
    dispatch.choose_kernel("auto", PLAIN, (4096, 1024, 1024), tables)  # 2**2.03 away: measured too
    assert bench.calls[1:] == [(PLAIN.name, (4096, 1024, 1024))]

    autotune._read_once.cache_clear()  # another process: it reads the file, and measures nothing

    def never(*args):
        raise AssertionError("measured again")

    assert dispatch.choose_kernel("auto", PLAIN, SHAPE, Tables(GPU, never, budget=Budget())) == choice


@pytest.mark.parametrize("generated_ms,kernel", [(0.5, "triton"), (0.9, "scaled_mm")])
def test_the_choice_follows_the_timings(generated_ms, kernel):
    bench = FakeBench({PLAIN.name: (generated_ms, 0.8, 1.0)})
    assert dispatch.choose_kernel("auto", PLAIN, SHAPE, bench.tables())[0] == kernel


@pytest.mark.parametrize("fused_ms,to_inductor", [(0.5, True), (0.3, False)])
def test_the_fused_kernel_is_measured_against_cublas_bare_gemm(fused_ms, to_inductor):
    """Under Inductor: the generated kernel with the epilogue, and the same GEMM bare on both
    kernels, are measured; the epilogue stays fused only where its kernel beat cuBLAS's bare GEMM."""
    bare = dispatch.bare_variant(FUSED)
    bench = FakeBench({FUSED.name: (fused_ms, 0.9, 1.0), bare.name: (0.45, 0.4, 1.0)})
    tables = bench.tables()
    why = dispatch.epilogue_to_inductor("auto", FUSED, SHAPE, tables)
    assert [name for name, _ in bench.calls] == [FUSED.name, bare.name]
    if to_inductor:
        assert why.startswith(
            f"Inductor fuses the epilogue: measured at first compile on {GPU}: generated kernel with the epilogue 0.5 ms"
        )
        assert "cuBLAS's bare GEMM 0.4 ms" in why and str(measured_path(GPU)) in why
        assert dispatch.choose_kernel("auto", bare, SHAPE, tables)[0] == "scaled_mm"  # the bare GEMM: 0.45 against 0.4
    else:
        assert why == ""
        assert dispatch.choose_kernel("auto", FUSED, SHAPE, tables)[0] == "triton"
    assert len(bench.calls) == 2  # the choice of kernel read what was measured


def test_selftest_entries_win_at_equal_distance_and_cover_near_shapes(cache):
    table = {
        "format": dispatch.TABLE_FORMAT,
        "gemms": [{"variant": PLAIN.name, "m": 1000, "n": 1024, "k": 1024, "generated_ms": 2.0, "scaled_mm_ms": 1.0}],
    }
    dispatch.table_path(GPU).write_text(json.dumps(table))
    save_measured(
        measured_path(GPU),
        GPU,
        [{"variant": PLAIN.name, "m": 1000, "n": 1024, "k": 1024, "generated_ms": 0.5, "scaled_mm_ms": 1.0}],
    )
    bench = FakeBench({})
    kernel, reason, _ = dispatch.choose_kernel("auto", PLAIN, SHAPE, bench.tables())
    assert (kernel, bench.calls) == ("scaled_mm", []) and reason.startswith("measured at 1000x1024x1024:")
    assert str(dispatch.table_path(GPU)) in reason


def test_the_budget_stops_measuring_and_the_reasons_say_so():
    bench = FakeBench({PLAIN.name: (0.5, 0.8, 1.0)}, seconds=8.0)
    budget = Budget()
    reasons = [dispatch.choose_kernel("auto", PLAIN, (s, s, s), bench.tables(20.0, budget))[1] for s in (256, 1024, 4096, 16384)]
    assert len(bench.calls) == 3 and budget.spent_s == 24.0  # measuring starts while under 20 s: the third ends past it
    assert all(r.startswith("measured at first compile") for r in reasons[:3])
    # 16384 is far from every measured shape: the nearest still decides, and the reason says why not measured
    assert reasons[3].endswith("not measured: this process's budget for measuring GEMMs ran out (measure_gemms=20 s)")
    plain_rule = dispatch.choose_kernel("auto", FUSED, SHAPE, bench.tables(20.0, budget))  # nothing measured of FUSED
    assert plain_rule == ("triton", "fused epilogue saves 2 memory passes; " + reasons[3].split("; ")[-1], None)

    off = FakeBench({FUSED.name: (0.5, 0.8, 1.0)})
    assert dispatch.choose_kernel("auto", FUSED, SHAPE, off.tables(0.0))[1].endswith("not measured at compile (measure_gemms=0)")
    assert off.calls == []


def test_a_failing_measurement_records_nothing_and_says_why():
    calls = []

    def failing(variant, shape):
        calls.append(shape)
        raise RuntimeError("the generated kernel failed: OutOfMemoryError: CUDA out of memory\nmore")

    tables = Tables(GPU, failing, budget=Budget())
    kernel, reason, _ = dispatch.choose_kernel("auto", PLAIN, SHAPE, tables)
    expected = "not measured at 1000x1024x1024: RuntimeError: the generated kernel failed: OutOfMemoryError: CUDA out of memory"
    assert kernel == "scaled_mm" and reason.startswith("no epilogue to fuse") and reason.endswith(expected)
    assert not measured_path(GPU).exists()
    assert dispatch.choose_kernel("auto", PLAIN, SHAPE, tables)[:2] == (kernel, reason) and len(calls) == 1  # not tried again

    zero = Tables(GPU, lambda v, s: (1.0, 1.0, 0.0), budget=Budget())  # a timing of 0 ms is no measurement
    assert dispatch.choose_kernel("auto", PLAIN, SHAPE, zero)[1].endswith("ValueError: the timing gave 0.0 ms")


def test_the_measured_gemm_runs_the_kernels_through_the_shared_runners():
    """`fp8fx.ops.gemm_bench.measure_gemm` on CPU: the runners selftest uses, the reference for
    torch._scaled_mm, a stand-in for the generated kernel (no interpreter in this process), and the
    same GEMM in BF16 (with the variant's bias: addmm)."""
    ran, times = [], itertools.cycle([1.5, 0.7, 0.9])  # generated, torch._scaled_mm, BF16

    def bench(fn):
        out = fn()
        ran.append(out if isinstance(out, torch.Tensor) else out[0])
        return next(times)

    runners = dict(gemm_bench.RUNNERS, generated=lambda use, t: gemm_bench.run_scaled_mm(use, t))
    measure = functools.partial(gemm_bench.measure_gemm, device="cpu", bench=bench, runners=runners)
    assert measure(FUSED, (16, 32, 48)) == (1.5, 0.7, 0.9) and [tuple(out.shape) for out in ran] == [(16, 32)] * 3
    assert ran[2].dtype == torch.bfloat16 and not torch.equal(ran[2], torch.zeros_like(ran[2]))
    called = []

    class Calls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            called.append(func.__name__)
            return func(*args, **(kwargs or {}))

    for variant in (FUSED, PLAIN):
        gemm = gemm_bench.bf16_gemm(variant, 4, 8, 16, "cpu")
        with Calls():
            gemm()
    assert called == ["addmm", "mm"]  # the bias in the BF16 GEMM where the variant has one
    kernel, reason, _ = dispatch.choose_kernel(
        "auto", FUSED, (None, 32, 48), Tables(GPU, measure, budget=Budget()), hint=(24, 32, 48)
    )
    assert kernel == "scaled_mm" and "at 24x32x48" in reason  # a dynamic M measured at the graph's size hint
    tables = Tables(GPU, functools.partial(gemm_bench.measure_gemm, device="cpu", bench=bench), budget=Budget())
    reason = dispatch.choose_kernel("auto", PLAIN, (None, 32, 48), tables)[1]
    assert f"not measured at {autotune.DYNAMIC_SIZE}x32x48: RuntimeError: the generated kernel failed:" in reason
    assert "TRITON_INTERPRET" in reason


def test_a_corrupt_or_foreign_file_is_an_error_naming_it(cache):
    path = measured_path(GPU)
    path.write_text('{"format": 1, "gemms": [')
    with pytest.raises(ValueError, match=re.escape(f"{path}: not JSON")):
        dispatch.choose_kernel("auto", PLAIN, SHAPE, FakeBench({}).tables())
    save_measured(measured_path("Other GPU"), "Other GPU", [])
    measured_path("Other GPU").replace(path)  # another GPU's file under this one's name
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": measured on 'Other GPU' .* delete the file"):
        dispatch.choose_kernel("auto", PLAIN, SHAPE, FakeBench({}).tables())
    path.unlink()
    dispatch.table_path(GPU).write_text(json.dumps({"format": 1, "gemms": [{"variant": PLAIN.name, "m": 0}]}))
    with pytest.raises(ValueError, match=r"dispatch-Fake-GPU-80GB\.json: gemms\[0\] needs"):
        dispatch.choose_kernel("auto", PLAIN, SHAPE, FakeBench({}).tables())


def test_concurrent_writers_lose_no_entry():
    path = measured_path(GPU)
    theirs = {"variant": FUSED.name, "m": 64, "n": 64, "k": 64, "generated_ms": 1.0, "scaled_mm_ms": 2.0}

    class AnotherProcessWrites(FakeBench):
        def __call__(self, variant, shape):  # between this process's read and its write
            save_measured(path, GPU, [theirs])
            return super().__call__(variant, shape)

    bench = AnotherProcessWrites({PLAIN.name: (0.5, 0.8, 1.0)})
    dispatch.choose_kernel("auto", PLAIN, SHAPE, bench.tables())
    assert [(e["variant"], e["m"]) for e in dispatch.load_table(path)] == [(FUSED.name, 64), (PLAIN.name, 1000)]
    save_measured(path, GPU, [dict(theirs, generated_ms=9.0)])  # the same GEMM again: the first entry stays
    assert [e["generated_ms"] for e in dispatch.load_table(path)] == [1.0, 0.5]
    assert not list(path.parent.glob("*.tmp"))


def test_another_versions_file_is_not_read(cache, monkeypatch):
    bench = FakeBench({PLAIN.name: (0.5, 0.8, 1.0)})
    dispatch.choose_kernel("auto", PLAIN, SHAPE, bench.tables())
    ours = measured_path(GPU)
    assert f"-torch{torch.__version__}".replace("+", ".") in ours.name and "-fp8fx" in ours.name
    assert autotune.table_files() == [ours]
    newer = dict(autotune.versions(), torch="9.9.9")
    monkeypatch.setattr(autotune, "versions", lambda: newer)
    assert measured_path(GPU) != ours and autotune.table_files() == []
    dispatch.choose_kernel("auto", PLAIN, SHAPE, bench.tables())
    assert len(bench.calls) == 2 and measured_path(GPU).exists()  # measured again, for this torch


def on_fake_gpu(monkeypatch, bench: FakeBench) -> None:
    """CPU tensors measured as a GPU's would be: the one hook that is CUDA-specific
    (`gemm_bench.device_tables`) gives `bench`'s tables."""
    monkeypatch.setattr(gemm_bench, "device_tables", lambda device, budget_s: bench.tables(budget_s))


def test_the_pass_measures_the_gemms_it_meets(monkeypatch):
    """fuse_epilogues asks the GPU's tables for each GEMM's kernel."""
    bench = FakeBench((0.5, 0.8, 1.0))
    on_fake_gpu(monkeypatch, bench)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    for options in ({}, {"measure_gemms": 0}):  # the second compile reads what the first measured
        torch._dynamo.reset()
        backend = fp8fx.backend(inner="eager", **options)
        with torch.no_grad():
            torch.compile(model, backend=backend)(torch.randn(4, 64))
        reasons = [op.gpu_kernel_reason for op in fp8fx.report(backend).fp8_ops]
        assert len(reasons) == 2 and all(r.startswith(f"measured at first compile on {GPU} at 4x") for r in reasons), reasons
        assert sorted(shape for _, shape in bench.calls) == [(4, 32, 64), (4, 64, 64)]


def _train_step(policy=None, **options):
    """One training step of a two-Linear model compiled with inner="eager": the backend (keeping
    its graphs), and the compiled model's output beside the model's own."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    backend = fp8fx.backend(policy, inner="eager", keep_graphs=True, **options)
    x = torch.randn(4, 64)
    out = torch.compile(model, backend=backend)(x)
    out.sum().backward()
    return backend, out, model(x)


def test_a_gemm_measured_slower_in_fp8_than_in_bf16_stays_high(monkeypatch):
    on_fake_gpu(monkeypatch, FakeBench((0.5, 0.8, 0.4)))  # the generated kernel: 0.5 ms, BF16: 0.4
    backend, out, expected = _train_step()
    report = fp8fx.report(backend)
    assert len(report.ops) == 5 and not report.fp8_ops  # forward and backward GEMMs alike
    for op in report.ops:
        assert op.reason_kind == "measured" and op.reason.startswith(
            f"measured slower in FP8 than in BF16: the generated kernel 0.5 ms, BF16 torch.mm 0.4 ms, "
            f"measured at first compile on {GPU} at "
        )
        assert str(measured_path(GPU)) in op.reason and op.reason.endswith(f"gemms: {{{op.role}: fp8}} keeps it in FP8")
        assert (op.measured_generated_ms, op.measured_scaled_mm_ms, op.measured_bf16_ms) == (0.5, 0.8, 0.4)
    targets = [str(n.target) for _, gm in backend.kept_graphs for n in gm.graph.nodes]
    assert len(backend.kept_graphs) == 2 and not [t for t in targets if "fp8fx" in t]  # no cast left behind
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # the model's own GEMMs


@pytest.mark.parametrize("rule,in_fp8", [({"precision": "fp8"}, 3), ({"gemms": {"grad_weight": "fp8"}}, 1)])
def test_a_rule_setting_fp8_wins_over_the_measurement_and_the_report_shows_the_times(monkeypatch, rule, in_fp8):
    on_fake_gpu(monkeypatch, FakeBench((0.5, 0.8, 0.4)))
    backend, _, _ = _train_step(fp8fx.Policy(rules=(fp8fx.Rule(match="2", **rule),)))
    report = fp8fx.report(backend)
    assert len(report.fp8_ops) == in_fp8 and all(op.site == "2" for op in report.fp8_ops)
    assert {op.reason_kind for op in report.high_ops} == {"measured"}
    times = "generated 0.5 ms, torch._scaled_mm 0.8 ms, BF16 0.4 ms"
    assert all(
        op.gpu_kernel == "triton" and op.gpu_kernel_reason.startswith(f"measured at first compile on {GPU}")
        for op in report.fp8_ops
    )
    assert all(times in op.gpu_kernel_reason for op in report.fp8_ops)
    text = str(report)
    assert times in text and "measured slower in FP8 than in BF16: the generated kernel 0.5 ms, BF16 torch.mm 0.4 ms" in text
    assert "kept high: measured" in text
    rows = report.to_dict()["ops"]
    assert all((r["measured_generated_ms"], r["measured_scaled_mm_ms"], r["measured_bf16_ms"]) == (0.5, 0.8, 0.4) for r in rows)


def test_a_table_without_bf16_times_still_loads_and_keeps_fp8(cache, monkeypatch):
    """Tables written before fp8fx timed BF16 (and selftest rows whose BF16 timing failed: null)
    still decide the kernel; no GEMM is kept high by them."""
    on_fake_gpu(monkeypatch, FakeBench((0.5, 0.8, 0.4)))
    assert not fp8fx.report(_train_step()[0]).fp8_ops  # measured with BF16 times: kept high
    path = measured_path(GPU)
    data = json.loads(path.read_text())
    for e in data["gemms"]:
        del e["bf16_ms"]
    path.write_text(json.dumps(data))
    on_fake_gpu(monkeypatch, FakeBench(()))  # (never called: every GEMM is covered)
    report = fp8fx.report(_train_step()[0])
    assert len(report.fp8_ops) == 5 and all(
        op.measured_bf16_ms is None and "BF16" not in op.gpu_kernel_reason for op in report.ops
    )

    entry = {"variant": PLAIN.name, "m": 1000, "n": 1024, "k": 1024, "generated_ms": 0.5, "scaled_mm_ms": 0.8}
    table = dispatch.table_path(GPU)
    table.write_text(json.dumps({"format": 1, "gemms": [dict(entry, bf16_ms=None)]}))
    choice = dispatch.choose_kernel("auto", PLAIN, SHAPE, FakeBench(()).tables(0.0))
    assert choice.kernel == "triton" and choice.timing.bf16_ms is None and choice.timing.bf16_faster() == ""
    for bad in (0, "0.4"):
        table.write_text(json.dumps({"format": 1, "gemms": [dict(entry, bf16_ms=bad)]}))
        with pytest.raises(ValueError, match=r"gemms\[0\] needs .* bf16_ms > 0 or null where given"):
            dispatch.choose_kernel("auto", PLAIN, SHAPE, FakeBench(()).tables(0.0))


def test_the_cache_key_follows_the_measured_tables():
    from fp8fx.compiler.backend import _InductorJointHook

    backend = fp8fx.backend()
    before = backend.cache_key()
    assert fp8fx.backend(measure_gemms=5.0).cache_key() != before
    save_measured(
        measured_path(GPU), GPU, [{"variant": PLAIN.name, "m": 64, "n": 64, "k": 64, "generated_ms": 1.0, "scaled_mm_ms": 2.0}]
    )
    after = backend.cache_key()
    assert after != before

    # A compile whose tables change while it runs (it measured) offers Inductor no key after the pass.
    key = ["k1"]
    hook = _InductorJointHook(SimpleNamespace(rewrite=SimpleNamespace(pass_key=lambda: key[0])), "k1")
    assert hook.uuid() == "k1" and not hook.refused
    key[0] = "k2"
    assert hook.uuid() is None and hook.refused


@pytest.mark.parametrize("value", [-1, "20", True, float("inf"), float("nan")])
def test_measure_gemms_is_validated(value):
    with pytest.raises(ValueError, match=r"fp8fx.backend: measure_gemms must be the seconds per process .* got "):
        BackendOptions(measure_gemms=value)
    assert BackendOptions(measure_gemms=0).measure_gemms == 0
