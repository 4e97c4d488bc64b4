"""Delayed-scaling state: amax histories and scales that travel with the model.

`fp8fx.prepare(model)` gives the model an `Fp8State` (not a submodule: models that iterate over
their children, like `nn.Sequential`, stay unchanged) and state-dict hooks, so the state appears
in `model.state_dict()` under `fp8fx_state.` and `load_state_dict` restores it. The backend fills
it when it compiles a graph that uses delayed scaling: one `DelayedScalingState` per FP8 cast,
named after the first GEMM operand that needs it (`layers.0.q_proj.output.input`). Compiled
graphs read and update the buffers in place every step (through a handle, `fp8fx.ops.delayed`),
so a run resumed from a checkpoint continues with the same scales. A checkpoint may be loaded
before the first compile: its values wait until the buffers are created.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from torch import nn

STATE_ATTR = "fp8fx_state"
BUFFERS = ("amax_history", "scale", "steps", "non_finite")


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
        self.amax_group = None  # torch.distributed group the amaxes are reduced over (None: default)

    def ensure(self, key: str, history_len: int, device: torch.device) -> DelayedScalingState:
        return self._ensure(_module_name(key), history_len, device, key)

    def _ensure(self, name: str, history_len: int, device: torch.device, key: str) -> DelayedScalingState:
        found = self.states[name] if name in self.states else None
        if found is not None and found.amax_history.numel() != history_len:
            raise ValueError(
                f"fp8fx: delayed-scaling state {key} has an amax history of {found.amax_history.numel()}, this compile's "
                f"policy needs {history_len}: prepare the model with the policy it is compiled with"
            )
        if found is None:
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
                target = getattr(self.states[name], buf)
                if target.shape != value.shape:
                    raise ValueError(
                        f"fp8fx: checkpoint state {name}.{buf} has shape {tuple(value.shape)}, the model's state has "
                        f"{tuple(target.shape)} (amax_history_len changed?)"
                    )
                target.copy_(value)
            else:
                self._pending[key] = value.detach().clone()


_PREPARED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


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
    state.amax_group = amax_group
    _PREPARED.add(model)
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
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8fx.compiler.backend import Fp8fxBackend
    from fp8fx.tools.analyze import _default_loss

    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(inputs, (tuple, list)) or not any(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError(f"fp8fx.prepare: example_inputs must be a tensor or a tuple of the model's positional inputs, got {example_inputs!r:.80}")
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
    prepare(shadow)
    fake_inputs = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs]  # None, flags: as given
    try:
        with torch.enable_grad():
            loss = _default_loss(torch.compile(shadow, backend=backend)(*fake_inputs))
            if loss.requires_grad:
                loss.backward()  # the gradients' casts have states too
    finally:
        torch._dynamo.reset()  # the trace compiled a throwaway copy of the model's code
    return {name: s.amax_history.numel() for name, s in shadow.__dict__[STATE_ATTR].states.items()}


def _parameter_names(model: nn.Module) -> dict[int, str]:
    """FQN of each of `model`'s parameters by id, FSDP2's unsharded parameters included (those
    are the ones a compiled forward receives)."""
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    module_names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if hasattr(module, "_get_fsdp_state") else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            unsharded = getattr(fsdp_param, "_unsharded_param", None)  # made by the first all-gather
            if unsharded is not None:
                owner = module_names.get(id(fsdp_param._module_info.module))
                if owner is not None:
                    names[id(unsharded)] = f"{owner}.{fsdp_param._module_info.param_name}".lstrip(".")
    return names


def locate(params: list[torch.Tensor]) -> tuple[Fp8State, str] | None:
    """The state of the prepared model that holds `params`, and the FQN prefix of the module
    instance they all live in ("blocks.1." when one block is compiled alone, "" for a whole
    model)."""
    for model in list(_PREPARED):
        names = _parameter_names(model)
        fqns = [names[id(p)] for p in params if id(p) in names]
        if fqns:
            paths = [name.split(".")[:-1] for name in fqns]
            common = paths[0]
            for path in paths[1:]:
                common = common[: next((i for i, (a, b) in enumerate(zip(common, path)) if a != b), min(len(common), len(path)))]
            return model.__dict__[STATE_ATTR], "".join(f"{part}." for part in common)
    return None


def instance_keys(keys: list[str], prefix: str) -> list[str]:
    """State keys for one module instance. A graph compiled from one block names its sites
    relative to the block ("qkv"), and dynamo runs the same graph for every block: the keys get
    the instance's prefix, so each block keeps its own scales. Whole-model graphs already name
    sites by full FQN (some start with the prefix) and keep their keys."""
    if not prefix or any(key.startswith(prefix) for key in keys):
        return list(keys)
    return [prefix + key for key in keys]


class StateInstance:
    """The states one module instance's graphs read (`fp8fx.ops.delayed`): the model's `Fp8State`
    and the name each graph key has for this instance (`instance_keys`). Looked up by name on every
    call, so a `load_state_dict(assign=True)` is picked up too."""

    def __init__(self, owner: Fp8State, names: dict[str, str]):
        self.owner, self.names = owner, names

    def state(self, key: str) -> DelayedScalingState:
        found = self.owner.get(self.names[key]) if key in self.names else None
        if found is None:
            raise RuntimeError(
                f"fp8fx: the model has no delayed-scaling state {self.names.get(key, key)!r} for this graph's key {key!r}"
            )
        return found


def state_for(params: list[torch.Tensor]) -> Fp8State | None:
    """The state of the prepared model whose parameters these are."""
    found = locate(params)
    return found[0] if found is not None else None
