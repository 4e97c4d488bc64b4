"""`fp8fx::delayed_scales` and `fp8fx::delayed_scale_steps`: how compiled graphs read and update
delayed-scaling state, and the registry of the module instances that hold it.

A graph that uses delayed scaling takes one extra input, a handle: a one-element int64 CPU tensor
holding the number of a registered instance (an object with `state(key)`, see
`fp8fx.compiler.state.StateInstance`: a model's states as one module instance names them). The
ops find a state by (handle, key) when they run, so a graph's inputs do not depend on which states
it uses: the backend learns the keys from its own rewrite (or from cached records) instead of
tracing the graph once more before compiling it, and one graph serves every instance of a block.

    fp8fx::delayed_scales(Tensor handle, str keys, Device device) -> Tensor[]
    fp8fx::delayed_scale_steps(Tensor(a!) handle, str keys, Tensor[] amaxes, float[] fp8_max,
                               int[] margin, bool[] power_of_two, bool[] most_recent, int[] interval) -> Tensor

`delayed_scales` returns copies of the scales in use and their inverses. `delayed_scale_steps`
records this step's amaxes (each the max of its entry: partial amaxes, per row, under Inductor)
and updates the states in place (`delayed_scale_update`'s formula). A graph calls each once per
side (forward's casts, backward's) with all the states that side uses, one key a line (a custom
op takes no list of strings). `delayed_scale_steps` declares that it writes the handle, which it
does not: that orders it after every read of the handle in the graph (Inductor schedules a write
after the reads before it) and keeps it through dead-code elimination.
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


@custom_op("fp8fx::delayed_scales", mutates_args=())
def delayed_scales(handle: Tensor, keys: str, device: torch.device) -> list[Tensor]:
    """The scale each state in `keys` (one key a line) casts with this step, and its inverse,
    interleaved: [scale 0, inverse 0, scale 1, ...], each a 0-d tensor of its own (a view of one
    stacked tensor would reach Inductor's `_scaled_mm` lowering as a view, which it cannot
    reshape), copies (the states move on at the graph's end). Two multi-tensor kernels on a GPU
    however many states a graph reads."""
    states = [_state(handle, key) for key in keys.split("\n")]
    scales = [torch.empty((), device=device) for _ in states]
    torch._foreach_copy_(scales, [state.scale for state in states])
    return [value for pair in zip(scales, torch._foreach_reciprocal(scales)) for value in pair]


@delayed_scales.register_fake
def _(handle: Tensor, keys: str, device: torch.device) -> list[Tensor]:
    return [torch.empty((), device=device) for _ in range(2 * len(keys.split("\n")))]


_STATE_TENSORS = ("amax_history", "scale", "steps", "non_finite")  # what a step updates, in `delayed_scale_update`'s order


@custom_op("fp8fx::delayed_scale_steps", mutates_args=("handle",))
def delayed_scale_steps(
    handle: Tensor,
    keys: str,
    amaxes: list[Tensor],
    fp8_max: list[float],
    margin: list[int],
    power_of_two: list[bool],
    most_recent: list[bool],
    interval: list[int],
) -> Tensor:
    """One step of each state in `keys` (one key a line), in place, with the settings at its
    index; returns a copy of the new scales, in `keys`' order (a value the graph keeps, so that
    partitioning keeps the op). Each `amaxes` entry may hold partial amaxes (Inductor's graphs
    pass the amax of each row, `fp8fx.compiler.lowering._state_amax`): their max is that state's
    amax.

    States with the same settings and history length step together: stacked, updated by one
    batched `delayed_scale_update` and copied back, about 60 tensor ops (a GPU's kernels, some of
    them views) for the group where each state alone took as many, plus one reduction per state."""
    states = [_state(handle, key) for key in keys.split("\n")]
    settings = list(zip(fp8_max, margin, power_of_two, most_recent, interval))
    groups: dict[tuple, list[int]] = {}
    for i, state in enumerate(states):
        groups.setdefault((settings[i], state.amax_history.shape, state.scale.device), []).append(i)
    new_scales = [None] * len(states)
    for (setting, _, device), members in groups.items():
        kept = [[getattr(states[i], name) for i in members] for name in _STATE_TENSORS]
        amax = torch.stack([amaxes[i].amax() for i in members]).to(device)
        updated = reference.delayed_scale_update(*(torch.stack(tensors) for tensors in kept), amax, *setting)
        for tensors, value in zip(kept, updated):
            torch._foreach_copy_(tensors, list(value.unbind(0)))
        for i, scale in zip(members, updated[1].unbind(0)):
            new_scales[i] = scale
    return torch.stack(new_scales).to(amaxes[0].device)


@delayed_scale_steps.register_fake
def _(handle, keys, amaxes, fp8_max, margin, power_of_two, most_recent, interval):
    return torch.empty((len(amaxes),), device=amaxes[0].device)
