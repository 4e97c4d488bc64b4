"""Delayed-scaling state: amax histories and scales that travel with the model.

`fp8fx.prepare(model)` gives the model an `Fp8State` (not a submodule: models that iterate over
their children, like `nn.Sequential`, stay unchanged) and state-dict hooks, so the state appears
in `model.state_dict()` under `fp8fx_state.` and `load_state_dict` restores it. The backend fills
it when it compiles a graph that uses delayed scaling: one `DelayedScalingState` per FP8 cast,
named after the first GEMM operand that needs it (`layers.0.q_proj.output.input`). The buffers
are graph inputs, updated inside the compiled graph every step, so a run resumed from a
checkpoint continues with the same scales. A checkpoint may be loaded before the first compile:
its values wait until the buffers are created.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

STATE_ATTR = "fp8fx_state"
BUFFERS = ("amax_history", "scale", "steps", "non_finite")


def state_key(site: str, gemm_role: str, operand_role: str) -> str:
    return f"{site}.{gemm_role}.{operand_role}"


def _module_name(key: str) -> str:
    # Module names cannot hold dots; state_dict keys become fp8fx_state.<site with __>....
    return key.replace(".", "__").replace(":", "_").replace("#", "_").replace("<", "").replace(">", "")


class DelayedScalingState(nn.Module):
    """TE's per-tensor delayed-scaling state: amax history (slot 0 is this step's), the scale in
    use, a step counter (for `interval`) and the number of non-finite amaxes seen."""

    def __init__(self, history_len: int):
        super().__init__()
        self.register_buffer("amax_history", torch.zeros(history_len))
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("non_finite", torch.zeros((), dtype=torch.int64))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in BUFFERS]


class Fp8State(nn.Module):
    def __init__(self):
        super().__init__()
        self.states = nn.ModuleDict()
        self._pending: dict[str, torch.Tensor] = {}  # loaded before the buffers existed

    def ensure(self, key: str, history_len: int, device: torch.device) -> DelayedScalingState:
        name = _module_name(key)
        if name not in self.states:
            state = DelayedScalingState(history_len).to(device)
            prefix = f"states.{name}."
            for buf in BUFFERS:
                loaded = self._pending.pop(prefix + buf, None)
                if loaded is not None:
                    if loaded.shape != getattr(state, buf).shape:
                        raise ValueError(
                            f"fp8fx: checkpoint state {key}.{buf} has shape {tuple(loaded.shape)}, the policy needs "
                            f"{tuple(getattr(state, buf).shape)} (amax_history_len changed?)"
                        )
                    getattr(state, buf).copy_(loaded)
            self.states[name] = state
        return self.states[name]

    def get(self, key: str) -> DelayedScalingState | None:
        name = _module_name(key)
        return self.states[name] if name in self.states else None

    def load(self, items: dict[str, torch.Tensor]) -> None:
        """Load `states.<name>.<buffer>` entries; those of states not created yet wait in `_pending`."""
        for key, value in items.items():
            name, _, buf = key.removeprefix("states.").partition(".")
            if name in self.states and buf in BUFFERS:
                getattr(self.states[name], buf).copy_(value)
            else:
                self._pending[key] = value.detach().clone()


_PREPARED: weakref.WeakValueDictionary[int, Fp8State] = weakref.WeakValueDictionary()


def prepare(model: nn.Module) -> nn.Module:
    """Give `model` a place for fp8fx's delayed-scaling state, saved in its `state_dict`. Returns it.

    Call before `torch.compile` and before `load_state_dict` of a checkpoint that holds state."""
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        state = Fp8State()
        object.__setattr__(model, STATE_ATTR, state)  # plain attribute: not a child module

        def save(module, state_dict, prefix, local_metadata):
            for key, value in state.state_dict().items():
                state_dict[f"{prefix}{STATE_ATTR}.{key}"] = value

        def load(module, state_dict, prefix, *args):
            mine = f"{prefix}{STATE_ATTR}."
            state.load({key[len(mine) :]: state_dict.pop(key) for key in list(state_dict) if key.startswith(mine)})

        model.register_state_dict_post_hook(save)
        model.register_load_state_dict_pre_hook(load)
    for p in model.parameters():
        _PREPARED[id(p)] = state
    return model


def state_for(params: list[torch.Tensor]) -> Fp8State | None:
    """The state of the prepared model whose parameters these are."""
    states = {id(s): s for p in params if (s := _PREPARED.get(id(p))) is not None}
    return next(iter(states.values())) if len(states) == 1 else None
