"""Grouped GEMMs (mixture-of-experts layers) in FP8: the fp8fx::fp8_grouped_mm chain against
independent references for every granularity and both forms, the rewritten graphs of a Mixtral
block (aten._grouped_mm in bf16, transformers' grouped-mm custom op in fp32), and tiny
`transformers` MoE models under each experts implementation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import GRAD_SQNR_DB, OUTPUT_SQNR_DB, compile_captured, count, sqnr

import fp8fx
from fp8fx.core import grouped
from fp8fx.core.formats import Fp8Format, saturating_cast
from fp8fx.core.recipes import GRANULARITIES, Granularity
from fp8fx.core.scaling import amax_to_scale, block_amax, expand_blocks

ops = torch.ops.fp8fx
E4M3 = Fp8Format.E4M3
GROUPED_MM = ops.fp8_grouped_mm.default


def _offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)


def _graph_chain(x, offs, form, side, block, power_of_two):
    """One operand cast as insert_casts does (fp8, scale_inv), on already padded operands."""
    spec = grouped.operand_scales(form, side, block)
    if spec.per_group:
        scale = ops.amax_to_scale(ops.grouped_amax(x, offs, spec.group_dim, spec.lines), E4M3.max, 0, power_of_two)
        return ops.grouped_cast(x, scale, offs, spec.group_dim, E4M3.dtype), scale.reciprocal()
    scale = ops.amax_to_scale(ops.amax(x, list(spec.block)), E4M3.max, 0, power_of_two)
    return ops.cast(x, scale, E4M3.dtype, list(spec.block)), scale.reciprocal()


def _fp8_grouped(a, b, offs, form, granularity):
    """The graph's chain: pad (blocks along a grouped K), cast each operand, fp8_grouped_mm."""
    blocks = GRANULARITIES[granularity].blocks(("input", "weight") if form == "2d-3d" else ("grad_output", "input"))
    specs = [grouped.operand_scales(form, side, block) for side, block in enumerate(blocks)]
    align = max(s.align for s in specs)
    if align > 1:
        a, b = ops.pad_groups(a, offs, 1, align), ops.pad_groups(b, offs, 0, align)
        offs = ops.pad_offsets(offs, align)
    mx = granularity is Granularity.MX
    (qa, sa), (qb, sb) = (_graph_chain(x, offs, form, side, block, mx) for side, (x, block) in enumerate(zip((a, b), blocks)))
    return ops.fp8_grouped_mm(qa, qb, sa, sb, offs, torch.float32, list(blocks[0]), list(blocks[1]))


def _dequantized(x: torch.Tensor, block: tuple, power_of_two: bool) -> torch.Tensor:
    """`x` cast to E4M3 with its own scales (`block`, along its last two dims) and dequantized."""
    scale = amax_to_scale(block_amax(x, block), E4M3.max, 0, power_of_two)
    full = expand_blocks(scale, block, x.shape)
    return saturating_cast(x * full, E4M3).float() / full


def _hand_reference(a, b, offs, form, granularity):
    """Each group's operands quantized alone (scales from that group's slice) and multiplied in fp32."""
    left, right = {
        Granularity.TENSORWISE: ((), ()),
        Granularity.ROWWISE: ((1, 0), (0, 1)),
        Granularity.MX: ((1, 32), (32, 1)),
        Granularity.BLOCKWISE: ((1, 128), (128, 128) if form == "2d-3d" else (128, 1)),  # 128 x 128 for the expert weights
    }[granularity]
    if form == "2d-3d" and granularity is Granularity.TENSORWISE:
        right = (0, 0)  # one scale per expert matrix
    p2 = granularity is Granularity.MX
    out = torch.zeros((a.shape[0], b.shape[-1]) if form == "2d-3d" else (len(offs), a.shape[0], b.shape[-1]))
    start = 0
    for g, end in enumerate(offs.tolist()):
        if form == "2d-3d":
            out[start:end] = _dequantized(a[start:end], left, p2) @ _dequantized(b[g], right, p2) if end > start else 0
        elif end > start:
            out[g] = _dequantized(a[:, start:end], left, p2) @ _dequantized(b[start:end], right, p2)
        start = end
    return out


def _operands(form, sizes, k=64, n=48, m=32):
    torch.manual_seed(0)
    total = sum(sizes)
    if form == "2d-3d":  # tokens x experts; experts of different magnitudes (scales per expert matter)
        return torch.randn(total, k), torch.randn(len(sizes), k, n) * torch.tensor([1.0, 10.0, 0.1, 3.0])[
            : len(sizes), None, None
        ]
    return torch.randn(m, total) * 4, torch.randn(total, n)


