"""The cost model's behaviour over generated shapes (fp8fx.reporting.costmodel): monotonic where it
should be, FP8 slower where launches and casts outweigh the GEMM, and a step that holds what FP8
leaves alone (attention, other ops, the optimizer)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8fx
from fp8fx.reporting.costmodel import gpu, optimizer_us, predict, predict_step
from fp8fx.reporting.op_record import OpRecord

TARGETS = ("h100", "h200", "b200")
SIZES = (64, 256, 1024, 4096, 16384)
# Passes fp8fx's analysis counts on a tensorwise linear's GEMMs (two casts with amaxes; one cast;
# transposed copies and a cast again in backward).
PASSES = {"output": 6, "grad_input": 2, "grad_weight": 7}
OPERANDS = {"output": ("input", "weight"), "grad_input": ("grad_output", "weight"), "grad_weight": ("grad_output", "input")}


def gemm(role: str, m: int, n: int, k: int, precision: str = "fp8", granularity: str = "tensorwise", passes: int | None = None) -> OpRecord:
    fp8 = precision == "fp8"
    return OpRecord(
        graph=0, graph_kind="training", site="x", fqn="x", op="mm", role=role, source="", m=m, n=n, k=k, batch=1,
        flops=2 * m * n * k, precision=precision, reason_kind="policy", reason="", operands=OPERANDS[role],
        formats=("e4m3", "e4m3") if fp8 else None, scaling="dynamic" if fp8 else None, granularity=granularity if fp8 else None,
        blocks=None, power_of_two_scales=None, margin=None, amax_history_len=None, amax_compute_algo=None, interval=None,
        state_keys=None, memory_passes_added=(PASSES[role] if passes is None else passes) if fp8 else None,
    )  # fmt: skip


def linear(tokens: int, k_in: int, n_out: int, **kw) -> list[OpRecord]:
    return [gemm("output", tokens, n_out, k_in, **kw), gemm("grad_input", tokens, k_in, n_out, **kw), gemm("grad_weight", n_out, k_in, tokens, **kw)]


@pytest.mark.parametrize("target", TARGETS)
def test_gemm_times_grow_with_every_dimension(target):
    spec = gpu(target)
    for role, (m, n, k) in itertools.product(PASSES, itertools.product(SIZES, repeat=3)):
        p = predict(gemm(role, m, n, k), spec)
        for bigger in ((2 * m, n, k), (m, 2 * n, k), (m, n, 2 * k)):
            q = predict(gemm(role, *bigger), spec)
            where = f"{target} {role} {m}x{n}x{k} -> {bigger}"
            # (the FP8 GEMM alone as a difference of sums: equal up to rounding when only the passes grow)
            assert q.bf16_us >= p.bf16_us and q.fp8_us - q.passes_us >= p.fp8_us - p.passes_us - 1e-9, where
            assert q.passes_us >= p.passes_us, where  # the counted passes move operand-sized tensors


@pytest.mark.parametrize("target", TARGETS)
def test_fp8_gains_with_size_and_loses_on_small_gemms(target):
    spec = gpu(target)
    speedups = []
    for size in SIZES:
        predictions = [predict(op, spec) for op in linear(size, size, size)]
        speedups.append(sum(p.bf16_us for p in predictions) / sum(p.fp8_us for p in predictions))
        small = [replace(op, predicted=p) for op, p in zip(linear(size, size, size), predictions)]
        if size <= 256:  # launches, and casts that wait for their amax, outweigh the GEMM
            assert all(op.slower for op in small), (target, size, [op.predicted for op in small])
    assert speedups == sorted(speedups) and speedups[-1] > 1.4, (target, speedups)
    # The GEMM alone never gains more than its main loop's rate over BF16's.
    big = predict(gemm("output", 16384, 16384, 16384), spec)
    rate = spec.fp8_tflops * spec.gemm_efficiency / (spec.bf16_tflops * (spec.bf16_efficiency or spec.gemm_efficiency))
    assert big.bf16_us / (big.fp8_us - big.passes_us) <= rate * 1.001


def test_passes_cost_their_bytes_at_the_targets_bandwidth():
    h100, h200 = gpu("h100"), gpu("h200")
    times = [predict(gemm("output", 4096, 4096, 4096, passes=n), h100).passes_us for n in range(9)]
    assert times[0] == 0 and times == sorted(times) and len(set(times)) == len(times), times
    assert 0 < predict(gemm("output", 4096, 4096, 4096), h200).passes_us < predict(gemm("output", 4096, 4096, 4096), h100).passes_us


def test_rowwise_gemms_run_slower_than_tensorwise_with_the_same_passes():
    h100 = gpu("h100")
    for role in PASSES:
        tensorwise, rowwise = (predict(gemm(role, 8192, 8192, 8192, granularity=g), h100) for g in ("tensorwise", "rowwise"))
        assert tensorwise.passes_us == rowwise.passes_us and tensorwise.fp8_us < rowwise.fp8_us < rowwise.bf16_us, role


def test_what_fp8_leaves_alone_dilutes_the_step():
    h100 = gpu("h100")
    ops = linear(8192, 4096, 4096) + linear(8192, 4096, 16384) + linear(8192, 16384, 4096)
    attention = [replace(gemm(role, 4096, 4096, 128, precision="high"), op="sdpa", batch=64, flops=f)
                 for role, f in (("output", 4 * 64 * 4096**2 * 128), ("grad_input", 8 * 64 * 4096**2 * 128))]  # fmt: skip
    bare = predict_step(ops, 0, h100)
    speedups = [bare.speedup]
    for extra_ops, other, params in ((attention, 0, 0), (attention, 10**10, 0), (attention, 10**10, 10**9), (attention, 10**10, 4 * 10**9)):
        step = predict_step(ops + extra_ops, other, h100, params)
        assert step.gemm_speedup == bare.gemm_speedup > 1 and step.attention_us > 0
        assert step.bf16_us == pytest.approx(step.gemm_bf16_us + step.attention_us + step.optimizer_us + step.other_us)
        assert step.fp8_us - step.gemm_fp8_us == pytest.approx(step.bf16_us - step.gemm_bf16_us)  # the same in both
        assert step.optimizer_us == optimizer_us(params, h100)
        speedups.append(step.speedup)
    assert speedups == sorted(speedups, reverse=True) and speedups[-1] > 1, speedups
    # The optimizer grows with the parameters and costs less on faster memory.
    assert 0 == optimizer_us(0, h100) < optimizer_us(10**9, h100) < optimizer_us(2 * 10**9, h100)
    assert optimizer_us(10**9, gpu("b200")) < optimizer_us(10**9, h100)


class TiedAttention(nn.Module):
    """Embedding, attention and an output projection sharing the embedding's weight."""

    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        logits = self.head(self.norm(x + self.proj(y)))
        return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


