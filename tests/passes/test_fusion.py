"""fuse_epilogues: graph structure (counted) and numerics of fused FP8 GEMMs."""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
from helpers import FP8_GEMM, GRAD_SQNR_DB, OUTPUT_SQNR_DB, SCALED_MM, GatedBlock, count, sqnr, tiny_gpt2, tiny_llama
from torch import nn

import fp8fx
from fp8fx.codegen import dispatch
from fp8fx.compiler.lowering import LOWERED_FROM
from fp8fx.ops.args import Fp8GemmArgs

aten = torch.ops.aten
ELEMENTWISE = (aten.gelu.default, aten.silu.default, aten.relu.default, aten.mul.Tensor, aten.add.Tensor)


def compiled(model, **kwargs):
    backend = fp8fx.backend(inner="eager", keep_graphs=True, **kwargs)
    return backend, torch.compile(model, backend=backend)


def graphs(backend, kind=None):
    return [g for k, g in backend.kept_graphs if kind is None or k == kind]


def test_inference_graph_has_one_fused_gemm_per_matmul_and_no_leftover_elementwise():
    torch.manual_seed(0)
    model = GatedBlock()
    backend, fast = compiled(model)
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        out, ref = fast(x), model(x)
    (g,) = graphs(backend, "inference")
    assert count(g, FP8_GEMM) == 4 and count(g, SCALED_MM) == 0
    assert sum(count(g, op) for op in ELEMENTWISE) == 0, g.graph
    # x and the four weights need an amax pass; the GELU output's and the gated product's amax
    # come from the epilogues of the GEMMs that make them.
    assert count(g, torch.ops.fp8fx.amax.default) == 5 and count(g, torch.ops.fp8fx.cast.default) == 7
    specs = sorted(Fp8GemmArgs.of(n).epilogue for n in g.graph.nodes if n.target == FP8_GEMM)
    assert specs == ["", "act=silu,mul,amax", "bias,act=gelu,amax", "residual"]
    assert sqnr(out, ref) >= OUTPUT_SQNR_DB


class TrainingStep(NamedTuple):
    """One training step (the output's sum, backward) of a model seeded with 0, compiled with
    `compiled(model, fuse_epilogues=fuse)`. Read by the tests, not changed."""

    initial: nn.Module  # a copy of the model before the step (for an eager reference)
    x: torch.Tensor  # the input (detached)
    out: torch.Tensor  # the output (detached; a model's logits)
    x_grad: torch.Tensor | None
    grads: dict[str, torch.Tensor | None]  # each parameter's gradient, by name
    kept_graphs: tuple  # backend.kept_graphs
    report: fp8fx.Report


def training_step(make_model, fuse: bool) -> TrainingStep:
    torch.manual_seed(0)
    model = make_model()
    initial = copy.deepcopy(model)
    backend, fast = compiled(model, fuse_epilogues=fuse)
    x = torch.randn(2, 16, 64, requires_grad=True) if make_model is GatedBlock else torch.randint(0, 256, (2, 16))
    out = fast(x)
    out = out if isinstance(out, torch.Tensor) else out.logits
    out.sum().backward()
    grads = {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}
    x_grad = None if x.grad is None else x.grad.detach().clone()
    step = TrainingStep(
        initial, x.detach().clone(), out.detach().clone(), x_grad, grads, tuple(backend.kept_graphs), fp8fx.report(backend)
    )
    torch._dynamo.reset()
    return step


@pytest.fixture(scope="module")
def training_steps():
    """`training_steps(make_model, fuse)`: `training_step`'s result, computed once per arguments in
    this module. GatedBlock's step, fused and unfused, was compiled alike (same seed, weights, input,
    options and loss) by test_fused_and_unfused_graphs_agree, test_fusion_saves_no_more_for_backward_than_unfused
    and (fused) test_training_keeps_what_backward_needs_as_aux_outputs. What is shared are results,
    no compiled callable; each call returns a fresh dict of gradients."""
    steps: dict[tuple, TrainingStep] = {}

    def get(make_model, fuse: bool) -> TrainingStep:
        if (make_model, fuse) not in steps:
            steps[make_model, fuse] = training_step(make_model, fuse)
        return steps[make_model, fuse]._replace(grads=dict(steps[make_model, fuse].grads))

    yield get
    steps.clear()