SIZES = [5, 0, 37, 22]  # an empty group, groups not multiples of 16 or 32


@pytest.mark.parametrize("form", ["2d-3d", "2d-2d"])
@pytest.mark.parametrize("granularity", [Granularity.TENSORWISE, Granularity.ROWWISE, Granularity.MX, Granularity.BLOCKWISE])
def test_fp8_grouped_mm_matches_a_per_group_reference(form, granularity):
    a, b = _operands(form, SIZES, k=256)  # K of two 128-blocks
    offs = _offsets(SIZES)
    out = _fp8_grouped(a, b, offs, form, granularity)
    reference = _hand_reference(a, b, offs, form, granularity)
    exact = (
        torch.stack([a[:, s:e] @ b[s:e] for s, e in zip([0, *offs.tolist()[:-1]], offs.tolist())])
        if form == "2d-2d"
        else torch._grouped_mm(a, b, offs=offs)
    )
    # The same FP8 values either way; only the fp32 summation order differs (measured 133-188 dB).
    assert sqnr(out, reference) > 100
    assert sqnr(out, exact) > OUTPUT_SQNR_DB  # FP8's window: 28-29 dB measured
    if form == "2d-2d":
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # the empty group


def test_mx_matches_torchao_emulated_grouped_mm():
    # torchao's MXFP8 quantization (to_mx, RCEIL) and its emulated grouped GEMMs, on group extents
    # that are multiples of 32 (torchao's 2-D x 2-D takes blocks over the whole K).
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    moe = pytest.importorskip("torchao.prototype.moe_training.mxfp8_grouped_mm")
    rceil = mx.ScaleCalculationMode.RCEIL

    def to_mx(x):  # blocks of 32 along the last dim
        scale, data = mx.to_mx(x.contiguous(), torch.float8_e4m3fn, 32, scaling_mode=rceil)
        return data, scale.view(torch.float8_e8m0fnu).float()

    sizes = [64, 0, 32, 96]
    offs = _offsets(sizes)
    a, w = _operands("2d-3d", sizes)
    a_data, a_scale = to_mx(a)
    w_data, w_scale = to_mx(w.transpose(-2, -1))  # [E, N, K]: blocks along K
    theirs = moe._emulated_mxfp8_scaled_grouped_mm_2d_3d(
        a_data, a_scale, w_data.transpose(-2, -1), w_scale.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16
    ).float()
    assert sqnr(_fp8_grouped(a, w, offs, "2d-3d", Granularity.MX), theirs) > 45  # theirs rounds to bf16 (measured 56 dB)

    x, g = _operands("2d-2d", sizes)  # wgrad: x [M, K_total], g [K_total, N]
    x_data, x_scale = to_mx(x)
    g_data, g_scale = to_mx(g.t())
    theirs = moe._emulated_mxfp8_scaled_grouped_mm_2d_2d(
        x_data, x_scale, g_data, g_scale, offs=offs, out_dtype=torch.bfloat16
    ).float()
    assert sqnr(_fp8_grouped(x, g, offs, "2d-2d", Granularity.MX), theirs) > 45


def test_pad_groups_keeps_each_group_and_drops_the_rest():
    x = torch.arange(20.0).reshape(10, 2)
    offs = _offsets([3, 0, 6])  # row 9 is in no group
    padded, new_offs = ops.pad_groups(x, offs, 0, 4), ops.pad_offsets(offs, 4)
    assert new_offs.tolist() == [4, 4, 12] and padded.shape == (grouped.padded_extent(10, 3, 4), 2)
    assert torch.equal(padded[:3], x[:3]) and torch.equal(padded[4:10], x[3:9])
    assert padded[3].abs().sum() == 0 and padded[10:].abs().sum() == 0