def test_a_training_step_holds_attention_other_ops_and_the_optimizer():
    with torch.device("meta"):
        model = TiedAttention()
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    assert unique < sum(p.numel() * p.element_size() for m in model.modules() for p in m.parameters(recurse=False))  # tied
    report = fp8fx.analyze(model, (ids,), train=True).with_predictions("h100")
    step, s = report.step, report.summary()
    assert report.param_bytes == unique, "the shared weight counted once, as the optimizer steps it once"
    assert step.optimizer_us == optimizer_us(unique, gpu("h100")) > 0 and step.attention_us > 0 and step.other_us > 0
    assert step.bf16_us == pytest.approx(step.gemm_bf16_us + step.attention_us + step.optimizer_us + step.other_us)
    assert {op.op for op in report.ops} == {"mm", "sdpa"}
    # Tiny GEMMs: every FP8 one is slower than BF16, and so is the step.
    assert s["slower_in_fp8"] == s["fp8_gemms"] > 0 and s["predicted_step_speedup"] < 1
    assert s["predicted_step_ms"]["optimizer"] == pytest.approx(step.optimizer_us / 1e3)
    assert any(line.startswith("predicted step, ms: ") and "optimizer" in line for line in report.summary_lines())
    # Without backward there is no optimizer step to predict.
    inference = fp8fx.analyze(model, (ids,)).with_predictions("h100")
    assert inference.param_bytes is None and inference.step.optimizer_us == 0
    assert any("no optimizer" in line for line in inference.summary_lines())


def test_other_ops_count_every_result_of_an_op_with_several():
    """A layer norm's output, mean and rstd (and its backward's three gradients) are each written
    once and read once: an op with several results was not counted at all, and GPT-3's LayerNorms
    went missing from its step's other ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fp8fx.reporting.traffic import non_gemm_bytes

    rows, cols = 8, 32
    gm = make_fx(lambda x, w, b: torch.ops.aten.native_layer_norm(x, [cols], w, b, 1e-5)[0])(
        torch.randn(rows, cols), torch.ones(cols), torch.zeros(cols)
    )
    assert any(n.target is torch.ops.aten.native_layer_norm.default for n in gm.graph.nodes)
    assert sum(non_gemm_bytes(gm.graph).values()) == 2 * 2 * (rows * cols + rows + rows)  # write + read, 2 bytes
