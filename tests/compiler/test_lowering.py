"""Inductor compiles fp8fx's amaxes, scales and casts (and, on CPU, the emulated GEMMs) as ATen ops
it fuses (fp8fx.compiler.lowering): no fp8fx op is left in its output code, and what it computes
is what the ops compute, bit for bit."""

from __future__ import annotations

import functools
import random
from collections import Counter
from typing import NamedTuple

import pytest
import torch
from helpers import CUBLAS_ROWWISE, fp8fx_calls, one_layer_llama
from torch._inductor.utils import run_and_get_code

import fp8fx
from fp8fx.compiler import lowering
from fp8fx.compiler.lowering import LOWERED_FROM
from fp8fx.core.formats import Fp8Format

ops = torch.ops.fp8fx
SEED = 20261126


def lowered_by_inductor(fn, *args):
    """`fn`'s fp8fx ops compiled by Inductor as the fp8fx backend compiles what its passes leave
    (fp8fx.compiler.pipeline.compile_partitioned); returns (outputs, Inductor's code)."""
    from torch._inductor.compile_fx import compile_fx

    from fp8fx.compiler.pipeline import StageContext, compile_partitioned
    from fp8fx.passes.options import BackendOptions

    def backend(gm, inputs):
        ctx = StageContext(options=BackendOptions())
        return compile_fx(gm, inputs, inner_compile=functools.partial(compile_partitioned, ctx=ctx))

    torch._dynamo.reset()
    return run_and_get_code(torch.compile(fn, backend=backend, fullgraph=True), *args)


class Fp32Step(NamedTuple):
    """What one compile of the fp32 one-layer Llama's training step under Inductor leaves (default
    backend options but the policy): read by the tests, not changed."""

    loss: torch.Tensor
    code: tuple[str, ...]  # Inductor's code for the step (run_and_get_code)
    report: fp8fx.Report
    records: tuple  # backend.graphs
    grads: tuple  # each parameter's gradient (None if it got none)
    graphs: tuple[torch.fx.GraphModule, ...]  # the graphs lower_elementwise got (forward, backward)


@pytest.fixture(scope="module")
def fp32_step():
    """`fp32_step(recipe)`: one training step of the fp32 one-layer Llama compiled with
    `fp8fx.backend(policy=Policy.from_recipe(recipe), inner="inductor")` (caches off), compiled
    once per recipe in this module: test_a_training_step_leaves_no_fp8fx_op_to_inductor_on_cpu and
    test_backward_casts_the_weights_again_with_the_scales_forward_saved compiled the same step
    (model, input, options) each. What is shared are its results, no compiled callable."""
    steps: dict[str, Fp32Step] = {}

    def step(recipe: str) -> Fp32Step:
        if recipe not in steps:
            steps[recipe] = _fp32_step(recipe)
        return steps[recipe]

    yield step
    steps.clear()


def _fp32_step(recipe: str) -> Fp32Step:
    graphs = []
    lower = lowering.lower_elementwise
    model = one_layer_llama()
    ids = torch.randint(0, 512, (2, 16))
    backend = fp8fx.backend(policy=fp8fx.Policy.from_recipe(recipe), inner="inductor")
    compiled = torch.compile(model, backend=backend)
    # (Inductor's caches off: a hit keeps the records of the process that compiled, which hold only the counted passes)
    with (
        pytest.MonkeyPatch.context() as mp,
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch._inductor.config.patch(fx_graph_cache=False),
    ):
        mp.setattr(lowering, "lower_elementwise", lambda gm, *args: (graphs.append(gm), lower(gm, *args))[1])
        loss, code = run_and_get_code(lambda: compiled(input_ids=ids, labels=ids).loss)
        loss.backward()
    grads = tuple(None if p.grad is None else p.grad.detach().clone() for p in model.parameters())
    return Fp32Step(loss.detach(), tuple(code), fp8fx.report(backend), tuple(backend.graphs), grads, tuple(graphs))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_training_step_leaves_no_fp8fx_op_to_inductor_on_cpu(recipe, fp32_step):
    """Before the lowering, one Llama layer's step called 111 fp8fx ops from Inductor's code (20
    amaxes, 21 scales, 21 casts, 21 scale inverses, 4 saved copies, 24 GEMMs)."""
    step = fp32_step(recipe)
    loss, code, report = step.loss, step.code, step.report
    assert fp8fx_calls(code) == []
    assert "Float8_e4m3fn" in "\n".join(code)  # the casts are Inductor's own kernels
    assert len(report.fp8_ops) >= 6 and torch.isfinite(loss)
    # Memory passes counted from Inductor's kernels: fewer than the ops one by one would make, and
    # fewer operand copies (operands cast in the graph are written K-major by their cast's kernel).
    assert {op.memory_passes_from for op in report.fp8_ops} == {"inductor"}
    one_by_one = [op for g in step.records for op in g.ops if op.memory_passes_added is not None]
    assert sum(op.memory_passes_added for op in report.fp8_ops) < sum(op.memory_passes_added for op in one_by_one)
    assert sum(op.transposed_copies for op in report.fp8_ops) < sum(op.transposed_copies for op in one_by_one)
    assert all(g is not None and torch.isfinite(g).all() for g in step.grads)


