"""fp8fx under Lightning: one callback.

    trainer = lightning.Trainer(callbacks=[Fp8fxCallback(policy="policy.yaml", monitor_every=10)])
    trainer.fit(module, datamodule)

What is compiled: the LightningModule itself, in place (`module.compile(backend=...)`, so it
keeps its class, its hooks and its `state_dict` keys). That compiles its `forward`: the matrix
products of whatever `training_step` (and the validation, test and predict steps) compute
through `self(...)` run in FP8; a submodule called directly (`self.encoder(x)`) bypasses the
compiled forward and stays in high precision, which the callback warns about when the first
training step compiled no training graph. (Lightning's own route, `trainer.fit(torch.compile(
module))`, also compiles `training_step`, which fails in Dynamo as soon as it calls `self.log`
(torch 2.13, Lightning 2.6).)
A module already compiled with fp8fx, in place or one of its submodules, keeps that backend.

The callback, in `setup`, gives the module a place for delayed-scaling state (`fp8fx.prepare`),
so the scales ride in every checkpoint's `state_dict` and `trainer.fit(ckpt_path=...)` resumes
them (the sanity check's validation batches, which Lightning runs again on resume, leave them as
they were); through the Trainer's loggers (`log_metrics` of each, any Lightning logger) it logs the
report summary once after the first training step, then every `log_every_n_steps` optimizer
steps (the Trainer's by default) what the monitor sampled since, per FP8 cast; on every
checkpoint it stores the full report in the checkpoint under `fp8fx_report` and writes it as
`fp8fx_report.json` in each `ModelCheckpoint`'s directory. Metrics are logged at Lightning's
step index (the step just done, counted from 0), so they line up with the module's own logs.
"""

from __future__ import annotations

import json
import os
import warnings
import weakref
from typing import Any

import torch

from fp8fx.compiler.backend import backend as make_backend
from fp8fx.compiler.backend import report as compiled_report
from fp8fx.compiler.prepare import prepare
from fp8fx.compiler.state import BUFFERS, STATE_ATTR, DelayedScalingState
from fp8fx.core.policy import Policy
from fp8fx.integrations import MonitorLog, find_backend, require, save_report, summary_metrics
from fp8fx.reporting.records import Report

lightning = require("lightning", "2.4", "lightning")

CHECKPOINT_KEY = "fp8fx_report"

# Modules a callback compiled: module -> ((policy, inner, monitor_every), backend). A later
# callback with the same settings (a second Trainer on the same module) reuses the backend.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _states(pl_module: Any) -> list:
    """The fp8fx delayed-scaling states of the module and its submodules (fp8fx.prepare)."""
    return [module.__dict__[STATE_ATTR] for module in pl_module.modules() if STATE_ATTR in module.__dict__]


def _is_compiled(module: Any) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None or isinstance(module, torch._dynamo.OptimizedModule)


def _fp8fx_compiled(pl_module: Any) -> tuple[Any, Any] | None:
    """(backend, what fp8fx.report takes) when the user compiled the module, or submodules of it,
    with fp8fx; None when nothing is; an error when something is compiled with another backend."""
    found = []  # (backend, compiled object)
    if find_backend(pl_module) is not None:  # module.compile(backend=...)
        found.append((find_backend(pl_module), pl_module))
    elif getattr(pl_module, "_compiler_ctx", None):  # trainer.fit(torch.compile(module, backend=...))
        backend = find_backend(pl_module.forward)
        if backend is None:
            raise ValueError(
                "fp8fx Fp8fxCallback: the LightningModule is compiled with another backend; pass it uncompiled, the "
                "callback compiles it with fp8fx"
            )
        found.append((backend, backend))
    elif _is_compiled(pl_module):
        raise ValueError(
            "fp8fx Fp8fxCallback: the LightningModule is compiled with another backend; drop that compile, the "
            "callback compiles it with fp8fx"
        )
    else:
        for name, module in pl_module.named_modules():
            if module is not pl_module and _is_compiled(module):
                backend = find_backend(module)
                if backend is None:
                    raise ValueError(
                        f"fp8fx Fp8fxCallback: submodule {name!r} is compiled with another backend; drop that "
                        "compile or use backend=fp8fx.backend(...)"
                    )
                found.append((backend, module))
    if not found:
        return None
    backends = {id(backend) for backend, _ in found}
    if len(backends) > 1:
        raise ValueError(
            "fp8fx Fp8fxCallback: submodules are compiled with several fp8fx backends; compile them with one fp8fx.backend(...)"
        )
    backend = found[0][0]
    return backend, found[0][1] if len(found) == 1 else backend


