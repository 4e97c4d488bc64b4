"""The cost model (fp8fx.reporting.costmodel) against published FP8 speedups, and its unit behaviour.

The published figures are those gathered in /work/shared/RESEARCH.md and /work/shared/PUBLISHED.md;
each test cites its line or section. The model's parameters are the defaults of `GpuSpec`, the same
for every test."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import meta_llama
from torch import nn

import fp8fx
from fp8fx.core.policy import Rule
from fp8fx.reporting.costmodel import HIGH_BYTES, TARGETS, GpuSpec, gpu, predict, predict_step
from fp8fx.reporting.op_record import OpRecord


def record(
    role,
    m,
    n,
    k,
    operands,
    op="mm",
    precision="fp8",
    scaling="dynamic",
    granularity="tensorwise",
    flops=None,
    batch=1,
    graph_kind="training",
):
    fp8 = precision == "fp8"
    return OpRecord(
        graph=0, graph_kind=graph_kind, site="x", fqn="x", op=op, role=role, source="", m=m, n=n, k=k, batch=batch,
        flops=flops if flops is not None else 2 * m * n * k * batch, precision=precision, reason_kind="policy", reason="",
        operands=operands, formats=("e4m3", "e4m3") if fp8 else None, scaling=scaling if fp8 else None,
        granularity=granularity if fp8 else None, blocks=None, power_of_two_scales=None, margin=0 if fp8 else None,
        amax_history_len=None, amax_compute_algo=None, interval=None, state_keys=None,
    )  # fmt: skip


def linear(tokens, k_in, n_out, **kw) -> list[OpRecord]:
    """The three GEMMs of a linear layer (k_in -> n_out features) over `tokens` rows, laid out as
    fp8fx's analysis records them."""
    return [
        record("output", tokens, n_out, k_in, ("input", "weight"), **kw),
        record("grad_input", tokens, k_in, n_out, ("grad_output", "weight"), **kw),
        record("grad_weight", n_out, k_in, tokens, ("grad_output", "input"), **kw),
    ]


# --- 1. Peaks -------------------------------------------------------------------------------------


def test_peaks_follow_the_datasheets():
    # RESEARCH.md lines 8-9: Hopper and newer run FP8 at twice the BF16 rate, "H100 SXM dense: ~1979 TFLOP/s FP8 vs ~989 BF16".
    h100 = gpu("h100")
    assert h100 is TARGETS["h100-sxm"] and (h100.fp8_tflops, h100.bf16_tflops) == (1979, 989), "exact datasheet values"
    for name, spec in TARGETS.items():
        assert spec.fp8_tflops >= 2 * spec.bf16_tflops * 0.99, f"{name}: FP8 peak should be >= 2x BF16 within 1%"
    # Blackwell (B200, B300: 4.5 PFLOP/s FP8, 2.25 BF16; GB200: 5 and 2.5), NVFP4 at twice FP8.
    for name, peaks in {"b200": (4500, 2250, 9000), "b300": (4500, 2250, 9000), "gb200": (5000, 2500, 10000)}.items():
        spec = gpu(name)
        assert (spec.fp8_tflops, spec.bf16_tflops, spec.fp4_tflops) == peaks and not spec.fp8_transposes, name
    assert gpu("h100").fp4_tflops is None and gpu("h100").fp8_transposes, "Hopper: no FP4, K-major FP8 only"


# --- 2. TransformerEngine, H200, 5B config: GEMM-level speedups ------------------------------------
# RESEARCH.md lines 56-57: "H200 GEMM-level speedup vs BF16 incl. quantization on a 5B config:
# delayed 1.69x, current 1.57x, block 1.41x (raw kernel 1.92x)".
# Assumed config (TE does not state it): a GPT-style layer of hidden 4096 and FFN 16384
# (24 such layers hold 24 * 12 * 4096^2 = 4.8B parameters), 8192 tokens a step (micro-batch 4 x
# sequence 2048); the forward and backward GEMMs of its four linears (QKV, attention projection,
# FC1, FC2). GEMM level: the linears' GEMMs and their quantization passes, no attention, no other ops.
TE_PUBLISHED = {"delayed": 1.69, "current": 1.57, "block": 1.41, "raw": 1.92}
TE_TOLERANCE = 0.10  # relative; predicted: delayed 1.56, current 1.48, block 1.32, raw 1.83


def te_layer(**kw) -> list[OpRecord]:
    tokens, hidden, ffn = 8192, 4096, 16384
    qkv, proj = linear(tokens, hidden, 3 * hidden, **kw), linear(tokens, hidden, hidden, **kw)
    return qkv + proj + linear(tokens, hidden, ffn, **kw) + linear(tokens, ffn, hidden, **kw)


def te_speedup(recipe: str) -> float:
    h200 = gpu("h200")
    if recipe == "raw":  # the FP8 GEMMs alone, tensorwise, without their passes
        predictions = [predict(op, h200) for op in te_layer()]
        return sum(p.bf16_us for p in predictions) / sum(p.fp8_us - p.passes_us for p in predictions)
    kw = {"delayed": {"scaling": "delayed"}, "current": {}, "block": {"granularity": "blockwise"}}[recipe]
    return predict_step(te_layer(**kw), 0, h200).gemm_speedup


