"""ONNX FP8 export (fp8fx.tools.export): real models, onnxruntime, node and initializer counts, errors."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import sqnr, tiny_gpt2, tiny_llama
from onnx.reference import ReferenceEvaluator
from torch import nn
from typer.testing import CliRunner

import fp8fx
from fp8fx.cli import app
from fp8fx.tools.analyze import load_model_file
from fp8fx.tools.demo import TinyTransformer
from fp8fx.tools.export import ExportError, export_onnx

ASSETS = Path(__file__).parents[1] / "assets"
E4M3 = onnx.TensorProto.FLOAT8E4M3FN


def transformer():
    torch.manual_seed(0)
    return TinyTransformer(dim=64, heads=4, layers=2, max_seq=32), (torch.randint(0, 256, (2, 32)),)


def gpt2():
    torch.manual_seed(0)
    model = tiny_gpt2()
    model.config.use_cache = False  # a KV cache in the outputs is not an ONNX output
    return model, (torch.randint(0, model.config.vocab_size, (2, 32)),)


def llama():
    torch.manual_seed(0)
    model = tiny_llama()
    model.config.use_cache = False
    return model, (torch.randint(0, model.config.vocab_size, (2, 32)),)


def fp8_weight_initializers(proto) -> int:
    return sum(init.data_type == E4M3 and len(init.dims) == 2 for init in proto.graph.initializer)


ACTIVATIONS = {"relu": nn.ReLU, "relu6": nn.ReLU6, "gelu": nn.GELU, "silu": nn.SiLU, "none": nn.Identity}


def mlp(activation: str, rank: int, bias: bool, dims=(64, 32, 16), seed: int = 0):
    """Linear -> activation -> Linear and an input of the given rank."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(dims[0], dims[1], bias=bias), ACTIVATIONS[activation](), nn.Linear(dims[1], dims[2], bias=bias)
    )
    return model, (torch.randn(*(2, 8, dims[0]) if rank == 3 else (8, dims[0])),)