def _cast_case(rng: random.Random, g: torch.Generator):
    rows, cols = rng.randint(1, 70), rng.randint(1, 300)
    fmt = rng.choice([Fp8Format.E4M3, Fp8Format.E5M2])
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    block, margin, power_of_two, rounding = rng.choice(
        [([], 0, False, None), ([], 1, True, None), ([1, 0], 0, False, None), ([0, 1], 0, True, None),
         ([1, 32], 0, True, "floor"), ([1, 32], 0, True, None), ([32, 32], 0, False, None), ([16, 0], 2, False, None)]
    )  # fmt: skip
    x = torch.randn(rows, cols, generator=g) * 10 ** rng.uniform(-6, 6)
    special = rng.choice(["none", "zeros", "inf", "nan", "huge"])
    if special == "zeros":
        x[: rows // 2] = 0
    elif special != "none":
        x.view(-1)[rng.randrange(x.numel())] = {"inf": float("inf"), "nan": float("nan"), "huge": 3e38}[special]
    return x.to(dtype), (fmt, block, margin, power_of_two, rounding)


def lowered_step_graphs(
    monkeypatch, recipe: str, dtype: torch.dtype = torch.float32, cublas_devices: tuple[str, ...] = ("cuda",)
) -> list[torch.fx.GraphModule]:
    """The graphs (forward, backward) Inductor gets from one training step of the one-layer Llama
    in `dtype`, with their fp8fx ops lowered to ATen ops (`cublas_devices`: the backend option)."""
    graphs = []
    lower = lowering.lower_elementwise
    monkeypatch.setattr(lowering, "lower_elementwise", lambda gm, *args: (graphs.append(gm), lower(gm, *args))[1])
    model = one_layer_llama().to(dtype)
    ids = torch.randint(0, 512, (2, 16))
    backend = fp8fx.backend(policy=fp8fx.Policy.from_recipe(recipe), inner="inductor", cublas_devices=cublas_devices)
    compiled = torch.compile(model, backend=backend)
    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        compiled(input_ids=ids, labels=ids).loss.backward()
    return graphs


@pytest.mark.parametrize("recipe", ["tensorwise", CUBLAS_ROWWISE])
def test_casts_in_a_bf16_step_read_the_bf16_tensors(recipe, monkeypatch):
    """On the graph a GPU runs (its GEMMs cuBLAS's `aten._scaled_mm`, which torch's CPU build runs):
    the product that scales a cast's input reads the BF16 tensor the model computed. An explicit
    fp32 upcast there was folded by Inductor's `pointless_convert` into the fp32 value before its
    rounding to BF16, which the cast then read and Inductor kept (two fp32 MLP gradients at an
    H100 Llama step's peak).

    Tensorwise, a gradient's one FP8 tensor serves both backward GEMMs, row-major for the input
    gradient and column-major for the weight gradient: the column-major copy reads the stored FP8
    tensor (through `as_strided`, which makes Inductor store it first), not the BF16 gradient that
    Inductor would otherwise cast again for it (2 bytes a value instead of 1). Not where that FP8
    tensor is itself a copy (the attention projections' gradients, cast head-major and copied
    token-major): Inductor writes both layouts from one kernel there.

    The GEMMs reading one tensor in one layout read one copy of it (q, k and v's weight gradients
    the normed input's, gate and up's theirs), through an `as_strided` that makes Inductor store
    it once; each `_scaled_mm` made a copy of its own before.

    Tensorwise, backward keeps no FP8 tensor. The weight gradient reads the FP8 input forward
    cast; min-cut never recomputes a value that backward reads with an op it cannot fuse (the
    GEMM), so it saved such FP8 inputs (the down projection's, 1 byte a value) although backward
    keeps what they are cast from (the gate and up outputs SiLU's backward reads), where torchao
    casts again. Read through a copy it can fuse (`let_backward_cast_again`), they are cast again.
    The weights are cast again too (weight_fp8="auto")."""
    graphs = lowered_step_graphs(monkeypatch, recipe, torch.bfloat16, cublas_devices=("cpu", "cuda"))
    cast = ops.cast.default.name()
    scalings = [n for gm in graphs for n in gm.graph.nodes if n.meta.get(LOWERED_FROM) == cast and n.target is torch.ops.aten.mul.Tensor]
    assert len(scalings) >= 24  # every operand of the 24 GEMMs
    assert {n.args[0].meta["val"].dtype for n in scalings} == {torch.bfloat16}
    backward = [gm for gm in graphs if any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)]
    copies = [n for n in backward[0].graph.nodes if n.target is torch.ops.aten.clone.default and lowering.CHARGED_TO in n.meta]
    stored = [chain[-1].args[0] for chain in map(_view_chain, (n.args[0] for n in copies)) if chain[-1].target is torch.ops.aten.as_strided.default]
    assert all(b.meta["val"].dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for b in stored)
    if recipe == "tensorwise":  # the output gradients of 5 weight gradients (o, gate, up, down and the LM
        # head), each the operand of an input gradient's `_scaled_mm` too
        saved = [n.meta["val"] for n in backward[0].graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
        assert not [t for t in saved if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
        assert len(stored) == 5
        assert all(b.meta["val"].dtype == torch.float8_e5m2 and torch.ops.aten._scaled_mm.default in _read_through_views(b) for b in stored)
    gemms = [n for n in backward[0].graph.nodes if n.target is torch.ops.aten._scaled_mm.default]
    copies_read = [_view_chain(x)[-1] for n in gemms for x in n.args[:2]]
    readers = Counter(x for x in copies_read if x.target is torch.ops.aten.as_strided.default and x.args[0].target is torch.ops.aten.clone.default)
    assert sorted(readers.values(), reverse=True)[:2] == [3, 2]


def _view_chain(node: torch.fx.Node) -> list[torch.fx.Node]:
    """`node` and the views it is made from, down to the first `as_strided` or node that is not a view."""
    chain = [node]
    while getattr(chain[-1].target, "is_view", False) and chain[-1].target is not torch.ops.aten.as_strided.default:
        chain.append(chain[-1].args[0])
    return chain


def _read_through_views(node: torch.fx.Node) -> set:
    """The targets of the nodes that read `node` directly or through views (an `as_strided` excepted)."""
    found, frontier = set(), [node]
    while frontier:
        users = [u for n in frontier for u in n.users]
        found |= {u.target for u in users}
        frontier = [u for u in users if getattr(u.target, "is_view", False) and u.target is not torch.ops.aten.as_strided.default]
    return found


def test_backward_casts_the_weights_again_with_the_scales_forward_saved(fp32_step):
    """weight_fp8="recompute" (the default under dynamic scaling): backward casts each weight
    again, with the scale forward computed and saved (a scalar); an amax of a weight in backward
    would read the whole weight again. The scale's inverse, which the GEMMs read, is saved too:
    computed again in backward it was a kernel of its own (a launch per weight on a GPU)."""
    graphs = fp32_step("tensorwise").graphs  # the step lowered_step_graphs(monkeypatch, "tensorwise") compiled
    backward = [gm for gm in graphs if any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)]
    assert len(backward) == 1

    def read_weights(op):  # the lowered `op` nodes' inputs that are the forward's inputs (the weights)
        nodes = [n for n in backward[0].graph.nodes if n.meta.get(LOWERED_FROM) == op.default.name()]
        return {a.name for n in nodes for a in n.all_input_nodes if a.op == "placeholder" and a.name.startswith("primals")}

    assert len(read_weights(ops.cast)) == 8  # 7 projections and the LM head
    assert read_weights(ops.amax) == set()
    inverses = [n for n in backward[0].graph.nodes if n.meta.get(LOWERED_FROM) == ops.scale_inverse.default.name()]
    assert all(a.op != "placeholder" for n in inverses for a in n.all_input_nodes)  # none of a scale forward saved


def test_compiled_casts_equal_the_ops_bit_for_bit():
    """Generated casts (shapes, dtypes, formats, granularities, margins, power-of-two and MX floor
    scales, zeros, inf, NaN), and the widening of what they cast, in one compiled graph against the
    ops run eagerly."""
    rng, g = random.Random(SEED), torch.Generator().manual_seed(SEED)
    cases = [_cast_case(rng, g) for _ in range(10)]

    def chains(*xs):
        out = []
        for x, (fmt, block, margin, power_of_two, rounding) in zip(xs, [c[1] for c in cases]):
            amax = ops.amax(x, block)
            scale = ops.amax_to_scale(amax, fmt.max, margin, power_of_two, rounding)
            q, inverse = ops.cast(x, scale, fmt.dtype, block), ops.scale_inverse(scale)
            out += [amax, scale, q, inverse, ops.widen(q, inverse, torch.bfloat16, block)]
        return out

    inputs = [c[0] for c in cases]
    compiled, code = lowered_by_inductor(chains, *inputs)
    assert fp8fx_calls(code) == []
    for i, (got, want) in enumerate(zip(compiled, chains(*inputs))):
        what = f"case {i // 5} {cases[i // 5][1]} {['amax', 'scale', 'cast', 'scale_inverse', 'widen'][i % 5]}"
        assert got.dtype == want.dtype and got.shape == want.shape, what
        if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # the same bits, or NaN both (payloads may differ)
            nan = got.float().isnan() & want.float().isnan()
            got, want = got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan]
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=what)