def test_fused_and_unfused_graphs_agree(training_steps):
    results = []
    for fuse in (True, False):
        step = training_steps(GatedBlock, fuse)
        results.append((step.out, step.x_grad, step.grads["fc.weight"], step.grads["gate.weight"]))
    for fused, unfused in zip(*results):
        assert sqnr(fused, unfused) >= 60  # the same FP8 math, only rounded once less


def test_training_keeps_what_backward_needs_as_aux_outputs(training_steps):
    step = training_steps(GatedBlock, True)
    reference = copy.deepcopy(step.initial)
    reference(step.x.clone().requires_grad_()).sum().backward()
    fw = next(g for k, g in step.kept_graphs if k == "forward")
    bw = next(g for k, g in step.kept_graphs if k == "backward")
    assert count(fw, FP8_GEMM) == 4 and count(bw, FP8_GEMM) == 8 and count(fw, SCALED_MM) + count(bw, SCALED_MM) == 0
    report = step.report
    by_key = {(op.site, op.role): op for op in report.ops}
    # GELU backward needs the pre-activation: the fused GEMM stores it as its aux output.
    assert by_key[("fc", "output")].epilogue == "bias,act=gelu,aux=pre_activation,amax"
    assert by_key[("down", "output")].epilogue == "residual"
    assert all(op.kernel and op.kernel.startswith("fp8_gemm_") for op in report.ops)
    assert all(op.memory_passes_added is not None for op in report.ops)
    assert report.summary()["fused_epilogues"] >= 4
    for name, q in reference.named_parameters():
        assert sqnr(step.grads[name], q.grad) >= GRAD_SQNR_DB


def test_report_says_why_fusion_stopped():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Softmax(-1), torch.nn.Linear(64, 32))
    backend, fast = compiled(model)
    with torch.no_grad():
        fast(torch.randn(8, 32))
    first = fp8fx.report(backend).ops[0]
    assert first.epilogue == "bias" and "_softmax" in first.fusion


def test_gpt2_with_fused_epilogues_keeps_its_numerics():
    torch.manual_seed(0)
    model = tiny_gpt2().eval()
    backend, fast = compiled(model)
    ids = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        out, ref = fast(ids).logits, model(ids).logits
    assert sqnr(out, ref) >= OUTPUT_SQNR_DB
    ops = {op.site: op for op in fp8fx.report(backend).fp8_ops}
    assert all(op.epilogue == "bias" for site, op in ops.items() if site != "lm_head")  # Conv1D: addmm
    # GPT-2's GELU is written out in elementwise ops: its first add needs x**3, made after the GEMM.
    assert "could not join" in ops["transformer.h.0.mlp.c_fc"].fusion


@pytest.mark.parametrize("kernels", ["cuda", "triton-interpreter", ""])
def test_backend_rejects_unknown_kernels(kernels):
    with pytest.raises(ValueError, match="kernels must be one of auto, triton, scaled_mm"):
        fp8fx.backend(kernels=kernels)


@pytest.mark.parametrize("make_model", [GatedBlock, tiny_llama], ids=["gated_block", "llama"])
def test_fusion_saves_no_more_for_backward_than_unfused(make_model, training_steps):
    """Bytes of the tensors forward hands to backward (the backward graph's inputs)."""
    saved = {}
    for fuse in (True, False):
        (bw,) = [g for k, g in training_steps(make_model, fuse).kept_graphs if k == "backward"]
        vals = [n.meta["val"] for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
        saved[fuse] = sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))
    assert saved[True] <= saved[False], saved