def check_as_deployed(path: Path, model: nn.Module, inputs: tuple):
    """onnxruntime with default session options (all graph optimisations) against onnx's reference
    evaluator of the same file, and against the original model."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}
    (deployed,) = (torch.from_numpy(o) for o in session.run(None, feeds))
    (spec,) = (torch.from_numpy(o) for o in ReferenceEvaluator(str(path)).run(None, feeds))
    assert (deployed - spec).abs().max().item() <= 1e-4 * spec.abs().max().item()
    with torch.no_grad():
        assert sqnr(deployed, model(*inputs)) > 20


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("make", [transformer, gpt2, llama], ids=["transformer", "gpt2", "llama"])
def test_export_runs_in_onnxruntime_and_matches_the_emulation(tmp_path, make, recipe):
    model, inputs = make()
    policy = fp8fx.Policy.from_recipe(recipe, format="e4m3")
    result = export_onnx(model, inputs, tmp_path / "m.onnx", policy)
    proto = onnx.load(tmp_path / "m.onnx")
    fp8_sites = [s for s in result.sites if s.precision == "fp8"]
    assert fp8_sites and result.verified
    assert result.max_abs_diff_vs_emulation <= 1e-3  # float rounding only (checked against a bound inside too)
    assert result.sqnr_vs_original_db > 15
    nodes = [n.op_type for n in proto.graph.node]
    # One Q/DQ pair per FP8 activation - Llama's q/k/v and gate/up projections read one tensor with
    # one scale, and ONNX's optimizer shares their pair - plus one DQ per FP8 weight.
    shared = 2 * (2 + 1) if make is llama else 0  # per layer: q, k, v share one pair; gate, up another
    assert nodes.count("QuantizeLinear") == len(fp8_sites) - shared
    assert nodes.count("DequantizeLinear") == nodes.count("QuantizeLinear") + len(fp8_sites)
    assert fp8_weight_initializers(proto) == result.fp8_weights == len(fp8_sites)
    assert not {n.domain for n in proto.graph.node} - {"", "ai.onnx"}  # no custom ops
    # Every site, FP8 or high, names the one MatMul / Gemm it became, its own (a 3-D product's
    # reshapes folded into it included).
    op_type = {n.name: n.op_type for n in proto.graph.node}
    products = [[name for name in site.onnx_nodes if op_type[name] in ("MatMul", "Gemm")] for site in result.sites]
    assert all(len(found) == 1 for found in products), [s.site for s, found in zip(result.sites, products) if len(found) != 1]
    assert len({found[0] for found in products}) == len(result.sites)
    for site in fp8_sites:
        kinds = [next(n.op_type for n in proto.graph.node if n.name == name) for name in site.onnx_nodes]
        assert sorted(k for k in kinds if "Linear" in k) == ["DequantizeLinear", "DequantizeLinear", "QuantizeLinear"], site
    if recipe == "rowwise":  # per-output-channel weight scales
        dq_axes = [a.i for n in proto.graph.node if n.op_type == "DequantizeLinear" for a in n.attribute if a.name == "axis"]
        assert dq_axes.count(1) >= len(fp8_sites)


def test_sites_kept_high_get_no_qdq(tmp_path):
    model, inputs = transformer()
    everything = export_onnx(model, inputs, tmp_path / "a.onnx")
    policy = fp8fx.Policy(rules=(fp8fx.Rule(match="*.up", precision="high"), fp8fx.Rule(match="lm_head", precision="high")))
    fewer = export_onnx(model, inputs, tmp_path / "b.onnx", policy)
    assert everything.quantize_nodes - fewer.quantize_nodes == 3  # blocks.0.up, blocks.1.up, lm_head
    proto = onnx.load(tmp_path / "b.onnx")
    for site in fewer.sites:
        if site.site.endswith(".up") or site.site == "lm_head":
            assert site.precision == "high"
            assert not any("Linear" in n.op_type for n in proto.graph.node if n.name in site.onnx_nodes)


def test_blockwise_needs_opset_21_and_writes_nothing_before(tmp_path):
    model, inputs = transformer()
    out = tmp_path / "m.onnx"
    with pytest.raises(ExportError, match="blockwise weight scales need opset 21"):
        export_onnx(model, inputs, out, fp8fx.Policy.from_recipe("blockwise"), opset=20)
    assert not out.exists()
    result = export_onnx(model, inputs, out, fp8fx.Policy.from_recipe("blockwise"))
    proto = onnx.load(out)
    blocks = [a.i for n in proto.graph.node if n.op_type == "DequantizeLinear" for a in n.attribute if a.name == "block_size"]
    assert [b for b in blocks if b] == [128] * result.fp8_weights  # activations: per tensor (0)


def test_mxfp8_weights_are_torchaos_mx_blocks_and_need_opset_21(tmp_path):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    model, inputs = mlp("gelu", rank=3, bias=True, dims=(64, 96, 32))
    out, policy = tmp_path / "m.onnx", fp8fx.Policy.from_recipe("mxfp8")
    with pytest.raises(ExportError, match=r"^site 0: mx weight scales need opset 21 or newer"):
        export_onnx(model, inputs, out, policy, opset=20)
    assert not out.exists()
    result = export_onnx(model, inputs, out, policy)
    assert result.verified and result.fp8_weights == 2 and result.sqnr_vs_original_db > 25
    proto = onnx.load(out)
    values = {init.name: onnx.numpy_helper.to_array(init) for init in proto.graph.initializer}
    dequantizes = [
        n
        for n in proto.graph.node
        if n.op_type == "DequantizeLinear" and values.get(n.input[0]) is not None and values[n.input[0]].ndim == 2
    ]
    assert len(dequantizes) == 2
    for node, linear in zip(dequantizes, (model[0], model[2])):
        assert {a.name: a.i for a in node.attribute} == {"axis": 0, "block_size": 32}
        data, scale_inv = (torch.from_numpy(values[name].astype("float32")) for name in node.input[:2])
        e8m0, mx_data = to_mx(linear.weight.detach(), torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
        # K x N in the file, N x K in the module; torchao's E8M0 exponents are the file's scales
        assert torch.equal(data, mx_data.float().T)
        assert torch.equal(scale_inv, torch.exp2(e8m0.view(torch.uint8).float() - 127).reshape(linear.out_features, -1).T)


def test_dynamic_batch_and_sequence(tmp_path):
    model, inputs = transformer()
    export_onnx(model, inputs, tmp_path / "m.onnx", dynamic=("batch", "seq"))
    proto = onnx.load(tmp_path / "m.onnx")
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert all(d.dim_param for d in dims)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    tokens = torch.randint(0, 256, (3, 16))
    (logits,) = session.run(None, {session.get_inputs()[0].name: tokens.numpy()})
    assert logits.shape == (3, 16, 256)


def test_relu_mlp_on_a_2d_input_matches_as_deployed(tmp_path):
    model, inputs = mlp("relu", rank=2, bias=True)
    result = export_onnx(model, inputs, tmp_path / "m.onnx")
    assert result.verified and result.max_abs_diff_vs_emulation <= 1e-4 and result.quantize_nodes == 2
    ops = [n.op_type for n in onnx.load(tmp_path / "m.onnx").graph.node]
    assert "Relu" not in ops and ops.count("Max") == 1  # the form onnxruntime's optimiser leaves alone
    check_as_deployed(tmp_path / "m.onnx", model, inputs)


def sweep_cases(count: int = 6, seed: int = 0) -> list[tuple[str, int, bool, tuple[int, int, int]]]:
    """Every activation once, then random ones; random rank, bias and dims (multiples of 16)."""
    rng = random.Random(seed)
    names = list(ACTIVATIONS) + [rng.choice(list(ACTIVATIONS)) for _ in range(count - len(ACTIVATIONS))]
    return [(name, rng.choice((2, 3)), rng.random() < 0.5, tuple(16 * rng.randint(1, 4) for _ in range(3))) for name in names]


@pytest.mark.parametrize("activation,rank,bias,dims", sweep_cases(), ids=lambda v: str(v))
def test_mlp_sweep_exports_and_matches_as_deployed(tmp_path, activation, rank, bias, dims):
    model, inputs = mlp(activation, rank, bias, dims)
    result = export_onnx(model, inputs, tmp_path / "m.onnx")
    assert result.verified and result.max_abs_diff_vs_emulation <= 1e-3
    check_as_deployed(tmp_path / "m.onnx", model, inputs)


@pytest.mark.parametrize(
    "activation,rank,message",
    [("relu", 3, "differs from fp8fx's emulation"), ("relu6", 2, "onnxruntime .* could not run the exported model")],
)
def test_verification_runs_onnxruntime_as_deployed(tmp_path, monkeypatch, activation, rank, message):
    """With Relu/Clip left as they are, onnxruntime's default optimisations change or reject the
    model (even 3-D, where a Reshape sits between the Relu and the QuantizeLinear): it is refused."""
    import fp8fx.tools.export as export_module

    monkeypatch.setattr(export_module, "_clamps_as_max_min", lambda graph: None)
    model, inputs = mlp(activation, rank, bias=True)
    with pytest.raises(ExportError, match=message):
        export_onnx(model, inputs, tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.export cannot capture it
            return self.fc(x)
        return x


@pytest.mark.parametrize(
    "model,inputs,policy,message",
    [
        (Branchy(), (torch.ones(4, 32),), None, "torch.export could not capture the model"),
        (
            TinyTransformer(dim=64, heads=4, layers=1, max_seq=32),
            (torch.randint(0, 256, (2, 32)),),
            fp8fx.Policy(rules=(fp8fx.Rule(match="*", op="bmm", precision="fp8"),)),
            "FP8 bmm cannot be exported",
        ),
    ],
    ids=["does-not-trace", "unsupported-op"],
)
def test_bad_input_is_one_clear_error_and_no_file(tmp_path, model, inputs, policy, message):
    out = tmp_path / "m.onnx"
    with pytest.raises(ExportError, match=message):
        export_onnx(model, inputs, out, policy)
    assert list(tmp_path.iterdir()) == []


def test_a_mismatch_with_the_emulation_is_an_error(tmp_path, monkeypatch):
    import fp8fx.tools.export as export_module

    real = export_module._onnx_translations

    def without_quantization(opset):  # an exporter bug: the activation QDQ becomes an identity
        table = real(opset)
        table[torch.ops.fp8fx.export_qdq.default] = lambda x, scale_inv, fmt: x
        return table

    monkeypatch.setattr(export_module, "_onnx_translations", without_quantization)
    model, inputs = transformer()
    with pytest.raises(ExportError, match="differs from fp8fx's emulation"):
        export_onnx(model, inputs, tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []
    export_onnx(model, inputs, tmp_path / "m.onnx", verify=False)  # --no-verify writes it anyway
    assert (tmp_path / "m.onnx").exists()


def test_cli_export(tmp_path):
    out = tmp_path / "m.onnx"
    result = CliRunner().invoke(
        app, ["export", str(ASSETS / "transformer.py"), "--onnx", str(out), "--recipe", "rowwise", "--calibrate", "2"]
    )
    assert result.exit_code == 0, result.output
    assert (
        out.exists()
        and "9 QuantizeLinear, 18 DequantizeLinear, 9 FP8 weights" in result.stdout
        and "SQNR against the original model" in result.stdout
    )
    bad = CliRunner().invoke(app, ["export", str(ASSETS / "transformer.py"), "--onnx", str(tmp_path / "x.onnx"), "--opset", "17"])
    assert bad.exit_code == 1 and "need opset 19 or newer" in bad.output and not (tmp_path / "x.onnx").exists()


def test_e5m2_where_the_policy_says(tmp_path):
    model, inputs = transformer()
    policy = fp8fx.Policy(rules=(fp8fx.Rule(match="lm_head", format="e5m2"),))
    result = export_onnx(model, inputs, tmp_path / "m.onnx", policy)
    proto = onnx.load(tmp_path / "m.onnx")
    e5m2 = [init for init in proto.graph.initializer if init.data_type == onnx.TensorProto.FLOAT8E5M2 and len(init.dims) == 2]
    assert len(e5m2) == 1 and fp8_weight_initializers(proto) == 8  # lm_head's weight in E5M2, the others E4M3
    assert result.verified and result.max_abs_diff_vs_emulation <= 1e-3


def test_delayed_scaling_exports_the_scale_training_ended_with(tmp_path):
    model, inputs = transformer()
    policy = fp8fx.Policy.from_recipe("delayed")
    fp8fx.prepare(model)
    compiled = torch.compile(model, backend=fp8fx.backend(policy=policy, inner="eager"))
    for _ in range(3):
        compiled(*inputs).float().logsumexp(-1).mean().backward()
    torch._dynamo.reset()
    from fp8fx.compiler.state import state_for
    from fp8fx.passes.annotation import state_key

    scale = state_for(list(model.parameters())).get(state_key("lm_head", "output", "input")).scale.item()
    # calibration on other data (all token 0) would give another scale: the state must win
    result = export_onnx(model, inputs, tmp_path / "m.onnx", policy, calibration=[(inputs[0] * 0,)])
    proto = onnx.load(tmp_path / "m.onnx")
    (site,) = [s for s in result.sites if s.site == "lm_head"]
    lm_head = next(n for n in proto.graph.node if n.op_type == "QuantizeLinear" and n.name in site.onnx_nodes)
    scale_inv = next(onnx.numpy_helper.to_array(i) for i in proto.graph.initializer if i.name == lm_head.input[1])
    assert float(scale_inv) == pytest.approx(1 / scale, rel=1e-6)


@pytest.mark.parametrize("opset,recipe", [(19, "tensorwise"), (20, "rowwise")])
def test_opsets_19_and_20_export_with_opset_19_qdq(tmp_path, opset, recipe):
    model, inputs = mlp("relu", rank=2, bias=True)
    result = export_onnx(model, inputs, tmp_path / "m.onnx", fp8fx.Policy.from_recipe(recipe), opset=opset)
    assert result.verified and result.max_abs_diff_vs_emulation <= 1e-4
    proto = onnx.load(tmp_path / "m.onnx")
    onnx.checker.check_model(proto, full_check=True)
    assert {o.domain: o.version for o in proto.opset_import}[""] == opset
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("QuantizeLinear") == 2 and ops.count("DequantizeLinear") == 4 and fp8_weight_initializers(proto) == 2
    weight_scales = sorted(list(i.dims) for i in proto.graph.initializer if i.name.endswith("weight_scale_inv"))
    assert weight_scales == ([[16], [32]] if recipe == "rowwise" else [[], []])  # per output channel (axis 1) or one
    check_as_deployed(tmp_path / "m.onnx", model, inputs)


BF16_MODEL = """import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).to(torch.bfloat16)