@pytest.mark.parametrize("recipe", list(TE_PUBLISHED))
def test_transformer_engine_h200_gemm_speedups(recipe):
    published, predicted = TE_PUBLISHED[recipe], te_speedup(recipe)
    message = f"{recipe}: predicted {predicted:.3f}x vs published {published}x (tolerance +-{TE_TOLERANCE:.0%})"
    assert abs(predicted / published - 1) <= TE_TOLERANCE, message


def test_transformer_engine_recipe_order():
    speedups = [te_speedup(recipe) for recipe in ("raw", "delayed", "current", "block")]
    assert speedups == sorted(speedups, reverse=True), f"raw > delayed > current > block, got {speedups} (no tolerance)"


# --- 3. GPT-3-shaped one-layer block sweep, TP=8 ---------------------------------------------------
# RESEARCH.md lines 17-20: "A 1-layer GPT-3-shaped block sweep (TP=8) shows FP8 *slower* than BF16
# for small hidden sizes / small batch (...), 1.0-1.3x for mid sizes, >1.3x only for large models
# or large batch x sequence; most cells stay below 1.5x, and seq 8K was worse than 4K."
# The block as Megatron shards it over 8 GPUs: QKV h -> 3h/8 and FC1 h -> 4h/8 split by columns,
# the attention projection h/8 -> h and FC2 4h/8 -> h by rows; causal attention over h/8 of the
# width (fused, BF16). Widths are GPT-3's (its 13B width 5140 rounded to 5120 as Megatron does).
# Non-GEMM bytes, estimated analytically: per token the forward writes and reads once (2 bytes
# each) two layernorm outputs and two residual sums (h each) and the bias + GELU output (4h/8);
# backward moves about twice what forward does: 3 x (4h + 4h/8) elements x 4 bytes a token.
# Communication (the TP all-reduces) is left out, as in the model. The kernels are Megatron's and
# TE's, not fp8fx's: GEMMs at the rates calibrated on TE's published figures (GpuSpec's defaults,
# not the Hopper targets' measured cuBLAS ones), and attention a fused causal kernel at that rate,
# not the masked one transformers hands SDPA under torch.compile (`attention_efficiency`).
TP = 8
TE_RATES = dict(gemm_efficiency=0.72, bf16_efficiency=None, attention_efficiency=0.72)
HIDDEN = (768, 1024, 1536, 2048, 2560, 4096, 5120, 12288)
BATCH_SEQ = ((1, 2048), (4, 2048), (16, 2048), (64, 2048), (2, 4096), (8, 4096), (1, 8192), (4, 8192))


