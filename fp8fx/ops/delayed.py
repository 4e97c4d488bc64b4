"""`fp8fx::delayed_scale` and `fp8fx::delayed_scale_step`: how compiled graphs read and update
delayed-scaling state, and the registry of the module instances that hold it.

A graph that uses delayed scaling takes one extra input, a handle: a one-element int64 CPU tensor
holding the number of a registered instance (an object with `state(key)`, see
`fp8fx.compiler.state.StateInstance`: a model's states as one module instance names them). The
ops find a state by (handle, key) when they run, so a graph's inputs do not depend on which states
it uses: the backend learns the keys from its own rewrite (or from cached records) instead of
tracing the graph once more before compiling it, and one graph serves every instance of a block.

    fp8fx::delayed_scale(Tensor handle, str key, Device device) -> Tensor
    fp8fx::delayed_scale_step(Tensor(a!) handle, str key, Tensor amax, float fp8_max, int margin,
                              bool power_of_two, bool most_recent, int interval) -> Tensor

`delayed_scale` returns a copy of the scale in use. `delayed_scale_step` records this step's amax
(the max of `amax`: partial amaxes, per row, under Inductor) and updates the state in place
(`delayed_scale_update`'s formula). It declares that it writes the
handle, which it does not: that orders it after every read of the handle in the graph (Inductor
schedules a write after the reads before it) and keeps it through dead-code elimination.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import custom_op

from fp8fx.ops import reference
from fp8fx.ops.registry import Registry

_INSTANCES = Registry("delayed-scaling instance", "state")


def register(instance) -> Tensor:
    """Register `instance` (held weakly: its owner keeps it alive); returns the handle graphs take."""
    return torch.tensor([_INSTANCES.register(instance)], dtype=torch.int64)


def _state(handle: Tensor, key: str):
    number = int(handle[0])
    instance = _INSTANCES.lookup(number)
    if instance is None:
        raise RuntimeError(
            f"fp8fx: delayed-scaling handle {number} names no live model instance: the backend that compiled this "
            "graph was dropped"
        )
    return instance.state(key)


@custom_op("fp8fx::delayed_scale", mutates_args=())
def delayed_scale(handle: Tensor, key: str, device: torch.device) -> Tensor:
    """The scale state `key` casts with this step (a copy: the state moves on at the graph's end)."""
    return _state(handle, key).scale.to(device, copy=True)


@delayed_scale.register_fake
def _(handle: Tensor, key: str, device: torch.device) -> Tensor:
    return torch.empty((), device=device)


@custom_op("fp8fx::delayed_scale_step", mutates_args=("handle",))
def delayed_scale_step(
    handle: Tensor,
    key: str,
    amax: Tensor,
    fp8_max: float,
    margin: int,
    power_of_two: bool,
    most_recent: bool,
    interval: int,
) -> Tensor:
    """One step of state `key`, in place; returns a copy of the new scale (a value the graph keeps,
    so that partitioning keeps the op). `amax` may hold partial amaxes (Inductor's graphs pass the
    amax of each row, `fp8fx.compiler.lowering._state_amax`): their max is this step's amax."""
    state = _state(handle, key)
    amax = amax.amax()
    tensors = (state.amax_history, state.scale, state.steps, state.non_finite)
    updated = reference.delayed_scale_update(
        *tensors, amax.to(state.scale.device), fp8_max, margin, power_of_two, most_recent, interval
    )
    for tensor, value in zip(tensors, updated):
        tensor.copy_(value)
    return updated[1].to(amax.device, copy=True)


@delayed_scale_step.register_fake
def _(handle, key, amax, fp8_max, margin, power_of_two, most_recent, interval):
    return torch.empty((), device=amax.device)
