"""Delayed-scaling state created by `fp8fx.prepare(model, policy=..., example_inputs=...)`, before
the first step: the state dict holds every key the compile uses, so torch.distributed.checkpoint
(which loads only the keys a model already has) resumes a run exactly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import GatedBlock
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import fp8fx
from fp8fx import Policy

POLICY = Policy.from_recipe("delayed", amax_history_len=4)
EXAMPLE = (torch.randn(4, 8, 64),)


def _state_keys(model: nn.Module) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in model.state_dict().items() if k.startswith("fp8fx_state.")}


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_prepare_creates_exactly_the_states_the_compile_uses(inner):
    torch.manual_seed(0)
    model = GatedBlock()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fp8fx.prepare(model, policy=POLICY, example_inputs=EXAMPLE)
    prepared = _state_keys(model)
    assert prepared  # before any compile or step
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if k in before)  # weights untouched
    states = model.fp8fx_state.states.values()
    assert all(not s.amax_history.any() and s.scale.item() == 1 and s.steps.item() == 0 for s in states)

    torch.manual_seed(0)
    reference = fp8fx.prepare(GatedBlock())  # states made by the compile, as without example inputs
    compiled = torch.compile(reference, backend=fp8fx.backend(POLICY, inner=inner))
    compiled(*EXAMPLE).sum().backward()
    assert prepared == _state_keys(reference)
    # The prepared model compiles onto the states it has: none added, all stepped.
    compiled = torch.compile(model, backend=fp8fx.backend(POLICY, inner=inner))
    compiled(*EXAMPLE).sum().backward()
    assert _state_keys(model) == prepared and all(s.steps.item() == 1 for s in states)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 8, 64, generator=gen), torch.randn(4, 8, 64, generator=gen)


def _train(model, opt, steps) -> list[float]:
    compiled = torch.compile(model, backend=fp8fx.backend(POLICY, inner="eager"))
    losses = []
    for step in steps:
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _fresh(example_inputs):
    torch.manual_seed(0)
    model = GatedBlock()
    if example_inputs is None:
        fp8fx.prepare(model)
    else:
        fp8fx.prepare(model, policy=POLICY, example_inputs=example_inputs)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _resumed(path, example_inputs) -> tuple[list[float], set[str]]:
    torch._dynamo.reset()
    model, opt = _fresh(example_inputs)
    model_sd, opt_sd = get_state_dict(model, opt)  # the keys the model has now are all DCP fills
    dcp.load({"model": model_sd, "optim": opt_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=opt_sd)
    return _train(model, opt, range(3, 6)), {k for k in model_sd if k.startswith("fp8fx_state.")}


def test_dcp_resume_reproduces_the_uninterrupted_run(tmp_path):
    model, opt = _fresh(EXAMPLE)
    _train(model, opt, range(3))
    model_sd, opt_sd = get_state_dict(model, opt)
    saved = {k for k in model_sd if k.startswith("fp8fx_state.")}
    assert saved
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=tmp_path)
    straight = _train(model, opt, range(3, 6))

    resumed, loaded = _resumed(tmp_path, EXAMPLE)
    assert loaded == saved and resumed == straight
    # Prepared without example inputs, the model has no state keys when DCP loads: scales restart.
    restarted, loaded = _resumed(tmp_path, None)
    assert not loaded and restarted != straight


def test_prepare_checks_its_arguments():
    with pytest.raises(ValueError, match="give both policy and example_inputs"):
        fp8fx.prepare(GatedBlock(), example_inputs=EXAMPLE)
    with pytest.raises(TypeError, match="example_inputs must be a tensor or a tuple"):
        fp8fx.prepare(GatedBlock(), policy=POLICY, example_inputs=[[1, 2]])
    with torch.device("meta"):
        meta = GatedBlock()
    with pytest.raises(ValueError, match="the model is on the meta device"):
        fp8fx.prepare(meta, policy=POLICY, example_inputs=EXAMPLE)


def test_a_compile_with_another_history_length_is_a_clear_error():
    model = fp8fx.prepare(GatedBlock(), policy=POLICY, example_inputs=EXAMPLE)
    other = Policy.from_recipe("delayed", amax_history_len=8)
    with pytest.raises(Exception, match="has an amax history of 4, this compile's policy needs 8"):
        torch.compile(model, backend=fp8fx.backend(other, inner="eager"))(*EXAMPLE)
