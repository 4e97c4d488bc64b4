"""fp8fx under Lightning (fp8fx.integrations.lightning.Fp8fxCallback): real `lightning.Trainer`
runs on CPU - what the callback compiles, what it logs through a CSVLogger (read back), the report
it stores with checkpoints, losses against the same run without fp8fx, and delayed-scaling state
resumed exactly by `trainer.fit(ckpt_path=...)`."""

from __future__ import annotations

import csv
import json
import logging
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fp8fx
from fp8fx.integrations import REPORT_FILE, summary_metrics

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from fp8fx.integrations.lightning import CHECKPOINT_KEY, Fp8fxCallback

STEPS_PER_EPOCH = 10
DELAYED = fp8fx.Policy.from_recipe("delayed", amax_history_len=8)


@pytest.fixture(autouse=True)
def _quiet_lightning():
    # Lightning's notes on a tiny CPU run (few workers, no GPU, ...) say nothing about fp8fx.
    level = logging.getLogger("lightning.pytorch").level
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"lightning\..*")
        yield
    logging.getLogger("lightning.pytorch").setLevel(level)


class Classifier(L.LightningModule):
    """A three-layer MLP (all dimensions multiples of 16: every GEMM can be FP8) that records its
    losses; `direct=True` calls the network from training_step without going through forward."""

    def __init__(self, direct: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
        self.direct = direct
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x) if self.direct else self(x), y)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("val_loss", loss)
        self.val_losses.append(loss.item())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def loaders() -> tuple[DataLoader, DataLoader]:
    """A learnable task (the class is the argmax of a fixed projection): 10 training batches of 8
    per epoch, 2 validation batches; fixed order."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 32, generator=gen)
    y = (x @ torch.randn(32, 16, generator=gen)).argmax(1)
    return DataLoader(TensorDataset(x[:80], y[:80]), batch_size=8), DataLoader(TensorDataset(x[80:], y[80:]), batch_size=8)


def fit(
    root: Path,
    *callbacks,
    epochs: int = 1,
    val: bool = False,
    checkpoints: bool = False,
    ckpt_path=None,
    module=None,
    **trainer_kw,
):
    """One `Trainer.fit` from a fresh Dynamo and a seeded module; returns (the LightningModule, trainer)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = module if module is not None else Classifier()
    callbacks = list(callbacks)
    if checkpoints:
        callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1, every_n_epochs=1))
    trainer_kw.setdefault("logger", False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=checkpoints,
        callbacks=callbacks,
        default_root_dir=root,
        log_every_n_steps=1,
        **trainer_kw,
    )
    train, validation = loaders()
    trainer.fit(module, train, validation if val else None, ckpt_path=ckpt_path)
    return trainer.lightning_module, trainer


