"""fp8fx.runtime.monitor.TensorBoardWriter: the event file, read back with TensorBoard's own reader, holds
exactly the Monitor's samples; and the Lightning callback's metrics reach a TensorBoardLogger."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8fx
from fp8fx.runtime.monitor import TensorBoardWriter

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

STATISTICS = ("amax", "scale", "saturated", "underflow", "non_finite")


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every scalar in `logdir`'s event files."""
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def expected_scalars(monitor) -> dict[str, list[tuple[int, float]]]:
    return {
        f"fp8fx/{key}/{name}": [(s.step, float(getattr(s, name))) for s in samples]
        for key, samples in monitor.samples.items()
        for name in STATISTICS
    }


class Model(nn.Module):
    """A linear layer and a functional matmul (its casts' keys hold `:` and `#`)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 64)
        self.out = nn.Parameter(torch.randn(64, 16) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x)) @ self.out


def batch(step: int) -> torch.Tensor:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
    if step == 0:
        x[:3, :5] = 1000.0  # saturates under the first delayed scale of 1
        x[0, 6] = 1e-5  # underflows
    if step == 2:
        x[1, 7] = float("inf")
    return x


def test_event_file_holds_the_monitor_samples(tmp_path):
    torch.manual_seed(0)
    model = fp8fx.prepare(Model())
    compiled = torch.compile(
        model, backend=fp8fx.backend(fp8fx.Policy.from_recipe("delayed", amax_history_len=4), inner="eager", monitor_every=1)
    )
    monitor = fp8fx.stats(compiled)
    writer = TensorBoardWriter(tmp_path)
    monitor.add_writer(writer)

    for step in range(2):
        compiled(batch(step)).sum().backward()
    writer.flush()  # what is written so far is readable while the writer stays open
    assert read_scalars(tmp_path) == expected_scalars(monitor)

    for step in range(2, 5):
        compiled(batch(step)).sum().backward()
    writer.close()
    scalars = read_scalars(tmp_path)
    assert scalars == expected_scalars(monitor)

    keys = sorted(monitor.samples)
    assert len(keys) == 6 and any(":" in key and "#" in key for key in keys), keys  # the tags keep these characters
    assert all(len(values) == 5 for values in scalars.values())
    first = monitor.series("proj.output.input")
    assert [s.step for s in first] == [0, 1, 2, 3, 4]
    x = batch(0)  # cast with scale 1: E4M3's smallest subnormal is 2**-9, half of it rounds to 0
    assert scalars["fp8fx/proj.output.input/saturated"][0] == (0, 15.0)
    assert scalars["fp8fx/proj.output.input/underflow"][0] == (0, float(((x != 0) & (x.abs() <= 2.0**-10)).sum()))
    assert [v for _, v in scalars["fp8fx/proj.output.input/non_finite"]] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert scalars["fp8fx/proj.output.input/amax"][0] == (0, 1000.0)


def test_lightning_callback_metrics_reach_a_tensorboard_logger(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch.loggers import TensorBoardLogger
    from test_integration_lightning import Fp8fxCallback, fit

    from fp8fx.integrations import summary_metrics

    logger = TensorBoardLogger(tmp_path)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"lightning\..*")
        module, _ = fit(tmp_path, Fp8fxCallback(inner="eager", monitor_every=1, log_every_n_steps=1), logger=logger, max_steps=4)
    scalars = read_scalars(logger.log_dir)

    for name, value in summary_metrics(fp8fx.report(module)).items():
        assert scalars[name] == [(0, value)]
    monitor = fp8fx.stats(module)
    assert len(monitor.samples) == 9
    for key, samples in monitor.samples.items():
        assert scalars[f"fp8fx/{key}/amax"] == [(s.step, s.amax) for s in samples]
        assert scalars[f"fp8fx/{key}/scale"] == [(s.step, s.scale) for s in samples]
        assert scalars[f"fp8fx/{key}/saturated"] == [(s.step, float(s.saturated)) for s in samples]
    assert [step for step, _ in scalars["train_loss"]] == [0, 1, 2, 3]