@pytest.mark.parametrize(
    "blocks,epilogue",
    [(([], []), ""), (([1, 0], [0, 1]), "bias,aux=pre_activation,amax"), (([1, 128], [128, 128]), "bias"),
     (([], []), "bias,act=gelu,aux=pre_activation")],
)  # fmt: skip
def test_compiled_cpu_gemms_equal_the_emulation(blocks, epilogue):
    """On CPU the emulated GEMM is ATen ops too: the same fp32 products, scaled and finished the
    same way (an activation within an ulp or so: Inductor vectorises it)."""
    g = torch.Generator().manual_seed(SEED)
    m, n, k = 48, 40, 256
    a = (torch.randn(m, k, generator=g) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=g) * 4).to(torch.float8_e5m2).t()
    sa = torch.rand(fp8fx.core.scaling.scale_shape(a.shape, tuple(blocks[0])), generator=g) + 0.5
    sb = torch.rand(fp8fx.core.scaling.scale_shape(b.shape, tuple(blocks[1])), generator=g) + 0.5
    bias = torch.randn(n, generator=g)

    def gemms(a, b, sa, sb, bias):
        mm = ops.scaled_mm(a, b, sa, sb, None, torch.float32, *blocks)
        fused = ops.fp8_gemm(  # by name, as Fp8GemmArgs spells them (Dynamo traces the op's call, not the record)
            a,
            b,
            sa,
            sb,
            bias=bias if epilogue else None,
            other=None,
            residual=None,
            out_scale=None,
            out_dtype=torch.bfloat16,
            aux_dtype=torch.float32,
            block_a=blocks[0],
            block_b=blocks[1],
            epilogue=epilogue,
            gpu_kernel="triton",
            fast_accum=False,
        )
        return mm, *fused

    args = (a, b, sa, sb, bias)
    compiled, code = lowered_by_inductor(gemms, *args)
    assert fp8fx_calls(code) == []
    exact = "act=" not in epilogue
    for what, got, want in zip(["scaled_mm", "out", "aux", "amax"], compiled, gemms(*args)):
        assert got.dtype == want.dtype and got.shape == want.shape, what
        torch.testing.assert_close(got, want, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6, msg=what)