def gpt3_block_speedup(hidden: int, batch: int, seq: int) -> float:
    tokens = batch * seq
    ops = linear(tokens, hidden, 3 * hidden // TP) + linear(tokens, hidden // TP, hidden)
    ops += linear(tokens, hidden, 4 * hidden // TP) + linear(tokens, 4 * hidden // TP, hidden)
    attention = 4 * batch * seq * seq * hidden // TP  # q @ k^T and p @ v, full square, as fp8fx counts them
    forward, backward = ("output", ("input", "weight"), attention), ("grad_input", ("grad_output", "weight"), 2 * attention)
    for role, operands, flops in (forward, backward):
        ops.append(record(role, seq, seq, hidden // TP, operands, op="sdpa", precision="high", flops=flops, batch=batch))
    non_gemm_bytes = tokens * 3 * (4 * hidden + 4 * hidden // TP) * 4
    return predict_step(ops, non_gemm_bytes, replace(gpu("h100"), **TE_RATES)).speedup


def test_gpt3_block_sweep_trends():
    grid = {(h, b, s): gpt3_block_speedup(h, b, s) for h in HIDDEN for b, s in BATCH_SEQ}
    table = "\n".join(f"{h:6d} " + " ".join(f"{grid[h, b, s]:.2f}" for b, s in BATCH_SEQ) for h in HIDDEN)
    bands = "(qualitative bands as published, no margin)"
    # Slower in FP8: small hidden sizes (<= 2048) at any batch, and the smallest batch x seq (2048 tokens) up to 4096.
    slower = [cell for cell in grid if cell[0] <= 2048 or (cell[0] <= 4096 and cell[1] * cell[2] == 2048)]
    assert all(grid[cell] < 1 for cell in slower), f"FP8 should be slower for small hidden / small batch {bands}\n{table}"
    # Mid sizes (hidden 4096-5120, 8K tokens or more): 1.0-1.3x.
    mid = [cell for cell in grid if 4096 <= cell[0] <= 5120 and cell[1] * cell[2] >= 8192]
    assert all(1.0 <= grid[cell] <= 1.3 for cell in mid), f"mid sizes should gain 1.0-1.3x {bands}\n{table}"
    # Above 1.3x only for the largest model at 8K tokens or more, and there it is reached.
    fast = {cell for cell in grid if grid[cell] > 1.3}
    message = f">1.3x only for large models and batch x seq {bands}\n{table}"
    assert fast and all(h == 12288 and b * s >= 8192 for h, b, s in fast), message
    assert sum(x < 1.5 for x in grid.values()) >= 0.9 * len(grid), f"most cells (>= 90%) should stay below 1.5x {bands}\n{table}"
    # At equal tokens, sequence 8K gains less than 4K wherever FP8 gains (attention, kept BF16, grows with seq).
    for h in HIDDEN:
        for b8, b4 in ((1, 2), (4, 8)):
            if grid[h, b4, 4096] > 1:
                message = f"hidden {h}: seq 8K should gain less than 4K {bands}\n{table}"
                assert grid[h, b8, 8192] < grid[h, b4, 4096], message


# --- 4. torchao, Llama3-8B on 8xH100: training step ------------------------------------------------
# RESEARCH.md line 62: "Llama3-8B 8xH100: +25% tok/s tensorwise with FP8 all-gather, +10% rowwise."
# The model predicts one GPU's compute: FSDP communication (which FP8 all-gather shrinks), the
# optimizer step, activation-checkpointing recomputation and host overhead are left out.
# torchtitan, where torchao's figures come from, skips the output projection
# (`module_filter_fn=lambda mod, fqn: fqn != "output"`); fp8fx's recipes put lm_head in FP8 unless a
# rule keeps it high (checked below), so the policy here has that rule. With lm_head in FP8 the
# predictions are 1.27 (tensorwise) and 1.14 (rowwise).
TORCHAO_PUBLISHED = {"tensorwise": 1.25, "rowwise": 1.10}
TORCHAO_TOLERANCE = 0.1  # absolute; predicted: tensorwise 1.17, rowwise 1.06
SEQ = 8192


def llama3_8b_report(recipe: str, seq: int) -> fp8fx.Report:
    model = meta_llama(32, hidden=4096, inter=14336, heads=32, kv=8, vocab=128256)
    policy = fp8fx.Policy.from_recipe(recipe, rules=(Rule(match="lm_head", precision="high"),))
    return fp8fx.analyze(model, (torch.zeros(1, seq, dtype=torch.long, device="meta"),), policy, train=True)


@pytest.fixture(scope="module")
def llama3_8b():
    """Shape-only reports at sequence 8192 per recipe (attention traced as the fused kernel a GPU runs)."""
    return {recipe: llama3_8b_report(recipe, SEQ) for recipe in TORCHAO_PUBLISHED}


@pytest.mark.parametrize("recipe", list(TORCHAO_PUBLISHED))
def test_torchao_llama3_8b_step_speedup(llama3_8b, recipe):
    report = llama3_8b[recipe]
    assert {op.precision for op in report.find(site="lm_head")} == {"high"}, "lm_head kept high, as torchtitan does"
    assert {op.op for op in report.ops if "self_attn" in op.site} == {"mm", "sdpa"}
    step = predict_step(report.ops, sum(report.non_gemm_bytes.values()), gpu("h100"))
    published = TORCHAO_PUBLISHED[recipe]
    assert abs(step.speedup - published) <= TORCHAO_TOLERANCE, (
        f"{recipe}: predicted step {step.speedup:.3f}x vs published {published}x (tolerance +-{TORCHAO_TOLERANCE}); "
        f"GEMMs {step.gemm_speedup:.3f}x, other {step.other_us / step.bf16_us:.0%} of the BF16 step"
    )


def test_fp8fx_recipes_put_lm_head_in_fp8():
    # Why the torchao comparison adds a rule for lm_head.
    settings = fp8fx.Policy.from_recipe("tensorwise").resolve(("lm_head",), "mm").settings
    assert {settings.gemms.output, settings.gemms.grad_input, settings.gemms.grad_weight} == {"fp8"}


# --- 4b. fp8fx's own steps, measured on GPUs (docs/results.md, "On a GPU") --------------------------
# bench/predict_steps.py: bench/llama_gpu.py's models (Llama-3-8B and GPT-3-6.7B layer shapes, 2
# layers, BF16, AdamW) analysed shape-only as `fp8fx analyze --train` does, each step (GEMMs, casts,
# attention, other ops, AdamW) predicted against BF16's. The H200 rows are the Hopper calibration's
# source (a guard against drift); the H100 runs and the GPT-3 shapes did not enter it. Tolerance:
# 15% of the measured speedup; the model is within 6% on each.
STEP_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def measured_steps():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import predict_steps

    return predict_steps.rows(["h100", "h200"])


def test_fp8fx_steps_measured_on_gpus(measured_steps):
    assert len(measured_steps) == 5
    for r in measured_steps:
        error = r["predicted"] / r["measured"] - 1
        what = f"{r['target']} {r['model']} {r['recipe']}: predicted {r['predicted']:.3f}x, measured {r['measured']:.3f}x ({error:+.1%})"
        assert abs(error) <= STEP_TOLERANCE, what
        assert r["predicted"] > 1, what  # FP8 measured faster than BF16 in every one of these steps
        # FP8 leaves a large part of the step alone: AdamW alone is 13-27% of it.
        assert 0.13 <= r["optimizer_ms"] / r["bf16_ms"] <= 0.3 and r["attention_ms"] > 0, what


# --- 5. Published tables: Blackwell formats, DeepGEMM, torchao inference -----------------------------
# Each row: published, predicted and relative error in the assertion message; one tolerance per table.


def with_recipe(op: OpRecord, recipe: str) -> OpRecord:
    """`op` (an FP8 tensorwise record) as TE's recipe `recipe` runs it: TE quantizes in kernels of its
    own, so the passes are the recipe's unfused ones, not those fp8fx's analysis counted."""
    op = replace(op, memory_passes_added=None)
    if recipe == "bf16":
        return replace(op, precision="high", formats=None, scaling=None, granularity=None)
    if recipe == "fp8_delayed":
        return replace(op, scaling="delayed")
    if recipe == "mxfp8":
        return replace(op, granularity="mx", formats=("e4m3", "e4m3"))
    if recipe == "nvfp4":
        return replace(op, granularity="nvfp4_block", formats=("nvfp4", "nvfp4"))
    if recipe == "fp8_block":
        return replace(op, granularity="blockwise", formats=("e4m3", "e4m3"))
    assert recipe == "fp8_current"
    return op


def relative_error(predicted: float, published: float) -> float:
    return predicted / published - 1


# 5a. PUBLISHED.md section A: TE benchmark_gemm.py, 5B config on B300, Fprop per shape (autocast:
# the GEMM and the quantization of its input and weight), ms. M = micro-batch 31 x sequence 512.
# Tolerance 30%: the table disagrees with itself by about that much. BF16 AttnOut runs at 77% of
# the BF16 peak, the other three shapes at 66-68%; QKV under delayed scaling (0.503 ms, its casts
# included) implies an FP8 main loop at 71% or more of the FP8 peak where MLP Up's (0.850 ms) is at
# most 59%; and the per-layer BF16 total moves 3% between the autocast and pre-quantized runs with
# nothing to quantize. One rate per kernel cannot follow that spread more closely; the per-layer
# totals below, which average it out, are held to 20%.
TE_B300_SHAPES = {
    "QKV": (15872, 4096, 12288),
    "AttnOut": (15872, 4096, 4096),
    "MLP Up": (15872, 4096, 16384),
    "MLP Down": (15872, 16384, 4096),
}
TE_B300_RECIPES = ("bf16", "fp8_current", "fp8_delayed", "mxfp8", "nvfp4")
TE_B300_FPROP_MS = {
    "QKV": (1.071, 0.605, 0.503, 0.579, 0.392),
    "AttnOut": (0.307, 0.317, 0.231, 0.269, 0.256),
    "MLP Up": (1.393, 0.924, 0.850, 0.924, 0.635),
    "MLP Down": (1.426, 1.033, 0.901, 1.076, 0.649),
}
TE_B300_FPROP_TOLERANCE = 0.30


@pytest.mark.parametrize("recipe", TE_B300_RECIPES)
@pytest.mark.parametrize("shape", list(TE_B300_SHAPES))
def test_transformer_engine_b300_fprop_per_shape(shape, recipe):
    m, k, n = TE_B300_SHAPES[shape]
    published = TE_B300_FPROP_MS[shape][TE_B300_RECIPES.index(recipe)]
    predicted = predict(with_recipe(record("output", m, n, k, ("input", "weight")), recipe), gpu("b300")).fp8_us / 1000
    error = relative_error(predicted, published)
    message = f"{shape} {recipe}: published {published} ms, predicted {predicted:.3f} ms, error {error:+.1%} (tolerance +-{TE_B300_FPROP_TOLERANCE:.0%})"
    assert abs(error) <= TE_B300_FPROP_TOLERANCE, message


# 5b. Section A's per-layer totals (Fprop + Dgrad + Wgrad of the four linears), through fp8fx.analyze
# of a module of that shape and predict_step (GEMMs only: TE's benchmark times the GEMMs and their
# quantization, no other ops). Autocast includes quantization; pre-quantized is the GEMMs alone
# (predicted: the FP8 time without its passes). Tolerance 20%. Section A's H200 rows (BF16 and FP8
# current pre-quantized, FP8 delayed ("always autocast") and FP8 block autocast) are held as speedups
# over TE's H200 BF16 row: TE does not state the H200 batch, and the Hopper targets' GEMM rates are
# fp8fx's own measured cuBLAS ones (docs/results.md, third run), 25-33% faster than TE's H200 times
# at the assumed batch.
TE_LAYER_MS = {
    ("b300", "autocast", "bf16"): 12.758,
    ("b300", "autocast", "fp8_current"): 9.147,
    ("b300", "autocast", "fp8_delayed"): 7.802,
    ("b300", "autocast", "mxfp8"): 8.984,
    ("b300", "autocast", "nvfp4"): 6.453,
    ("b300", "pre-quantized", "bf16"): 13.102,
    ("b300", "pre-quantized", "fp8_current"): 6.812,
    ("b300", "pre-quantized", "mxfp8"): 7.161,
    ("b300", "pre-quantized", "nvfp4"): 3.764,
}
TE_H200_LAYER_MS = {
    ("pre-quantized", "bf16"): 31.968,
    ("pre-quantized", "fp8_current"): 16.785,
    ("autocast", "fp8_delayed"): 19.099,
    ("autocast", "fp8_block"): 22.882,
}
TE_LAYER_TOLERANCE = 0.20


class TELinears(nn.Module):
    """The four linears of TE's 5B layer (hidden 4096, FFN 16384), chained; a scale before the first
    so its input needs a gradient and every linear has its Dgrad, as in a layer."""

    def __init__(self, hidden: int = 4096, ffn: int = 16384):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, ffn, bias=False)
        self.fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        y = self.proj(self.qkv(x * self.scale)[..., : x.shape[-1]])
        return self.fc2(torch.relu(self.fc1(y)))


@pytest.fixture(scope="module")
def te_layer_ops() -> list[OpRecord]:
    with torch.device("meta"):
        model = TELinears()
    report = fp8fx.analyze(
        model, (torch.zeros(31, 512, 4096, device="meta"),), fp8fx.Policy.from_recipe("tensorwise"), train=True
    )
    assert len(report.ops) == 12 and {(op.precision, op.granularity, op.scaling) for op in report.ops} == {
        ("fp8", "tensorwise", "dynamic")
    }
    return report.ops


def te_layer_ms(te_layer_ops, target: str, mode: str, recipe: str) -> float:
    ops, spec = [with_recipe(op, recipe) for op in te_layer_ops], gpu(target)
    if mode == "autocast":
        return predict_step(ops, 0, spec).gemm_fp8_us / 1000
    return sum(p.fp8_us - p.passes_us for p in (predict(op, spec) for op in ops)) / 1000


@pytest.mark.parametrize("target,mode,recipe", list(TE_LAYER_MS))
def test_transformer_engine_per_layer_totals(te_layer_ops, target, mode, recipe):
    predicted = te_layer_ms(te_layer_ops, target, mode, recipe)
    published = TE_LAYER_MS[target, mode, recipe]
    error = relative_error(predicted, published)
    message = f"{target} {mode} {recipe}: published {published} ms, predicted {predicted:.3f} ms, error {error:+.1%} (tolerance +-{TE_LAYER_TOLERANCE:.0%})"
    assert abs(error) <= TE_LAYER_TOLERANCE, message


@pytest.mark.parametrize("mode,recipe", [key for key in TE_H200_LAYER_MS if key[1] != "bf16"])
def test_transformer_engine_h200_per_layer_speedups(te_layer_ops, mode, recipe):
    bf16 = TE_H200_LAYER_MS["pre-quantized", "bf16"]
    published = bf16 / TE_H200_LAYER_MS[mode, recipe]
    predicted = te_layer_ms(te_layer_ops, "h200", "pre-quantized", "bf16") / te_layer_ms(te_layer_ops, "h200", mode, recipe)
    error = relative_error(predicted, published)
    message = f"h200 {mode} {recipe}: published {published:.3f}x over BF16, predicted {predicted:.3f}x, error {error:+.1%} (tolerance +-{TE_LAYER_TOLERANCE:.0%})"
    assert abs(error) <= TE_LAYER_TOLERANCE, message


def test_transformer_engine_b300_recipe_order(te_layer_ops):
    # Section A's autocast order per layer: NVFP4 < FP8 delayed < MXFP8 < FP8 current < BF16 (no
    # tolerance), except MXFP8 against FP8 current: 8.984 vs 9.147 ms published, 2% apart. The model
    # casts an MXFP8 operand per GEMM (each tensor twice, once along each dimension, as torchao's MX
    # training does); TE quantizes it once into both layouts, which the model does not credit, so it
    # puts MXFP8 7% behind FP8 current: checked as within 10% of it.
    b300 = gpu("b300")
    times = {r: predict_step([with_recipe(op, r) for op in te_layer_ops], 0, b300).gemm_fp8_us for r in TE_B300_RECIPES}
    assert times["nvfp4"] < times["fp8_delayed"] < times["fp8_current"] < times["bf16"], times
    assert times["fp8_delayed"] < times["mxfp8"] < times["bf16"] and abs(times["mxfp8"] / times["fp8_current"] - 1) <= 0.10, times


# 5c. PUBLISHED.md section B: DeepGEMM FP8 GEMMs (1x128 activation / 128x128 weight blocks) on
# H800, pre-quantized, achieved TFLOP/s: predicted as 2mnk over the blockwise FP8 GEMM's time
# without its passes, at the Hopper targets' rates (cuBLAS's, measured by fp8fx: DeepGEMM's kernel is
# not what fp8fx runs). Two tolerances: M = 4096 (compute-bound) 16% (K = 512, where the fixed
# cost per wave weighs most, is at +15%); M = 64 and 128 (bound by
# memory and latency) 30%. There the model's kernel is a launch plus the larger of waves of 128x128
# tiles (split along K when the output has fewer tiles than SMs) and streaming the operands at 0.85
# of bandwidth; DeepGEMM's times are the kernel alone (no launch), it picks narrower tiles and does
# not split K, so N = 2112 at M = 128 leaves SMs idle (published 352, predicted 440) while N = 7168 at
# K = 2048 streams faster than launch + stream (published 295 / 510, predicted 220 / 424).
DEEPGEMM_H800_TFLOPS = {
    (64, 2112, 7168): 206, (64, 24576, 1536): 289, (64, 32768, 512): 219,
    (64, 7168, 16384): 336, (64, 4096, 7168): 287, (64, 7168, 2048): 295,
    (128, 2112, 7168): 352, (128, 24576, 1536): 535, (128, 32768, 512): 358,
    (128, 7168, 16384): 645, (128, 4096, 7168): 533, (128, 7168, 2048): 510,
    (4096, 2112, 7168): 1009, (4096, 24576, 1536): 1125, (4096, 32768, 512): 751,
    (4096, 7168, 16384): 1426, (4096, 4096, 7168): 1265, (4096, 7168, 2048): 1168,
}  # fmt: skip
DEEPGEMM_TOLERANCE = {"compute-bound": 0.16, "small M": 0.30}


@pytest.mark.parametrize("m,n,k", list(DEEPGEMM_H800_TFLOPS))
def test_deepgemm_h800_blockwise_tflops(m, n, k):
    p = predict(record("output", m, n, k, ("input", "weight"), granularity="blockwise"), gpu("h800"))
    predicted, published = 2 * m * n * k / (p.fp8_us - p.passes_us) / 1e6, DEEPGEMM_H800_TFLOPS[m, n, k]
    tolerance = DEEPGEMM_TOLERANCE["compute-bound" if m >= 4096 else "small M"]
    error = relative_error(predicted, published)
    message = (
        f"{m}x{n}x{k}: published {published} TFLOP/s, predicted {predicted:.0f}, error {error:+.1%} (tolerance +-{tolerance:.0%})"
    )
    assert abs(error) <= tolerance, message


# 5d. PUBLISHED.md section D: torchao MXFP8 inference, ReLU -> Linear with M = K = N on B200,
# observed speedup over BF16 (its roofline in the comment). Inference: the weight is quantized once
# at conversion (an inference graph's weight costs no cast), the activation's cast per call, with
# the ReLU fused into it as torch.compile does; BF16 runs the ReLU as its own pass. Tolerance 15%.
TORCHAO_MXFP8_INFERENCE = {1024: 0.96, 2048: 1.22, 4096: 1.50, 8192: 1.76, 16384: 1.81}  # roofline 1.00, 1.76, 1.89, 1.94, 1.97
TORCHAO_MXFP8_TOLERANCE = 0.15


@pytest.mark.parametrize("size", list(TORCHAO_MXFP8_INFERENCE))
def test_torchao_mxfp8_inference_b200(size):
    b200 = gpu("b200")
    p = predict(record("output", size, size, size, ("input", "weight"), granularity="mx", graph_kind="inference"), b200)
    relu_us = b200.launch_us + b200.stream_us(2 * HIGH_BYTES * size * size)  # read and write the BF16 activation
    predicted, published = (p.bf16_us + relu_us) / p.fp8_us, TORCHAO_MXFP8_INFERENCE[size]
    error = relative_error(predicted, published)
    message = f"M=K=N={size}: published {published}x, predicted {predicted:.3f}x, error {error:+.1%} (tolerance +-{TORCHAO_MXFP8_TOLERANCE:.0%})"
    assert abs(error) <= TORCHAO_MXFP8_TOLERANCE, message


# 5e. PUBLISHED.md section C: torchao's MXFP8 grouped GEMMs (forward, grad_input and the 2-D x 2-D
# grad_weight of one expert layer) over bf16 torch._grouped_mm on B200, 128000 routed rows split
# over G experts. Predicted: the three grouped GEMMs of the layer (rows spread evenly, as the model
# takes them), their MX casts included. Tolerance 20%: the published speedups move by up to +-15%
# with G and no trend the shapes explain (DSV3: 1.19, 1.32, 1.60, 1.44 for G = 1, 2, 4, 8), where
# G changes nothing but how rows are cut into tiles; the model's are flat (Scout 1.52-1.57, DSV3
# 1.32-1.37).
TORCHAO_MXFP8_GROUPED = {
    ("Llama4 Scout", 1): 1.808, ("Llama4 Scout", 2): 1.690, ("Llama4 Scout", 4): 1.637, ("Llama4 Scout", 8): 1.700,
    ("DSV3", 1): 1.188, ("DSV3", 2): 1.321, ("DSV3", 4): 1.595, ("DSV3", 8): 1.440,
}  # fmt: skip
TORCHAO_MXFP8_GROUPED_SHAPES = {"Llama4 Scout": (128000, 8192, 5120), "DSV3": (128000, 2048, 7168)}  # M, N, K
TORCHAO_MXFP8_GROUPED_TOLERANCE = 0.20


@pytest.mark.parametrize("model,groups", list(TORCHAO_MXFP8_GROUPED))
def test_torchao_mxfp8_grouped_gemm_b200(model, groups):
    m, n, k = TORCHAO_MXFP8_GROUPED_SHAPES[model]
    ops = [with_recipe(replace(op, op="grouped_mm", groups=groups), "mxfp8") for op in linear(m, k, n)]
    b200 = gpu("b200")
    bf16 = sum(predict(with_recipe(op, "bf16"), b200).bf16_us for op in ops)
    predicted, published = bf16 / sum(predict(op, b200).fp8_us for op in ops), TORCHAO_MXFP8_GROUPED[model, groups]
    error = relative_error(predicted, published)
    message = f"{model} G={groups}: published {published}x, predicted {predicted:.3f}x, error {error:+.1%} (tolerance +-{TORCHAO_MXFP8_GROUPED_TOLERANCE:.0%})"
    assert abs(error) <= TORCHAO_MXFP8_GROUPED_TOLERANCE, message


# --- 6. Unit behaviour ------------------------------------------------------------------------------


def test_a_gemm_kept_high_costs_the_same():
    p = predict(record("output", 4096, 4096, 4096, ("input", "weight"), precision="high"), gpu("h100"))
    assert p.speedup == 1.0 and p.passes_us == 0.0, f"speedup {p.speedup} (tolerance: exactly 1.0)"


def test_small_gemms_are_slower_in_fp8_big_ones_near_the_raw_ratio():
    h100 = gpu("h100")
    small = predict(record("output", 256, 256, 256, ("input", "weight")), h100)
    assert small.speedup < 1, f"256^3 should be slower in FP8, got {small.speedup:.2f}x (no tolerance)"
    big = predict(record("grad_input", 8192, 8192, 8192, ("grad_output", "weight")), h100)
    raw = big.bf16_us / (big.fp8_us - big.passes_us)
    # The peaks' ratio times the main loops' fractions of their peaks (Hopper's FP8 kernels run further from theirs).
    peak_ratio = h100.fp8_tflops * h100.gemm_efficiency / (h100.bf16_tflops * h100.bf16_efficiency)
    assert abs(raw / peak_ratio - 1) <= 0.05, f"8192^3 GEMM alone {raw:.2f}x vs main-loop ratio {peak_ratio:.2f}x (tolerance +-5%)"
    # Its passes (grad_output's cast, the weight's transposed copy) cost about a fifth of the FP8 time.
    message = f"8192^3 with its passes {big.speedup:.2f}x: at least 1.4x (no tolerance), below the GEMM alone ({raw:.2f}x)"
    assert 1.4 <= big.speedup < raw, message


def test_delayed_scaling_is_cheaper_than_dynamic():
    h100 = gpu("h100")
    for role, operands in (("output", ("input", "weight")), ("grad_input", ("grad_output", "weight"))):
        dynamic = predict(record(role, 4096, 4096, 4096, operands), h100)
        delayed = predict(record(role, 4096, 4096, 4096, operands, scaling="delayed"), h100)
        assert delayed.fp8_us < dynamic.fp8_us, f"{role}: delayed scaling (amax inside the cast) should be faster (no tolerance)"


def test_rowwise_casts_every_operand_per_gemm():
    h100 = gpu("h100")
    for tensorwise, rowwise in zip(linear(8192, 4096, 4096), linear(8192, 4096, 4096, granularity="rowwise")):
        assert predict(rowwise, h100).passes_us >= predict(tensorwise, h100).passes_us, rowwise.role
    # grad_weight under tensorwise only transposes FP8 copies made for other GEMMs: cheaper than two casts.
    gw = linear(8192, 4096, 4096)[2]
    assert predict(gw, h100).passes_us < predict(replace(gw, granularity="rowwise"), h100).passes_us


def test_fused_attention_stays_bf16():
    p = predict(record("output", 2048, 2048, 128, ("input", "weight"), op="sdpa", precision="high", batch=32), gpu("h100"))
    assert p.fp8_us == p.bf16_us > 0 and p.passes_us == 0


def test_dynamic_dimensions_give_no_prediction():
    op = replace(record("output", 64, 64, 64, ("input", "weight")), m="s0", flops=0)
    assert predict(op, gpu("h100")) is None
    step = predict_step([op, record("output", 64, 64, 64, ("input", "weight"))], 0, gpu("h100"))
    assert step.gemm_bf16_us > 0 and step.other_us == 0


def test_an_empty_step_gains_nothing():
    step = predict_step([], 0, gpu("h100"))
    assert step.speedup == step.gemm_speedup == 1.0


def test_step_adds_memory_bound_other_time():
    h100 = gpu("h100")
    ops = linear(4096, 4096, 4096)
    bare, with_other = predict_step(ops, 0, h100), predict_step(ops, 10**9, h100)
    assert with_other.other_us == pytest.approx(1e9 / (h100.hbm_tbps * 1e6 * h100.memory_efficiency))
    assert with_other.bf16_us == pytest.approx(bare.bf16_us + with_other.other_us)
    assert 1 < with_other.speedup < with_other.gemm_speedup == bare.gemm_speedup


def test_gpu_by_name_or_spec():
    assert gpu(" H200 ") is TARGETS["h200"]
    assert gpu("fp8=1979,bf16=989,bw=3.35,sms=132,name=mygpu") == GpuSpec("mygpu", 1979, 989, 3.35, 132)
    assert gpu("bf16=100,fp8=200,sms=10,bw=1").name == "custom"


@pytest.mark.parametrize(
    "spec,problem",
    [
        ("bogus", "unknown GPU target 'bogus'"),
        ("fp8=abc", "fp8='abc' is not a positive number"),
        ("fp8=1979,bf16=989,bw=3.35", "missing sms"),
        ("fp8=1979,bf16=989,bw=3.35,sms=13.2", "sms='13.2' is not a positive integer"),
        ("fp8=1979,bf16=989,bw=-1,sms=132", "bw='-1' is not a positive number"),
        ("fp8=1979,bf16=989,bw=3.35,sms=132,clock=2", "bad part 'clock=2'"),
        ("fp8=1979,fp8=989,bw=3.35,sms=132", "bad part 'fp8=989'"),
    ],
)
def test_bad_gpu_names_the_problem_and_the_targets(spec, problem):
    with pytest.raises(ValueError) as error:
        gpu(spec)
    message = str(error.value)
    assert problem in message and all(name in message for name in TARGETS), message


def test_a_granularity_without_a_rate_is_named():
    with pytest.raises(ValueError, match=r"^fp8fx cost model: no main-loop rate for mx1x32 FP8 GEMMs \(x.output\)$"):
        predict(record("output", 64, 64, 64, ("input", "weight"), granularity="mx1x32"), gpu("h100"))


def test_mxfp8_casts_every_operand_per_gemm_with_the_amax_inside():
    b200 = gpu("b200")
    for op in linear(8192, 4096, 4096, granularity="mx"):
        dynamic, delayed = predict(op, b200), predict(replace(op, scaling="delayed"), b200)
        assert dynamic.passes_us == delayed.passes_us > 0, f"{op.role}: one cast kernel per operand, no amax pass"
        rowwise = predict(replace(op, granularity="rowwise"), b200)
        assert dynamic.passes_us < rowwise.passes_us, f"{op.role}: rowwise adds an amax pass per operand"


def test_nvfp4_runs_at_the_fp4_peak():
    b300 = gpu("b300")
    op = record("output", 16384, 16384, 16384, ("input", "weight"), granularity="mx")
    mx, nvfp4 = predict(op, b300), predict(replace(op, granularity="nvfp4_block", formats=("nvfp4", "nvfp4")), b300)
    raw = (mx.fp8_us - mx.passes_us) / (nvfp4.fp8_us - nvfp4.passes_us)
    expected = b300.nvfp4_efficiency * 2 / b300.mx_efficiency
    assert abs(raw / expected - 1) <= 0.05, f"main loop {raw:.2f}x faster than MXFP8, expected {expected:.2f}x (tolerance +-5%)"
    with pytest.raises(ValueError, match=r"^fp8fx cost model: no rate for a GEMM of nvfp4 x e4m3 operands \(x.output\)$"):
        predict(replace(op, formats=("nvfp4", "e4m3")), b300)


@pytest.mark.parametrize("granularity,formats", [("mx", ("e4m3", "e4m3")), ("nvfp4_block", ("nvfp4", "nvfp4"))])
def test_block_scaled_formats_need_blackwell(granularity, formats):
    op = replace(record("output", 64, 64, 64, ("input", "weight"), granularity=granularity), formats=formats)
    with pytest.raises(ValueError, match=r"^fp8fx cost model: h100-sxm has no block-scaled \(MXFP8/NVFP4\) tensor cores"):
        predict(op, gpu("h100"))
    custom = gpu("fp8=4500,bf16=2250,bw=8,sms=148,fp4=9000,name=bw")
    assert custom.fp4_tflops == 9000 and not custom.fp8_transposes and predict(op, custom).fp8_us > 0


def test_blackwell_needs_no_transposed_fp8_copies():
    grad_weight = linear(8192, 4096, 4096)[2]  # reads grad_output and input, cast for the other GEMMs
    assert predict(grad_weight, gpu("h100")).passes_us > 0 == predict(grad_weight, gpu("b200")).passes_us


def test_an_inference_weight_is_not_cast_per_call():
    b200 = gpu("b200")
    for granularity in ("tensorwise", "rowwise", "mx"):
        training = record("output", 4096, 4096, 4096, ("input", "weight"), granularity=granularity)
        inference = replace(training, graph_kind="inference")
        wider = replace(inference, n=4 * 4096)  # four times the weight, the same input
        assert predict(wider, b200).passes_us == predict(inference, b200).passes_us > 0, f"{granularity}: the input's cast only"
        assert predict(inference, b200).passes_us < predict(training, b200).passes_us, granularity