def test_cuda_dispatch_feeds_scaled_grouped_mm_what_it_takes(monkeypatch):
    # The CUDA implementation on CPU tensors, with torch._scaled_grouped_mm replaced by a check of
    # its arguments on the meta device (PyTorch's own shape, stride and offset checks) and a
    # rowwise-scaled emulation.
    from fp8fx.ops import cuda

    original = torch._scaled_grouped_mm

    def scaled_grouped_mm(a, b, sa, sb, offs=None, out_dtype=None, use_fast_accum=False):
        original(*(t.to("meta") for t in (a, b, sa, sb)), offs=offs.to("meta"), out_dtype=out_dtype)
        assert all(e % 16 == 0 for e in offs.tolist())
        fa, fb, ends = a.float(), b.float(), offs.tolist()
        starts = [0, *ends[:-1]]
        if b.dim() == 3:  # rows of group g times b[g]; rows of no group are left as they are (0 here)
            out = torch.zeros(a.shape[0], b.shape[-1])
            for g, (s, e) in enumerate(zip(starts, ends)):
                out[s:e] = fa[s:e] @ fb[g] * sa[s:e, None] * sb[g]
            return out.to(out_dtype)
        groups, m, n = len(ends), a.shape[0], b.shape[1]
        out = torch.stack([fa[:, s:e] @ fb[s:e] for s, e in zip(starts, ends)])
        return (out * sa.reshape(groups, m, 1) * sb.reshape(groups, 1, n)).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm)
    for form in ("2d-3d", "2d-2d"):
        for granularity in (Granularity.TENSORWISE, Granularity.ROWWISE):
            a, b = _operands(form, SIZES)
            offs = _offsets(SIZES)
            blocks = GRANULARITIES[granularity].blocks(("input", "weight"))
            (qa, sa), (qb, sb) = (
                _graph_chain(x, offs, form, side, block, False) for side, (x, block) in enumerate(zip((a, b), blocks))
            )
            args = (qa, qb, sa, sb, offs, torch.float32, list(blocks[0]), list(blocks[1]))
            assert sqnr(cuda.fp8_grouped_mm_cuda(*args), ops.fp8_grouped_mm(*args)) > 40  # bf16 output of the kernel


def _tiny_mixtral(**config):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32, use_cache=False, **config,
    )  # fmt: skip
    return MixtralForCausalLM(cfg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mixtral_block_grouped_gemms_are_rewritten(dtype):
    # bf16: aten._grouped_mm (forward, dgrad, and the wgrad with groups along K); fp32:
    # transformers' custom op and its backward computing both gradients in one call.
    block = _tiny_mixtral().to(dtype).model.layers[0].mlp
    reference = copy.deepcopy(block).float()
    captured = compile_captured(block)
    x = torch.randn(1, 8, 32, dtype=dtype, requires_grad=True)
    out = captured.compiled(x)
    out.float().square().sum().backward()
    reference(x.detach().float()).square().sum().backward()
    forward, backward = captured.forward[0], captured.backward[0]
    assert (count(forward, GROUPED_MM), count(backward, GROUPED_MM)) == (2, 4)
    left = [
        n
        for g in (forward, backward)
        for n in g.graph.nodes
        if n.op == "call_function" and "grouped_mm" in str(n.target) and n.target != GROUPED_MM
    ]
    assert left == []  # no aten._grouped_mm or transformers op stays
    rows = [op for op in captured.report.ops if op.op == "grouped_mm"]
    assert len(rows) == 6 and all(op.precision == "fp8" and op.groups == 4 for op in rows)
    assert {op.reason.split("grouped ")[1][:5] for op in rows} == {"2d-3d", "2d-2d"}
    assert sqnr(out.float(), reference(x.detach().float())) > OUTPUT_SQNR_DB
    assert sqnr(block.experts.down_proj.grad.float(), reference.experts.down_proj.grad) > GRAD_SQNR_DB


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8", "rowwise_gw_hp", "delayed"])
def test_recipes_on_grouped_gemms(recipe):
    block = _tiny_mixtral().model.layers[0].mlp
    if recipe == "delayed":
        block = fp8fx.prepare(block)
    captured = compile_captured(block, fp8fx.Policy.from_recipe(recipe))
    captured.compiled(torch.randn(1, 8, 32, requires_grad=True)).square().sum().backward()
    rows = {op.role: op for op in captured.report.ops if op.op == "grouped_mm" and op.site.endswith("#0")}
    if recipe == "delayed":  # one scale per tensor cannot scale groups
        assert all(
            op.precision == "high" and op.reason_kind == "pattern" and "scaling: dynamic" in op.reason for op in rows.values()
        )
    elif recipe == "rowwise_gw_hp":  # the fused backward keeps computing the high gradient
        assert (rows["grad_input"].precision, rows["grad_weight"].precision) == ("fp8", "high")
        assert count(captured.backward[0], GROUPED_MM) == 2
    else:
        assert all(op.precision == "fp8" for op in rows.values())
        padded = "padded to a multiple of 32" in rows["grad_weight"].reason
        assert padded == (recipe == "mxfp8") and count(captured.backward[0], ops.pad_groups.default) == (
            4 if recipe == "mxfp8" else 0
        )


def test_grouped_gemm_cost_and_text():
    from fp8fx.reporting import costmodel

    block = _tiny_mixtral().model.layers[0].mlp
    captured = compile_captured(block)
    captured.compiled(torch.randn(1, 8, 32)).square().sum().backward()
    report = captured.report
    op = next(op for op in report.ops if op.op == "grouped_mm" and op.role == "output")
    from fp8fx.reporting.html import render_html

    data = report.to_dict()
    assert {d["groups"] for d in data["ops"] if d["op"] == "grouped_mm"} == {4} and {
        d["groups"] for d in data["ops"] if d["op"] == "mm"
    } == {None}
    assert "grouped_mm (4 groups)" in str(report) and "grouped_mm (4 groups)" in render_html(data)
    h100 = costmodel.gpu("h100")
    single = costmodel.predict(op, h100)
    assert math.isclose(single.bf16_us, h100.gemm_us(math.ceil(op.m / 4), op.n, op.k, 4, h100.bf16_tflops, 2))


MOE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256,
       "max_position_embeddings": 64, "pad_token_id": 0, "head_dim": 16, "num_key_value_heads": 4, "num_experts_per_tok": 2,
       "use_cache": False}  # fmt: skip
