"""fp8fx in torchtitan (0.3): a model converter that compiles each transformer block with fp8fx.

torchtitan 0.3 has no converter registry of names: a job's config is a Python function (a
`config_registry` entry picked with `--module/--config`) and converters are `Config` objects
listed in the model registry, as torchtitan's own Float8 converter is::

    from fp8fx.integrations.torchtitan import Fp8fxConverter
    config.model_spec = model_registry(
        "debugmodel", converters=[Fp8fxConverter.Config(policy="policy.yaml", inner="inductor")]
    )

The job config's one list of names is `override.imports`, so the converter is also registered
there under `fp8fx.integrations.torchtitan.fp8fx`, its options as the entry's keyword
arguments; any existing job selects it from the command line::

    --override.imports 'fp8fx.integrations.torchtitan.fp8fx={"policy": "policy.yaml"}'

(The override claims the whole model config, and torchtitan refuses two overrides on nested
nodes: next to another override inside the model, list `Fp8fxConverter.Config` instead.)

Why the converter swaps block classes rather than setting the compile backend: in torchtitan 0.3
a converter transforms the model *config* before anything is built (`convert(model_config)`), so
there is no module to compile yet, and it never sees `compile.backend`, a bare string that
torchtitan hands to `block.compile(backend=...)`. The string "fp8fx" names fp8fx's registered
backend, but a string carries no policy or inner compiler, and torchtitan refuses any backend
but "inductor" and "aot_eager" for FlexAttention models. So the converter does what torchtitan's
float8 MoE converter does: it replaces each transformer block's config (`TransformerBlock.Config`,
the modules torchtitan's `apply_compile` compiles one by one) with the config of a subclass of the
same block class whose constructor ends with `self.compile(backend=<the converter's fp8fx
backend>)`, one graph per block as torchtitan's compile (`fullgraph`). Compiled in place, a block
keeps its class's behaviour, its name, its parameters and its place under `model.layers`, so
activation checkpointing, FSDP2 and checkpoints see the model they expect. All blocks share one
backend and so one report (`report(model)`), with one graph per distinct block: Dynamo compiles
the first block and reuses the graph for the others, so sites are named inside the block
(`attention.wo`, `feed_forward.w2`) and a policy rule for one block (`layers.3.*`) never matches;
`fqns` leaves whole blocks out instead. The embedding, the final norm and `lm_head` are outside
the blocks and stay in high precision.

torchtitan's own compile must stay off for the model (`compile.enable` false, or "model" not in
`compile.components`; compiling the loss is fine). Without activation checkpointing its
`block.compile(backend=...)` call would keep the fp8fx backend (the block's `compile` always uses
it), but with activation checkpointing torchtitan compiles the checkpoint wrapper around each
block, and that outer compile traces the block itself, so fp8fx would never run. The converter
refuses `model_compile_enabled=True`; the override cannot see the compile settings, and
`report(model)` says when no block was compiled by fp8fx.

No `post_optimizer_build_fn` (torchtitan 0.3's hook after the optimizer is built, which replaced
the converters' `post_optimizer_hook`): fp8fx keeps nothing that an optimizer step makes stale.
Dynamic scales are computed inside each compiled step; delayed-scaling amax histories and scales
are updated inside the compiled graph (each block gets a place for them with `fp8fx.prepare`);
there is no FP8 weight copy to refresh after `optimizer.step()`, which is what torchao's float8
uses that hook for under FSDP. Delayed-scaling state is in the model's state dict from the first
step on, so torchtitan's checkpoints hold it. torchtitan's checkpointer loads only the keys the
model has, so to resume it call `create_states(model, batch_size, seq_len)` after the model has
its device and weights and before the checkpoint loads: each converted block's states are created
from a shape-only trace (`fp8fx.prepare` with example inputs). Without it a resumed job starts
the state afresh. The trace passes no attention masks: SDPA blocks, not FlexAttention ones.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from fp8fx.compiler.backend import INNER_COMPILERS, Fp8fxBackend
from fp8fx.compiler.backend import backend as make_backend
from fp8fx.compiler.backend import report as compiled_report
from fp8fx.compiler.prepare import prepare
from fp8fx.core.policy import Policy
from fp8fx.integrations import require
from fp8fx.reporting.records import Report

require("torchtitan", "0.3.0", "titan")

from torchtitan.components.quantization import QuantizationConverter
from torchtitan.config.override import override
from torchtitan.models.common.decoder import TransformerBlock
from torchtitan.protocols.model import BaseModel

__all__ = ["Fp8fxConverter", "backend_of", "create_states", "report"]  # and `fp8fx`, the override, named by its path

_block_classes: dict[type, type] = {}


def _fp8fx_block_class(block_class: type) -> type:
    """The subclass of `block_class` that compiles itself with fp8fx when built (one per class)."""
    if block_class in _block_classes:
        return _block_classes[block_class]

    class Fp8fxBlock(block_class):  # type: ignore[misc, valid-type]
        @dataclass(kw_only=True, slots=True)
        class Config(block_class.Config):  # type: ignore[misc, name-defined]
            # Private ("_"), like Float8Linear's `_torchao_config`: left out of the logged config.
            _fp8fx_backend: Fp8fxBackend | None = None
            _fp8fx_fullgraph: bool = True

        def __init__(self, config: Any):
            if config._fp8fx_backend is None:
                raise ValueError(
                    f"fp8fx: {type(self).__name__}.Config is made by Fp8fxConverter.convert, which gives it a backend"
                )
            super().__init__(config)
            self._fp8fx_backend = config._fp8fx_backend
            self._fp8fx_fullgraph = config._fp8fx_fullgraph
            if self._fp8fx_backend.policy.uses_delayed_scaling:
                prepare(self)
            self.compile()

        def compile(self, *args: Any, **kwargs: Any) -> None:
            """Compile in place with the converter's fp8fx backend, whatever backend the caller
            names (torchtitan's `apply_compile` passes `compile.backend`)."""
            kwargs["backend"] = self._fp8fx_backend
            kwargs.setdefault("fullgraph", self._fp8fx_fullgraph)
            super().compile(*args, **kwargs)

    Fp8fxBlock.__name__ = Fp8fxBlock.__qualname__ = f"Fp8fx{block_class.__name__}"
    Fp8fxBlock.Config.__qualname__ = f"Fp8fx{block_class.__name__}.Config"
    _block_classes[block_class] = Fp8fxBlock
    return Fp8fxBlock


class Fp8fxConverter(QuantizationConverter):
    """Compile every transformer block (`TransformerBlock.Config` in the model config) with one
    fp8fx backend. A quantization converter: torchtitan checks that it comes before LoRA."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        policy: str | None = None
        """Path of an fp8fx policy YAML file (None: fp8fx's defaults, or `recipe`)."""

        recipe: str | None = None
        """A named fp8fx recipe (tensorwise, rowwise, rowwise_gw_hp, blockwise, delayed, megatron)
        instead of a policy file."""

        inner: str = "inductor"
        """The compiler that runs the rewritten graphs: "inductor", or "eager" (CPU, debugging)."""

        fqns: list[str] = field(default_factory=list)
        """Globs of the blocks to convert (`layers.1`, `layers.[0-3]`); empty: every block."""

        fullgraph: bool = True
        """Compile each block as one graph, as torchtitan's own compile does."""

    def __init__(self, config: Config):
        self.config = config
        if config.model_compile_enabled:
            raise ValueError(
                "fp8fx converter: the fp8fx blocks compile themselves; turn torchtitan's model compile off "
                "(compile.enable false, or leave 'model' out of compile.components), since with activation "
                "checkpointing torchtitan would compile the checkpoint wrapper over them with compile.backend"
            )
        if config.inner not in INNER_COMPILERS:
            raise ValueError(f"fp8fx converter: inner must be one of {', '.join(INNER_COMPILERS)}, got {config.inner!r}")
        if config.policy is not None and config.recipe is not None:
            raise ValueError("fp8fx converter: give a policy file or a recipe, not both")
        policy = Policy.from_recipe(config.recipe) if config.recipe is not None else config.policy
        self.backend = make_backend(policy=policy, inner=config.inner)

    def convert(self, model_config: Any) -> Any:
        """Replace each selected transformer block config by its self-compiling subclass's, in
        place (the same root config is returned, which `override.imports` relies on: torchtitan's
        Trainer builds the model config object it held before applying overrides)."""
        converted = tuple(cls.Config for cls in _block_classes.values())
        found = False
        for fqn, block, parent, attr in model_config.traverse(TransformerBlock.Config):
            found = True
            if parent is None:
                raise ValueError(
                    "fp8fx converter: the config is a single transformer block; convert the model config that holds it"
                )
            if isinstance(block, converted):
                continue
            if self.config.fqns and not any(fnmatch.fnmatchcase(fqn, pattern) for pattern in self.config.fqns):
                continue
            owner = type(block)._owner
            if owner is None:
                raise ValueError(f"fp8fx converter: {type(block).__qualname__} at {fqn} has no module class to subclass")
            new_class = _fp8fx_block_class(owner).Config
            new = new_class(
                **{f.name: getattr(block, f.name) for f in fields(block) if f.init},
                _fp8fx_backend=self.backend,
                _fp8fx_fullgraph=self.config.fullgraph,
            )
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        if not found:
            raise ValueError(
                f"fp8fx converter: {type(model_config).__qualname__} has no transformer blocks "
                "(TransformerBlock.Config) to compile"
            )
        return model_config


@override(target=BaseModel.Config, description="fp8fx: compile each transformer block with an fp8fx backend")
def fp8fx(
    model_config: Any,
    *,
    policy: str | None = None,
    recipe: str | None = None,
    inner: str = "inductor",
    fqns: list[str] | None = None,
    fullgraph: bool = True,
) -> Any:
    """`--override.imports 'fp8fx.integrations.torchtitan.fp8fx={"policy": "p.yaml", "inner": "inductor"}'`:
    `Fp8fxConverter` applied to the job's model config, with these options."""
    config = Fp8fxConverter.Config(policy=policy, recipe=recipe, inner=inner, fqns=list(fqns or ()), fullgraph=fullgraph)
    return Fp8fxConverter(config).convert(model_config)


def backend_of(model: torch.nn.Module) -> Fp8fxBackend:
    """The fp8fx backend the converted blocks of `model` (or one model part) share."""
    found = {id(b): b for m in model.modules() if (b := getattr(m, "_fp8fx_backend", None)) is not None}
    if not found:
        raise ValueError(
            "fp8fx.integrations.torchtitan: the model has no fp8fx blocks; add Fp8fxConverter.Config() to its converters"
        )
    if len(found) > 1:
        raise ValueError(
            f"fp8fx.integrations.torchtitan: the model's blocks use {len(found)} fp8fx backends; report on each block"
        )
    return next(iter(found.values()))


def report(model: torch.nn.Module) -> Report:
    """The precision report of `model`'s fp8fx blocks (after the first forward and backward)."""
    backend = backend_of(model)
    if not backend.graphs:
        raise ValueError(
            "fp8fx.integrations.torchtitan: the fp8fx blocks have compiled no graph; run a forward first, "
            "and if one ran, another torch.compile traced the blocks instead "
            "(torchtitan's compile.enable with activation checkpointing): turn that off"
        )
    return compiled_report(backend)


def create_states(model: torch.nn.Module, batch_size: int, seq_len: int) -> None:
    """Create the delayed-scaling states of `model`'s fp8fx blocks now (before a checkpoint loads),
    from a shape-only trace of each block on `batch_size` sequences of `seq_len` tokens."""
    backend = backend_of(model)
    if not backend.policy.uses_delayed_scaling:
        return
    for block in model.modules():
        if getattr(block, "_fp8fx_backend", None) is backend:
            param = next(block.parameters())
            x = torch.empty(batch_size, seq_len, block.attention_norm.weight.shape[0], dtype=param.dtype, device=param.device)
            positions = torch.arange(seq_len, device=param.device).repeat(batch_size, 1)
            prepare(block, policy=backend, example_inputs=(x, None, positions))  # forward(x, attention_masks, positions)