class Fp8fxCallback(lightning.pytorch.Callback):
    """Train a LightningModule with fp8fx: compiles it in place with `fp8fx.backend(policy, inner,
    monitor_every)` in `setup` (or keeps the fp8fx backend it was compiled with, then `policy`
    and `monitor_every` must be left unset), logs the report summary and monitor statistics
    through the Trainer's loggers and stores the report with each checkpoint.
    `log_every_n_steps`: how often the monitor's statistics are logged, in optimizer steps
    (None: the Trainer's `log_every_n_steps`)."""

    def __init__(
        self,
        policy: Policy | str | os.PathLike | None = None,
        inner: str = "inductor",
        monitor_every: int = 0,
        log_every_n_steps: int | None = None,
    ):
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(
                f"fp8fx Fp8fxCallback: log_every_n_steps must be a positive integer or None, got {log_every_n_steps!r}"
            )
        self.policy = policy
        self.inner = inner
        self.monitor_every = monitor_every
        self.log_every_n_steps = log_every_n_steps
        self.backend: Any = None
        self.compiled: Any = None  # what fp8fx.report takes: the module, a submodule or the backend
        self._module: Any = None
        self._monitor: MonitorLog | None = None
        self._summary_logged = False
        self._last_step = -1
        self._before_sanity: list = []

    # -- compile -------------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._module is pl_module and self.backend is not None:
            return
        settings = (self.policy, self.inner, self.monitor_every)
        mine = _COMPILED.get(pl_module)
        ours = mine is not None and find_backend(pl_module) is mine[1]  # compiled by a callback
        found = None if ours else _fp8fx_compiled(pl_module)
        if ours and mine[0] == settings:
            self.backend, self.compiled = mine[1], pl_module
        elif found is not None:
            if self.policy is not None or self.monitor_every:
                raise ValueError(
                    "fp8fx Fp8fxCallback: the LightningModule is already compiled with fp8fx; give the policy and "
                    "monitor_every to that fp8fx.backend(...)"
                )
            self.backend, self.compiled = found
        else:
            self.backend = make_backend(policy=self.policy, inner=self.inner, monitor_every=self.monitor_every)
            pl_module.compile(backend=self.backend)
            self.compiled = pl_module
            _COMPILED[pl_module] = (settings, self.backend)
        if not _states(pl_module):
            prepare(pl_module)  # before the checkpoint is restored and before the first compile
        self._module = pl_module
        self._monitor = MonitorLog(self.backend.monitor) if self.backend.monitor is not None else None

    def report(self) -> Report:
        """The report of the module this callback trains."""
        if self.compiled is None:
            raise RuntimeError("fp8fx Fp8fxCallback: no module yet; the report exists once the Trainer has called setup")
        return compiled_report(self.compiled)

    # -- logging -------------------------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:  # after a checkpoint's loops are restored
        self._summary_logged = False
        self._last_step = trainer.global_step - 1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step - 1 <= self._last_step:  # accumulating gradients: no optimizer step yet
            return
        step = self._last_step = trainer.global_step - 1
        metrics = {}
        if not self._summary_logged:
            self._summary_logged = True
            report = self.report()
            if not any(op.graph_kind == "training" for op in [*report.ops, *report.superseded]):
                warnings.warn(
                    "fp8fx Fp8fxCallback: the first training step ran no matrix product through the compiled LightningModule; "
                    "call self(...) in training_step (a submodule called directly is not compiled)"
                )
            metrics.update(summary_metrics(report))
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if self._monitor is not None and (step + 1) % every == 0:
            metrics.update(self._monitor.metrics())
        self._log(trainer, metrics, step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._monitor is not None:  # samples taken since the last logged step
            self._log(trainer, self._monitor.metrics(), trainer.global_step - 1)

    @staticmethod
    def _log(trainer: Any, metrics: dict[str, float], step: int) -> None:
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    # -- the sanity check ----------------------------------------------------------------------

    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        self._before_sanity = [
            (state, {name: [t.clone() for t in s.tensors()] for name, s in state.states.items()}, dict(state._pending))
            for state in _states(pl_module)
        ]

    def on_sanity_check_end(self, trainer: Any, pl_module: Any) -> None:
        """Put the delayed-scaling state back as it was before the sanity check's validation
        batches: Lightning runs them again when a run resumes, and they would move the scales."""
        for state, saved, pending in self._before_sanity:
            for name, s in state.states.items():
                # A state the sanity check made: the checkpoint's values it took, or a new state's.
                initial = saved.get(name) or DelayedScalingState(s.amax_history.numel()).tensors()
                for buf, tensor, value in zip(BUFFERS, s.tensors(), initial):
                    tensor.copy_(value if name in saved else pending.get(f"states.{name}.{buf}", value))
        self._before_sanity = []

    # -- checkpoints ---------------------------------------------------------------------------

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.compiled is None:
            return
        report = self.report()
        checkpoint[CHECKPOINT_KEY] = json.loads(report.to_json(indent=None))
        if trainer.is_global_zero:
            for directory in {cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}:
                save_report(report, directory)