def test_delayed_scaling_consumer_gets_fp8_straight_from_the_epilogue():
    """With delayed scaling the next layer's input scale is known before the GEMM runs: the GELU
    layer's kernel writes the FP8 input of the next layer, and no separate cast of it remains."""
    from fp8fx import Policy

    results = {}
    for fuse in (True, False):
        torch.manual_seed(0)
        model = fp8fx.prepare(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)))
        backend, fast = compiled(model, policy=Policy.from_recipe("delayed", amax_history_len=4), fuse_epilogues=fuse)
        x = torch.randn(2, 16, 64, requires_grad=True)
        for _ in range(3):  # the scales in use come from the history of earlier steps
            out = fast(x)
            out.sum().backward()
        results[fuse] = (out, x.grad, model[0].weight.grad)
        if fuse:
            fw = graphs(backend, "forward")[-1]
            first = next(n for n in fw.graph.nodes if n.target == FP8_GEMM)
            first_args = Fp8GemmArgs.of(first)
            assert first.meta["val"][0].dtype == torch.float8_e4m3fn and first_args.out_scale is not None  # FP8 out, its scale
            assert count(fw, torch.ops.fp8fx.cast.default) == 3  # x and the two weights; not the GELU output
        torch._dynamo.reset()
    for fused, unfused in zip(results[True], results[False]):
        assert sqnr(fused, unfused) >= 40


