"""`fp8fx.prepare`: give a model its delayed-scaling state (`fp8fx.compiler.state`) and, given a
policy and example inputs, create every state a compile will use now, from a shape-only trace of a
copy of the model through the same backend (`fp8fx.compiler.trace`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fp8fx.compiler.backend import Fp8fxBackend
from fp8fx.compiler.state import STATE_ATTR, Fp8State, attach
from fp8fx.compiler.trace import compiled_once, default_loss


def prepare(
    model: nn.Module,
    amax_group=None,  # noqa: ANN001 - a ProcessGroup
    *,
    policy: Any = None,
    example_inputs: tuple | None = None,
) -> nn.Module:
    """Give `model` a place for fp8fx's delayed-scaling state, saved in its `state_dict`. Returns it.

    Call before `torch.compile` and before loading a checkpoint that holds state. Under
    torch.distributed, every amax is reduced (max) across `amax_group` before it updates a
    scale, so all ranks use the same scales, as TransformerEngine's `reduce_amax`; the default is
    the default process group, which must be the data-parallel one.

    With `policy` (a `Policy`, a policy file, or the `Fp8fxBackend` the model is compiled with) and
    `example_inputs` (the model's positional inputs; of tensors only shapes and dtypes matter), the
    states are created now, on the parameters' device: the same passes run on a shape-only trace of
    a copy of the model, forward and backward, so `model.state_dict()` holds every state key before
    the first step, and loaders that fill only the keys a model has (torch.distributed.checkpoint)
    restore them. Without them, the states are created when the model is first compiled."""
    if (policy is None) != (example_inputs is None):
        raise ValueError("fp8fx.prepare: give both policy and example_inputs to create the states now, or neither")
    state = attach(model, amax_group)
    if example_inputs is not None:
        device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
        if device.type == "meta":
            raise ValueError("fp8fx.prepare: the model is on the meta device; create the states after it gets its real device")
        for name, history_len in _states_needed(model, policy, example_inputs).items():
            state._ensure(name, history_len, device, name)
    return model


def _states_needed(model: nn.Module, policy: Any, example_inputs: Any) -> dict[str, int]:
    """The states a compile of `model` with `policy` creates (name -> history length), found by
    compiling a copy of it whose parameters are fake tensors (no memory, no values) and running
    one forward and backward on fake inputs."""
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(inputs, (tuple, list)) or not any(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError(
            "fp8fx.prepare: example_inputs must be a tensor or a tuple of the model's positional inputs, got "
            f"{example_inputs!r:.80}"
        )
    if isinstance(policy, Fp8fxBackend):  # the settings that decide which casts exist; eager: nothing to generate
        given = policy
        plain = dict(kernels="auto", keep_graphs=False, monitor_every=0, epilogues_to_inductor=False)  # the rest as by default
        backend = Fp8fxBackend(given.options.replace(inner="eager", **plain))
        backend.overrides = dict(given.overrides)
    else:
        backend = Fp8fxBackend(policy=policy, inner="eager")
    if not backend.policy.uses_delayed_scaling:
        return {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, Any] = {id(model.__dict__[STATE_ATTR]): Fp8State()}  # the copy gets a state of its own
    for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values():
        fake = mode.from_tensor(t.detach())
        memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
    shadow = copy.deepcopy(model, memo)
    for module in shadow.modules():
        module._compiled_call_impl = None  # a block compiled in place would run the original's code
    attach(shadow)
    fake_inputs = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs]  # None, flags: as given
    with compiled_once(shadow, backend) as compiled, torch.enable_grad():
        loss = default_loss(compiled(*fake_inputs))
        if loss.requires_grad:
            loss.backward()  # the gradients' casts have states too
    return {name: s.amax_history.numel() for name, s in shadow.__dict__[STATE_ATTR].states.items()}