def example_inputs():
    return (torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),)
"""


def test_float16_exports_verified_and_bfloat16_unverified_on_request(tmp_path):
    model, inputs = mlp("relu", rank=2, bias=True)
    half, half_inputs = model.half(), tuple(t.half() for t in inputs)
    result = export_onnx(half, half_inputs, tmp_path / "h.onnx")
    assert result.verified and result.sqnr_vs_original_db > 20
    scales = {i.data_type for i in onnx.load(tmp_path / "h.onnx").graph.initializer if "scale_inv" in i.name}
    assert scales == {onnx.TensorProto.FLOAT16}  # DequantizeLinear returns float16, the GEMMs read it
    session = ort.InferenceSession(str(tmp_path / "h.onnx"), providers=["CPUExecutionProvider"])
    (deployed,) = session.run(None, {session.get_inputs()[0].name: half_inputs[0].numpy()})
    with torch.no_grad():
        assert sqnr(torch.from_numpy(deployed).float(), half(*half_inputs).float()) > 20

    (tmp_path / "bf16.py").write_text(BF16_MODEL)
    bf16 = load_model_file(tmp_path / "bf16.py", real_weights=True)
    out = tmp_path / "b.onnx"
    with pytest.raises(
        ExportError,
        match=r"computes in bfloat16, .* cannot be verified: export model.half\(\) or model.float\(\), or .* verify=False \(--no-verify\)",
    ):
        export_onnx(bf16.model, bf16.example_inputs, out)
    assert not out.exists()
    args = ["export", str(tmp_path / "bf16.py"), "--onnx", str(out)]
    refused = CliRunner().invoke(app, args)
    assert (
        refused.exit_code == 1
        and refused.output.count("\n") == 1
        and "bfloat16" in refused.output
        and "--no-verify" in refused.output
    )
    assert not out.exists()
    written = CliRunner().invoke(app, [*args, "--no-verify"])
    assert written.exit_code == 0 and "not verified (--no-verify)" in written.stdout, written.output
    onnx.checker.check_model(str(out), full_check=True)
    proto = onnx.load(out)
    assert {i.data_type for i in proto.graph.initializer if "scale_inv" in i.name} == {onnx.TensorProto.BFLOAT16}
    import ml_dtypes

    (x,) = bf16.example_inputs
    (spec,) = ReferenceEvaluator(proto).run(None, {proto.graph.input[0].name: x.float().numpy().astype(ml_dtypes.bfloat16)})
    with torch.no_grad():
        assert sqnr(torch.from_numpy(spec.astype("float32")), bf16.model(x).float()) > 20


def test_export_is_silent_in_eval_mode_and_keeps_the_modules_modes(tmp_path):
    model, inputs = mlp("relu", rank=2, bias=True)
    model[1].eval()  # a mixed state, restored as it was
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_onnx(model, inputs, tmp_path / "m.onnx")
        cli = CliRunner().invoke(app, ["export", str(ASSETS / "mlp.py"), "--onnx", str(tmp_path / "c.onnx")])
    assert [str(w.message) for w in caught] == []
    assert [m.training for m in model.modules()] == [True, True, False, True]
    assert cli.exit_code == 0 and cli.stderr == "" and "wrote" in cli.stdout


def test_a_weight_granularity_export_has_no_layout_for_is_refused():
    from types import SimpleNamespace

    from fp8fx.core.formats import Fp8Format
    from fp8fx.tools.export import _quantized_weight

    decision = SimpleNamespace(granularity=SimpleNamespace(value="mx1x32"), formats=(Fp8Format.E4M3,) * 2,
                               blocks=((1, 32), (32, 1)), margin=0, power_of_two=True)  # fmt: skip
    with pytest.raises(ExportError, match=r"^site lin: mx1x32 weight scales have no ONNX export; keep the site high"):
        _quantized_weight(torch.randn(64, 32), decision, torch.float32, 21, "lin")
