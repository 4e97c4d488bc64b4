"""fp8fx in torchtitan 0.3, with torchtitan's own config machinery and its llama3 debug model on
CPU: the converter selected by name from a parsed job config (`override.imports`, applied by
torchtitan's `apply_overrides`) and listed in the model registry's converters, one training step
of the converted model against the plain model (losses, logits and gradients within FP8's error,
a report whose FP8 GEMMs are the block's linears), with torchtitan's selective activation
checkpointing and its per-block compile, and delayed-scaling state per block.

The debug model is cut to two blocks and uses SDPA instead of FlexAttention, which has no
backward on CPU (torchtitan's graph_trainer tests swap SDPA in the same way). torchtitan's
Trainer itself cannot run on a CPU-only torch: it calls `torch.cuda.set_device` in `__init__`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan")
try:  # torchtitan 0.3 needs a newer torch than fp8fx's oldest (2.11: no fsdp.DataParallelMeshDims)
    import torchtitan.models.llama3  # noqa: F401
except ImportError as e:
    pytest.skip(f"torchtitan does not import with torch {torch.__version__}: {e}", allow_module_level=True)

import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpointer.base import ModelWrapper
from torchtitan.components.lora import LoRAConverter
from torchtitan.config import CompileConfig, ConfigManager, ParallelismConfig
from torchtitan.config.override import apply_overrides
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.distributed.compile import apply_compile
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry

import fp8fx
from fp8fx.integrations.torchtitan import Fp8fxConverter, backend_of, create_states, report

BATCH, SEQ, VOCAB = 2, 64, 2048
BLOCK_LINEARS = {"attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"}
ROLES = {"output", "grad_input", "grad_weight"}


@pytest.fixture(autouse=True)
def _restore_dynamo_globals():
    """torchtitan's activation checkpointing and compile set process-wide Dynamo flags; put them back."""
    with torch._dynamo.config.patch(capture_scalar_outputs=False, skip_fwd_side_effects_in_bwd_under_checkpoint=False):
        yield
    torch._C._dynamo.eval_frame._set_lru_cache(True)  # SelectiveAC.apply turns Dynamo's LRU order off


def build(model_config) -> torch.nn.Module:
    """The model as torchtitan's Trainer makes it (meta device, `to_empty`, `init_weights`), with
    two blocks and SDPA."""
    model_config.layers = model_config.layers[:2]
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:], torch.arange(SEQ).repeat(BATCH, 1)