MOE_MODELS = {
    "mixtral": {"num_local_experts": 4},
    "olmoe": {"num_experts": 4},
    "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128},
    "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 64},
}


def _expert_share(report: fp8fx.Report, backward: bool) -> float | None:
    """FP8 share of the GEMM FLOPs with attention and the routers (gates of N = experts) left aside."""
    rows = [
        op for op in report.ops
        if op.backward == backward and op.op != "sdpa" and "attn" not in op.fqn and op.fqn.split(".")[-1] not in ("gate", "shared_expert_gate")
    ]  # fmt: skip
    total = sum(op.flops for op in rows)
    return sum(op.flops for op in rows if op.precision == "fp8") / total if total else None


# Every experts implementation on Mixtral; on the other models their default (grouped_mm) and one
# more, in turn (the cases share all but the model's config).
MOE_CASES = [("mixtral", impl) for impl in ("grouped_mm", "batched_mm", "eager")] + [
    ("olmoe", "grouped_mm"), ("olmoe", "eager"), ("qwen2_moe", "grouped_mm"), ("qwen2_moe", "batched_mm"), ("qwen3_moe", "grouped_mm"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name,impl", MOE_CASES)
def test_moe_models_train_with_fp8_experts(name, impl):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(name, **MOE, **MOE_MODELS[name], experts_implementation=impl)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    backend = fp8fx.backend(inner="eager")
    compiled = torch.compile(model, backend=backend)
    out = compiled(input_ids=ids).logits
    out.float().square().mean().backward()
    expected = reference(input_ids=ids).logits
    expected.float().square().mean().backward()
    report = fp8fx.report(compiled)
    experts = [op for op in report.ops if ".experts" in op.fqn]
    expert_weights = [name for name in report.uncaptured_weights if ".experts." in name]
    if impl in ("grouped_mm", "batched_mm"):  # every expert GEMM in FP8, forward and backward
        # (batched_mm's gathered-weight bmms are rewritten into grouped GEMMs: fp8fx.passes.gathered_experts)
        assert experts and all(op.op == "grouped_mm" and op.precision == "fp8" for op in experts)
        assert _expert_share(report, False) >= 0.9 and _expert_share(report, True) >= 0.9
        assert expert_weights == []
    else:  # the per-expert loop depends on the routing: Dynamo runs it outside any graph; the report names its weights
        assert experts == [] and len(expert_weights) == 2 * MOE["num_hidden_layers"]
    assert sqnr(out, expected) > OUTPUT_SQNR_DB
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None]
    assert sqnr(torch.cat([g.flatten() for g, _ in grads]), torch.cat([r.flatten() for _, r in grads])) > GRAD_SQNR_DB
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(compiled(input_ids=ids).logits.flatten(0, 1).float(), ids.flatten())
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mixtral_block_under_inductor(dtype):
    # The passes run on Inductor's joint graph, whose views are already decomposed: the grouped
    # lowering adds only ops Inductor lowers.
    block = _tiny_mixtral().to(dtype).model.layers[0].mlp
    reference = copy.deepcopy(block).float()
    torch._dynamo.reset()
    backend = fp8fx.backend(inner="inductor")
    x = torch.randn(1, 8, 32, dtype=dtype, requires_grad=True)
    out = torch.compile(block, backend=backend)(x)
    out.float().square().sum().backward()
    reference(x.detach().float()).square().sum().backward()
    rows = [op for op in fp8fx.report(backend).ops if op.op == "grouped_mm"]
    assert len(rows) == 6 and all(op.precision == "fp8" for op in rows)
    assert sqnr(out.float(), reference(x.detach().float())) > OUTPUT_SQNR_DB
    assert sqnr(block.experts.down_proj.grad.float(), reference.experts.down_proj.grad) > GRAD_SQNR_DB