def gated_step_under_inductor(kernels: str, training: bool):
    """GatedBlock compiled with fp8fx under Inductor (caches off) and run once (with backward when
    training): (model, input, output, backend)."""
    torch.manual_seed(0)
    model = GatedBlock()
    backend = fp8fx.backend(inner="inductor", kernels=kernels)
    x = torch.randn(2, 16, 64, requires_grad=training)
    with (
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch._inductor.config.patch(fx_graph_cache=False),
        torch.set_grad_enabled(training),
    ):
        out = torch.compile(model, backend=backend)(x)
        if training:
            out.square().sum().backward()
    return model, x, out, backend


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("table_cached_first", [False, True])
def test_inductor_sees_whole_activations_and_fuses_them(table_cached_first, training, monkeypatch):
    """Activations reach the FP8 passes whole, and what the passes leave of them is decomposed
    before Inductor lowers it (not run as ATen fallbacks), whichever compile first filled
    Inductor's cached decomposition table in this process; the table is whole afterwards."""
    from torch._inductor import compile_fx, decomposition

    decomposition.fast_random_decomps.cache_clear()
    if table_cached_first:  # as after a plain Inductor compile
        decomposition.select_decomp_table()
    lowered = []
    compile_inner = compile_fx.compile_fx_inner

    def recording(gm, example_inputs, **kwargs):
        # (what fp8fx's ops become there, an FP8 GEMM emulated on CPU with its epilogue, is not an activation left whole)
        lowered.extend((n.target, LOWERED_FROM in n.meta) for n in gm.graph.nodes if n.op == "call_function")
        return compile_inner(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", recording)
    model, x, out, backend = gated_step_under_inductor("triton", training)  # (auto leaves epilogues to Inductor: the next test)
    epilogues = {op.site: op.epilogue for op in fp8fx.report(backend).ops if op.role == "output"}
    if training:  # silu(gate) * up fuses into up's GEMM; the pre-activations are saved for backward
        assert epilogues == {
            "fc": "bias,act=gelu,aux=pre_activation,amax",
            "gate": "",
            "up": "mul,aux=pre_activation,amax",
            "down": "residual",
        }
    else:
        assert epilogues == {"fc": "bias,act=gelu,amax", "gate": "act=silu,mul,amax", "up": "", "down": "residual"}
    assert sqnr(out.detach(), model(x).detach()) >= OUTPUT_SQNR_DB
    whole = {torch.ops.aten.silu.default, torch.ops.aten.gelu.default, torch.ops.aten.gelu_backward.default}
    # silu's backward, decomposed: sigmoid (torch 2.13), or 1 / (1 + exp(-x)) (torch 2.11's decomposition)
    sigmoid = {torch.ops.aten.sigmoid.default, torch.ops.aten.reciprocal.default}
    outside_fp8fx_ops = {target for target, from_fp8fx in lowered if not from_fp8fx}
    assert not whole & {target for target, _ in lowered} and bool(sigmoid & outside_fp8fx_ops) == training  # inference fuses both
    assert whole - {torch.ops.aten.gelu_backward.default} <= set(decomposition.select_decomp_table())


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("kernels", ["auto", "scaled_mm"])
def test_under_inductor_auto_leaves_epilogues_to_inductor(kernels, training, monkeypatch):
    """Without a measured table saying the generated kernel with its epilogue beats cuBLAS's bare
    GEMM, a graph Inductor compiles runs bare GEMMs and Inductor fuses bias, activation, product,
    residual, amax and cast into its own kernels; a bias of the output's dtype becomes an add."""
    from fp8fx.compiler import backend as backend_module

    gemms = []  # per graph as the passes leave it (Inductor then lowers fp8fx's ops for the CPU): (GEMM's bias, its users)
    run_passes = backend_module.run_passes

    def recording(gm, ctx, passes, **kwargs):
        gm = run_passes(gm, ctx, passes, **kwargs)
        found = [n for n in gm.graph.nodes if n.target == torch.ops.fp8fx.fp8_gemm.default]
        gemms.append([(Fp8GemmArgs.of(g).bias, [u.target for out in g.users for u in out.users]) for g in found])
        assert not [n for n in gm.graph.nodes if n.op == "call_function" and not n.users and not n.is_impure()]  # nothing dead
        return gm

    monkeypatch.setattr(backend_module, "run_passes", recording)
    model, x, out, backend = gated_step_under_inductor(kernels, training)
    ops = fp8fx.report(backend).ops
    assert ops and all(op.epilogue == "" and op.gpu_kernel == "scaled_mm" for op in ops)
    outputs = [op for op in ops if op.role == "output"]
    assert {op.site for op in outputs} == {"fc", "gate", "up", "down"}
    expected = dispatch.UNMEASURED_TO_INDUCTOR if kernels == "auto" else "backend option kernels='scaled_mm'"
    left = {op.site for op in outputs if op.fusion.startswith("left to Inductor: ") and expected in op.fusion}
    # (training: gate's SiLU is kept for backward, so its chain stops before the product, and says so)
    assert left == ({"fc", "up", "down"} if training else {"fc", "gate", "up", "down"}), [op.fusion for op in outputs]
    forward = gemms[0]  # fc's bias, split out, is an add after its GEMM
    assert len(forward) == (12 if training else 4) and all(bias is None for bias, _ in forward)  # (the joint graph: 12)
    assert torch.ops.aten.add.Tensor in forward[0][1]  # fc, first in the graph
    assert sqnr(out.detach(), model(x).detach()) >= OUTPUT_SQNR_DB


@pytest.mark.parametrize("n_out", [64, 96])
def test_a_widening_cast_after_a_kept_value_is_left_to_the_consumer(n_out):
    """An lm_head whose bf16 logits are returned and widened to fp32 for the loss: fusing the cast
    would write the logits twice (bf16 aux and fp32 output) and keep the fp32 copy alive (+0.5 GiB
    at a Llama-3-8B step's peak on an H100). The GEMM writes bf16, the loss widens what it reads."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(64, n_out, bias=False).to(torch.bfloat16)

    def head(h, y):
        logits = proj(h)
        return logits, torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    backend = fp8fx.backend(inner="eager", keep_graphs=True)
    h = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, n_out, (2, 16))
    logits, loss = torch.compile(head, backend=backend)(h, y)
    loss.backward()
    (op,) = [op for op in fp8fx.report(backend).ops if op.role == "output"]
    assert "aux" not in op.epilogue and "only widens" in op.fusion
    (gemm,) = [n for n in graphs(backend, "forward")[0].graph.nodes if n.target == FP8_GEMM]
    assert Fp8GemmArgs.of(gemm).out_dtype == torch.bfloat16 and logits.dtype == torch.bfloat16
    assert torch.isfinite(h.grad).all() and torch.isfinite(proj.weight.grad).all()


def test_under_inductor_a_widening_cast_is_left_to_the_consumer():
    """An lm_head whose logits only the loss reads, widened to fp32: under Inductor the loss's
    kernel widens them as it reads them, so a GEMM writing fp32 would save no pass, skip the
    model's rounding to BF16, and leave backward keeping the fp32 logits (twice BF16's bytes)."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16)

    def loss_of(h, y):
        return torch.nn.functional.cross_entropy(proj(h).float().flatten(0, 1), y.flatten())

    backend = fp8fx.backend(inner="inductor")
    h = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 96, (2, 16))
    torch.compile(loss_of, backend=backend)(h, y).backward()
    (op,) = [op for op in fp8fx.report(backend).ops if op.role == "output"]
    assert "widens the result" in op.fusion and "_plain_bf16" in op.kernel, (op.fusion, op.kernel)
    assert torch.isfinite(h.grad).all() and torch.isfinite(proj.weight.grad).all()


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_gated_mlp_writing_fp8_for_the_next_gemm_at_inference(inner):
    """Delayed scaling at inference: gate's GEMM absorbs SiLU, the product with up and the FP8 cast
    for down (its scale is known before the GEMM). The chain it absorbed must be gone before up's
    GEMM looks for its own consumers, or up fuses the dead product and reads gate's old result."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.gate, model.up, model.down = (nn.Linear(64, 128, bias=False), nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))

    def mlp(x):
        return model.down(nn.functional.silu(model.gate(x)) * model.up(x))

    fp8fx.prepare(model)
    backend = fp8fx.backend(policy=fp8fx.Policy.from_recipe("delayed"), inner=inner, kernels="triton")
    x = torch.randn(4, 32, 64)
    with torch.no_grad():
        out = torch.compile(mlp, backend=backend)(x)
        ref = mlp(x)
    ops = fp8fx.report(backend).ops
    assert sorted(op.site for op in ops) == ["down", "gate", "up"]
    gate = next(op for op in ops if op.site == "gate")
    assert gate.epilogue == "act=silu,mul" and gate.kernel.endswith("_e4m3_fastacc")  # writes E4M3 for down
    assert sqnr(out, ref) >= OUTPUT_SQNR_DB


EPILOGUE_OUTPUTS = {  # a returned value that ends each epilogue kind (3-D, so the fused 2-D result is reshaped)
    "bias": lambda m, x: m.fc(x),
    "bias_act": lambda m, x: nn.functional.gelu(m.fc(x)),
    "mul": lambda m, x: nn.functional.silu(m.gate(x)) * m.up(x),
    "residual": lambda m, x: x + m.down(x),
    "two_outputs": lambda m, x: (m.fc(x), x + m.down(x)),
}


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("inner,kernels", [("eager", "auto"), ("eager", "triton"), ("inductor", "triton")])
@pytest.mark.parametrize("kind", list(EPILOGUE_OUTPUTS))
def test_compiled_outputs_alias_as_without_fp8fx(kind, inner, kernels, training):
    """A fused epilogue's result is reshaped back to the chain's N-D shape; the compiled model must
    return a view exactly where the same compile without fp8fx does (`aot_eager` for
    inner="eager"): a fresh tensor for an add's or activation's result, as eager does."""
    torch.manual_seed(0)
    model = nn.Module()
    model.fc, model.gate, model.up, model.down = (nn.Linear(64, 64) for _ in range(4))
    fn = EPILOGUE_OUTPUTS[kind]
    x = torch.randn(2, 8, 64, requires_grad=training)
    backend = fp8fx.backend(inner=inner, kernels=kernels)
    plain = "aot_eager" if inner == "eager" else "inductor"
    with torch.set_grad_enabled(training):
        ours, ref = torch.compile(lambda x: fn(model, x), backend=backend)(x), fn(model, x)
        torch._dynamo.reset()
        without = torch.compile(lambda x: fn(model, x), backend=plain)(x)
    ours, ref, without = ((ours, ref, without) if isinstance(ref, tuple) else ((ours,), (ref,), (without,)))
    assert any(op.epilogue for op in fp8fx.report(backend).ops)  # something was fused
    for o, r, w in zip(ours, ref, without):
        assert (o._base is None, o._is_view()) == (w._base is None, w._is_view())
        if kind in ("bias_act", "mul", "residual"):  # a fresh tensor in eager too
            assert o._base is None and not o._is_view()
        assert sqnr(o.detach(), r.detach()) >= OUTPUT_SQNR_DB