def step(model: torch.nn.Module, seed: int = 0) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward: loss, logits and gradients."""
    inputs, labels, positions = batch(seed)
    logits = model(inputs, positions=positions)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    return loss.item(), logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def sqnr(ref: torch.Tensor, other: torch.Tensor) -> float:
    return (10 * torch.log10(ref.double().pow(2).sum() / (ref.double() - other.double()).pow(2).sum())).item()


def converted(**options) -> torch.nn.Module:
    return build(model_registry("debugmodel", converters=[Fp8fxConverter.Config(inner="eager", **options)]).model)


@pytest.fixture(scope="module")
def plain():
    model = build(model_registry("debugmodel").model)
    return model.state_dict(), step(model)


def test_import_fp8fx_does_not_import_torchtitan():
    code = "import sys, fp8fx, fp8fx.integrations; assert 'torchtitan' not in sys.modules, 'torchtitan imported'"
    assert subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True).returncode == 0


def test_selected_by_name_from_a_parsed_job_config_with_its_options(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nrules:\n  - match: feed_forward.w2\n    precision: high\n")
    options = json.dumps({"policy": str(policy), "inner": "eager"})
    config = ConfigManager().parse_args(
        [
            "--module",
            "llama3",
            "--config",
            "llama3_debugmodel",
            "--override.imports",
            f"fp8fx.integrations.torchtitan.fp8fx={options}",
        ]
    )
    assert config.override.imports == [("fp8fx.integrations.torchtitan.fp8fx", {"policy": str(policy), "inner": "eager"})]

    # What Trainer.__init__ does before it builds the model (it builds the config object it held).
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    lines = apply_overrides(config.override, config)
    assert len(lines) == 1 and "fp8fx.integrations.torchtitan.fp8fx: model_spec.model" in lines[0]
    assert config.model_spec.model is model_config
    assert {type(layer).__qualname__ for layer in model_config.layers} == {"Fp8fxLlama3TransformerBlock.Config"}
    assert "_fp8fx_backend" not in json.dumps(config.to_dict()["model_spec"])  # the logged config is unchanged in form

    model = build(model_config)
    backend = backend_of(model)
    assert (backend.inner, backend.policy.source) == ("eager", str(policy))
    assert all(type(block).__name__ == "Fp8fxLlama3TransformerBlock" for block in model.layers.values())
    step(model)
    precision = {(op.site, op.role): op.precision for op in report(model).ops if op.op == "mm"}
    assert precision == {(site, role): "high" if site == "feed_forward.w2" else "fp8" for site in BLOCK_LINEARS for role in ROLES}


def test_converter_in_the_model_registry_converters_list():
    spec = model_registry("debugmodel", converters=[Fp8fxConverter.Config(fqns=["layers.[0-2]"])])
    kinds = [type(layer).__qualname__.split(".")[0] for layer in spec.model.layers]
    assert kinds == ["Fp8fxLlama3TransformerBlock"] * 3 + ["Llama3TransformerBlock"] * 3
    # A quantization converter: torchtitan's registry insists it comes before LoRA.
    with pytest.raises(ValueError, match="must be applied before LoRAConverter"):
        model_registry("debugmodel", converters=[LoRAConverter.Config(rank=4), Fp8fxConverter.Config()])
    model_registry("debugmodel", converters=[Fp8fxConverter.Config(), LoRAConverter.Config(rank=4)])


def test_converter_options_are_checked_when_the_config_is_made(tmp_path):
    with pytest.raises(ValueError, match="turn torchtitan's model compile off"):
        Fp8fxConverter(Fp8fxConverter.Config(model_compile_enabled=True))
    with pytest.raises(ValueError, match="inner must be one of inductor, eager"):
        Fp8fxConverter(Fp8fxConverter.Config(inner="aot_eager"))
    with pytest.raises(ValueError, match="a policy file or a recipe, not both"):
        Fp8fxConverter(Fp8fxConverter.Config(policy="p.yaml", recipe="rowwise"))
    with pytest.raises(fp8fx.PolicyError, match="cannot read policy file"):
        Fp8fxConverter(Fp8fxConverter.Config(policy=str(tmp_path / "missing.yaml")))


def test_one_training_step_matches_the_plain_model_within_fp8_error(plain):
    weights, (ref_loss, ref_logits, ref_grads) = plain
    model = converted()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    loss, logits, grads = step(model)

    rows = report(model).ops
    fp8 = {(op.site, op.role) for op in rows if op.precision == "fp8"}
    assert fp8 == {(site, role) for site in BLOCK_LINEARS for role in ROLES}  # every GEMM of every block linear, nothing else
    block = model.layers["0"]
    assert {name for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)} == BLOCK_LINEARS
    assert {op.site for op in rows if op.precision == "high"} == {"attention.inner_attention"}  # SDPA

    # FP8 really ran (not bit-identical), within FP8's error: E4M3 forward, E5M2 gradients.
    assert abs(loss - ref_loss) < 1e-3 * ref_loss
    assert 30 < sqnr(ref_logits, logits) < 80
    for name, grad in grads.items():
        low = 15 if name.startswith("layers.") else 30  # block weights' gradients come from FP8 GEMMs
        assert sqnr(ref_grads[name], grad) > low, name
    assert min(sqnr(ref_grads[n], grads[n]) for n in grads if n.endswith("w2.weight")) < 40


def test_selective_activation_checkpointing_recomputes_the_same_fp8_step(plain):
    no_ac = converted()
    loss, logits, grads = step(no_ac)
    model = converted()
    SelectiveAC.Config().build().apply(model)  # torchtitan's debug model default
    assert type(model.layers["0"]).__name__ == "CheckpointWrapper"
    ac_loss, ac_logits, ac_grads = step(model)
    assert ac_loss == loss and torch.equal(ac_logits, logits)
    assert len(ac_grads) == len(grads) and all(torch.equal(a, b) for a, b in zip(ac_grads.values(), grads.values()))
    assert report(model).summary()["fp8_gemms"] == 15


def test_torchtitans_per_block_compile_keeps_the_fp8fx_backend():
    model = converted()
    apply_compile(
        model,
        compile_config=CompileConfig(enable=True),
        parallel_dims=ParallelDims.from_config(ParallelismConfig(), world_size=1),
    )
    step(model)
    assert report(model).summary()["fp8_gemms"] == 15
    assert fp8fx.report(model.layers["1"]).summary()["fp8_gemms"] == 15


def test_report_says_when_an_outer_compile_replaced_fp8fx():
    model = converted()
    FullAC.Config().build().apply(model)
    apply_compile(
        model,
        compile_config=CompileConfig(enable=True, backend="aot_eager"),
        parallel_dims=ParallelDims.from_config(ParallelismConfig(), world_size=1),
    )
    step(model)
    with pytest.raises(ValueError, match="another torch.compile traced the blocks"):
        report(model)


def test_delayed_scaling_state_lives_in_each_block_and_the_state_dict():
    model = converted(recipe="delayed")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for i in range(2):
        losses.append(step(model, seed=i)[0])
        opt.step()
        opt.zero_grad()
    assert all(math.isfinite(loss) and loss < 10 for loss in losses)
    state = model.state_dict()
    key = "fp8fx_state.states.feed_forward__w2__output__weight"
    scales = [state[f"layers.{i}.{key}.scale"].item() for i in (0, 1)]
    assert scales[0] != scales[1] and all(s > 1 for s in scales)  # scaled from each block's own weight amaxes
    assert state[f"layers.0.{key}.steps"].item() == state[f"layers.1.{key}.steps"].item() == 2
    assert sum(k.endswith(".scale") for k in state if "fp8fx_state" in k) == 2 * 14  # 14 casts per block


def test_delayed_scaling_resumes_through_torchtitans_model_state_and_dcp(tmp_path):
    """torchtitan's checkpointer saves and loads the model through `ModelWrapper` with DCP, which
    fills only the keys the model has: `create_states` gives them before the first step."""

    def train(model, steps) -> list[float]:
        losses = []
        for i in steps:
            losses.append(step(model, seed=i)[0])
            with torch.no_grad():
                for p in model.parameters():
                    p -= 1e-2 * p.grad  # SGD: no optimizer state to checkpoint beside the model
                    p.grad = None
        return losses

    def resumed(states: bool) -> tuple[list[float], int]:
        torch._dynamo.reset()
        model = converted(recipe="delayed")
        if states:
            create_states(model, BATCH, SEQ)
        wrapper = ModelWrapper(model)
        target = {"model": wrapper.state_dict()}
        dcp.load(target, checkpoint_id=tmp_path)
        wrapper.load_state_dict(target["model"])
        return train(model, range(1, 2)), sum("fp8fx_state" in k for k in target["model"])

    model = converted(recipe="delayed")
    create_states(model, BATCH, SEQ)
    keys = {k for k in model.state_dict() if "fp8fx_state" in k}
    assert len(keys) == 2 * 14 * 4  # 14 casts per block, 4 buffers each, before any step
    train(model, range(1))
    assert {k for k in model.state_dict() if "fp8fx_state" in k} == keys  # the compile used the states it found
    dcp.save({"model": ModelWrapper(model).state_dict()}, checkpoint_id=tmp_path)
    straight = train(model, range(1, 2))
    assert resumed(True) == (straight, len(keys))
    losses, loaded = resumed(False)
    assert loaded == 0 and losses != straight  # without the states, the scales restart


@pytest.mark.slow
def test_the_default_inductor_inner_compiler(plain):
    _, (ref_loss, ref_logits, _) = plain
    model = build(model_registry("debugmodel", converters=[Fp8fxConverter.Config()]).model)
    loss, logits, _ = step(model)
    assert backend_of(model).inner == "inductor"
    assert report(model).summary()["fp8_gemms"] == 15
    assert abs(loss - ref_loss) < 1e-3 * ref_loss
    assert 30 < sqnr(ref_logits, logits) < 80