def logged(path: Path) -> dict[int, dict[str, float]]:
    """CSVLogger's metrics.csv as {step: {metric: value}} (one step spans several rows)."""
    out: dict[int, dict[str, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row.pop("step"))
            out.setdefault(step, {}).update({k: float(v) for k, v in row.items() if v != ""})
    return out


def test_compiles_the_module_in_place_and_logs_summary_and_monitor(tmp_path):
    callback = Fp8fxCallback(inner="eager", monitor_every=1, log_every_n_steps=2)
    logger = CSVLogger(tmp_path)
    module, _ = fit(tmp_path, callback, logger=logger)

    assert type(module) is Classifier and fp8fx.integrations.find_backend(module) is callback.backend
    report = fp8fx.report(module)
    assert [(op.site, op.role) for op in report.fp8_ops] == [
        ("net.0", "output"),
        ("net.0", "grad_weight"),
        ("net.2", "output"),
        ("net.2", "grad_input"),
        ("net.2", "grad_weight"),
        ("net.4", "output"),
        ("net.4", "grad_input"),
        ("net.4", "grad_weight"),
    ]
    assert report.high_ops == [] and report.summary()["graphs"] == 1

    rows = logged(Path(logger.log_dir) / "metrics.csv")
    assert sorted(rows) == list(range(STEPS_PER_EPOCH))
    assert all("train_loss" in row for row in rows.values())  # the module's own logs, same steps
    # The summary once, at the first step, equal to the report's.
    summary = summary_metrics(report)
    assert summary["fp8fx/fp8_gemms"] == 8.0
    assert {k: rows[0][k] for k in summary} == summary
    assert not any(k in row for k in summary for step, row in rows.items() if step)
    # The monitor every second step: each cast's newest sample, counts summed since the last log.
    monitor = fp8fx.stats(module)
    keys = sorted(monitor.samples)
    assert keys == [  # one cast per tensor, named after the first GEMM operand that uses it
        "net.0.grad_weight.grad_output",
        "net.0.output.input",
        "net.0.output.weight",
        "net.2.grad_input.grad_output",
        "net.2.output.input",
        "net.2.output.weight",
        "net.4.grad_input.grad_output",
        "net.4.output.input",
        "net.4.output.weight",
    ]
    for step, row in rows.items():
        fp8_keys = {k for k in row if k.startswith("fp8fx/") and k not in summary}
        if step % 2 == 0:
            assert fp8_keys == set()
            continue
        assert fp8_keys == {
            f"fp8fx/{key}/{name}" for key in keys for name in ("amax", "scale", "saturated", "underflow", "non_finite")
        }
        for key in keys:
            series = monitor.series(key)
            assert row[f"fp8fx/{key}/amax"] == series[step].amax and row[f"fp8fx/{key}/scale"] == series[step].scale
            assert row[f"fp8fx/{key}/underflow"] == series[step - 1].underflow + series[step].underflow
            assert row[f"fp8fx/{key}/non_finite"] == 0.0


def test_losses_match_the_run_without_fp8fx(tmp_path):
    plain, _ = fit(tmp_path / "plain", epochs=2)
    tensorwise, _ = fit(tmp_path / "tensorwise", Fp8fxCallback(inner="eager"), epochs=2)
    delayed, _ = fit(tmp_path / "delayed", Fp8fxCallback(policy=DELAYED, inner="eager"), epochs=2)
    assert len(plain.losses) == 2 * STEPS_PER_EPOCH
    assert plain.losses[-1] < plain.losses[0] - 0.2  # it learns
    # Measured over these 20 steps: at most 1.7e-3 (tensorwise) and 2.6e-3 (delayed) relative, 7e-4
    # and 9e-4 on average.
    for run in (tensorwise, delayed):
        assert run.losses != plain.losses
        assert max(abs(a - b) / b for a, b in zip(run.losses, plain.losses)) < 5e-3


def test_delayed_scaling_resumes_exactly_from_a_checkpoint(tmp_path):
    straight, _ = fit(tmp_path / "straight", Fp8fxCallback(policy=DELAYED, inner="eager"), epochs=2, val=True, checkpoints=True)
    ckpt_dir = tmp_path / "straight" / "ckpt"
    first = ckpt_dir / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"
    ckpt = torch.load(first, weights_only=True)
    state_keys = [k for k in ckpt["state_dict"] if k.startswith("fp8fx_state.")]
    assert len(state_keys) == 4 * 9  # 9 casts: history, scale, steps, non-finite count each
    # The report rides in the checkpoint and beside it.
    ops = ckpt[CHECKPOINT_KEY]["ops"]
    assert len(ops) == 3 + 8 and all(
        op["precision"] == "fp8" and op["scaling"] == "delayed" for op in ops
    )  # inference + training graph
    assert json.loads((ckpt_dir / REPORT_FILE).read_text())["summary"]["fp8_gemms"] == 11

    resumed, _ = fit(
        tmp_path / "resumed", Fp8fxCallback(policy=DELAYED, inner="eager"), epochs=2, val=True, checkpoints=True, ckpt_path=first
    )
    assert resumed.losses == straight.losses[STEPS_PER_EPOCH:]
    assert resumed.val_losses[-2:] == straight.val_losses[-2:]
    assert all(math.isfinite(v) for v in straight.losses)
    final = torch.load(ckpt_dir / f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(resumed.state_dict()[k], final[k]) for k in state_keys)

    # Without its scales the same checkpoint resumes differently: the state is what carries them.
    del_state = {**ckpt, "state_dict": {k: v for k, v in ckpt["state_dict"].items() if k not in state_keys}}
    torch.save(del_state, tmp_path / "no_state.ckpt")
    without, _ = fit(
        tmp_path / "without",
        Fp8fxCallback(policy=DELAYED, inner="eager"),
        epochs=2,
        val=True,
        ckpt_path=tmp_path / "no_state.ckpt",
    )
    assert without.losses != straight.losses[STEPS_PER_EPOCH:]


def test_validation_leaves_delayed_scaling_alone(tmp_path):
    """Validation (and the sanity check before training) casts with the delayed scales and does
    not update them: a run that validates every epoch trains exactly as one that never does."""
    validated, _ = fit(tmp_path / "val", Fp8fxCallback(policy=DELAYED, inner="eager"), epochs=2, val=True)
    plain, _ = fit(tmp_path / "plain", Fp8fxCallback(policy=DELAYED, inner="eager"), epochs=2)
    assert len(validated.val_losses) == 2 + 2 * 2 and validated.losses == plain.losses


def test_a_second_trainer_on_the_same_module(tmp_path):
    first = Fp8fxCallback(inner="eager", monitor_every=1)
    module, _ = fit(tmp_path / "first", first, max_steps=2)
    same = Fp8fxCallback(inner="eager", monitor_every=1)
    fit(tmp_path / "same", same, module=module, max_steps=2)
    assert same.backend is first.backend and fp8fx.integrations.find_backend(module) is first.backend
    other = Fp8fxCallback(policy=DELAYED, inner="eager")  # other settings: compiled again with them
    fit(tmp_path / "other", other, module=module, max_steps=2)
    assert other.backend is not first.backend and fp8fx.integrations.find_backend(module) is other.backend
    assert {op.scaling for op in other.report().ops} == {"delayed"}


def test_a_module_compiled_with_fp8fx_keeps_its_backend(tmp_path):
    module = Classifier()
    backend = fp8fx.backend(inner="eager", monitor_every=1)
    module.compile(backend=backend)
    callback = Fp8fxCallback()
    fit(tmp_path, callback, module=module)
    assert callback.backend is backend and len(callback.report().fp8_ops) == 8
    assert fp8fx.stats(module).samples

    with pytest.raises(ValueError, match=r"already compiled with fp8fx; give the policy and monitor_every to that fp8fx.backend"):
        fit(tmp_path / "again", Fp8fxCallback(monitor_every=1), module=module)


class Unlogged(Classifier):
    def training_step(self, batch, batch_idx):  # Lightning's compile route fails in Dynamo on self.log
        x, y = batch
        return F.cross_entropy(self(x), y)


def test_lightnings_own_compile_route_keeps_its_backend(tmp_path):
    backend = fp8fx.backend(inner="eager")
    callback = Fp8fxCallback()
    module, _ = fit(tmp_path, callback, module=torch.compile(Unlogged(), backend=backend), max_steps=2)
    assert type(module) is Unlogged and module._compiler_ctx is not None  # trainer.fit unwrapped it
    assert callback.backend is backend and len(callback.report().fp8_ops) == 8


def test_a_submodule_compiled_with_fp8fx_is_reported(tmp_path):
    module = Classifier()
    module.net = torch.compile(module.net, backend=fp8fx.backend(inner="eager"))
    callback = Fp8fxCallback()
    fit(tmp_path, callback, module=module)
    assert callback.compiled is module.net and len(callback.report().fp8_ops) == 8


def test_a_module_compiled_with_another_backend_is_refused(tmp_path):
    module = Classifier()
    module.compile(backend="eager")
    with pytest.raises(ValueError, match="compiled with another backend"):
        fit(tmp_path, Fp8fxCallback(inner="eager"), module=module)


def test_calling_a_submodule_directly_warns(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", module=r"lightning\..*")
        fit(tmp_path, Fp8fxCallback(inner="eager"), module=Classifier(direct=True), max_steps=1)
    (warning,) = [w for w in caught if "fp8fx" in str(w.message)]  # one, saying what to change
    assert str(warning.message).startswith(
        "fp8fx Fp8fxCallback: the first training step ran no matrix product through the compiled"
    )
    assert "call self(...) in training_step" in str(warning.message)


def test_log_every_n_steps_is_checked():
    with pytest.raises(ValueError, match="log_every_n_steps must be a positive integer"):
        Fp8fxCallback(log_every_n_steps=0)
