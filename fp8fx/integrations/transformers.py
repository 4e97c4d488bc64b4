"""fp8fx under the Hugging Face `Trainer`: one line after the Trainer is built.

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    fp8fx.integrations.transformers.enable(trainer, policy="policy.yaml", monitor_every=10)
    trainer.train()

`enable` compiles the Trainer's model in place with an fp8fx backend (`model.compile`, so the
model keeps its class and `save_pretrained` works as before), gives it a place for delayed-scaling
state (`fp8fx.prepare`, so checkpoints carry the scales and `resume_from_checkpoint` restores
them), and puts an `Fp8fxCallback` first among the Trainer's callbacks. On each of the Trainer's
log events the callback adds fp8fx's scalars to the logs: the report summary once (after the
first step), then what the monitor sampled since the last log, per FP8 cast. Being first, it adds
them before any `report_to` logger (TensorBoard, W&B, ...) writes the logs. The console gets the
summary only (`console="summary"`, the default: five scalars per cast and log event drown the
loss); a second callback, just before the Trainer's progress printer, takes the per-cast scalars
out of what it prints, after the loggers and `trainer_state.json` have them (`console="all"`
prints everything). On each checkpoint it saves the full report as `fp8fx_report.json` in the
checkpoint directory.

`TrainingArguments(torch_compile_backend="fp8fx")` cannot work: Accelerate's `TorchDynamoPlugin`
accepts only the names in its `DynamoBackend` enum and raises for any other. So `torch_compile`
stays off and `enable` compiles the model itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fp8fx.compiler.backend import backend as make_backend
from fp8fx.compiler.backend import report as compiled_report
from fp8fx.compiler.prepare import prepare
from fp8fx.core.policy import Policy
from fp8fx.integrations import MonitorLog, find_backend, require, save_report, summary_metrics

transformers = require("transformers", "4.50", "hf")


class Fp8fxCallback(transformers.TrainerCallback):
    """Adds fp8fx's report summary (once) and monitor statistics to the Trainer's logs and saves
    the report beside each checkpoint. Made by `enable`; it must come before the `report_to`
    callbacks, which write the logs they are handed."""

    def __init__(self, model: Any):
        self.model = model
        self.last_monitor_keys: list[str] = []  # the per-cast scalars added at the last log event
        self.backend = find_backend(model)
        if self.backend is None:
            raise ValueError(
                "fp8fx Fp8fxCallback: the model is not compiled with an fp8fx backend; use "
                "fp8fx.integrations.transformers.enable(trainer)"
            )
        self.monitor = MonitorLog(self.backend.monitor) if self.backend.monitor is not None else None
        self.summary_logged = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or state.global_step == 0:
            return
        added = {}
        if not self.summary_logged:
            added.update(summary_metrics(compiled_report(self.model)))
            self.summary_logged = True
        if self.monitor is not None:
            monitored = self.monitor.metrics()
            self.last_monitor_keys = list(monitored)
            added.update(monitored)
        logs.update(added)
        if state.log_history:  # the Trainer appended its copy of these logs before calling us
            state.log_history[-1].update(added)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            checkpoint = Path(args.output_dir) / f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            save_report(compiled_report(self.model), checkpoint)


class _ConsoleSummaryOnly(transformers.TrainerCallback):
    """Just before the Trainer's console printer: takes the per-cast scalars of the last log event
    out of the logs it prints (the loggers before it and `state.log_history` keep them)."""

    def __init__(self, logging: Fp8fxCallback):
        self.logging = logging

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key in self.logging.last_monitor_keys if logs is not None else ():
            logs.pop(key, None)


CONSOLE = ("summary", "all")


def enable(
    trainer: Any,
    policy: Policy | str | os.PathLike | None = None,
    inner: str = "inductor",
    monitor_every: int = 0,
    console: str = "summary",
    **backend_options: Any,
) -> Fp8fxCallback:
    """Train `trainer.model` with fp8fx: compile it in place with `fp8fx.backend(policy, inner,
    monitor_every, **backend_options)` (or keep the fp8fx backend it was compiled with), prepare
    its delayed-scaling state and add the logging callback. `console`: what the Trainer prints of
    fp8fx's scalars ("summary": the report summary, "all": the monitor's per-cast scalars too);
    its loggers and `trainer_state.json` get everything. Returns the callback."""
    if console not in CONSOLE:
        raise ValueError(f"fp8fx enable: console must be one of {', '.join(CONSOLE)}, got {console!r}")
    if getattr(trainer.args, "torch_compile", False):
        raise ValueError(
            "fp8fx enable: TrainingArguments.torch_compile is on, so Accelerate would compile the model again with "
            f"{trainer.args.torch_compile_backend!r}; leave torch_compile off, enable() compiles the model with fp8fx"
        )
    if any(isinstance(cb, Fp8fxCallback) for cb in trainer.callback_handler.callbacks):
        raise ValueError("fp8fx enable: this Trainer is already enabled")
    model = trainer.model
    if find_backend(model) is None:
        prepare(model)
        model.compile(backend=make_backend(policy=policy, inner=inner, monitor_every=monitor_every, **backend_options))
    elif policy is not None or backend_options or monitor_every:
        raise ValueError(
            "fp8fx enable: the model is already compiled with fp8fx; give the policy and options to that fp8fx.backend(...)"
        )
    callback = Fp8fxCallback(model)
    callbacks = trainer.callback_handler.callbacks
    callbacks.insert(0, callback)
    if console == "summary":
        printers = (transformers.trainer_callback.ProgressCallback, transformers.trainer_callback.PrinterCallback)
        at = next((i for i, cb in enumerate(callbacks) if isinstance(cb, printers)), None)
        if at is not None:
            callbacks.insert(at, _ConsoleSummaryOnly(callback))
    return callback
