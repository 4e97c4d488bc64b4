"""fp8fx under the Hugging Face Trainer, with the real `transformers` Trainer on CPU: the one-line
`enable`, the scalars it adds to the Trainer's logs (read back from TensorBoard's event file),
the report beside each checkpoint, and delayed-scaling state across `resume_from_checkpoint`."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import fp8fx
from fp8fx.integrations import REPORT_FILE, require

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from fp8fx.integrations.transformers import Fp8fxCallback, enable

transformers.logging.set_verbosity_error()
STEPS = 6


def dataset(n: int = 4 * STEPS, seq: int = 32) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(0, 256, (seq,), generator=g)), "labels": ids} for _ in range(n)]


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=256,
                                      max_position_embeddings=64)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def trainer(out, model=None, eval_dataset=None, **args) -> transformers.Trainer:
    defaults = {"max_steps": STEPS, "per_device_train_batch_size": 4, "logging_steps": 1, "save_steps": 3, "report_to": [], "use_cpu": True, "seed": 0,
                    "disable_tqdm": True, "learning_rate": 1e-3}  # fmt: skip
    training_args = transformers.TrainingArguments(str(out), **{**defaults, **args})
    return transformers.Trainer(model=model or llama(), args=training_args, train_dataset=dataset(), eval_dataset=eval_dataset)


def losses(t: transformers.Trainer) -> list[float]:
    return [h["loss"] for h in t.state.log_history if "loss" in h]


class StopAt(transformers.TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def test_trainer_logs_fp8fx_scalars_through_its_loggers_and_saves_the_report_with_checkpoints(tmp_path, monkeypatch, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plain = trainer(tmp_path / "plain")
    plain.train()
    capsys.readouterr()  # (the plain run's console)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    t = trainer(tmp_path / "fp8", report_to=["tensorboard"], logging_steps=2)
    callback = enable(t, inner="eager", monitor_every=2)
    t.train()

    assert t.callback_handler.callbacks[0] is callback  # before the TensorBoard callback, which writes what it is handed
    report = fp8fx.report(t.model)
    assert len(report.fp8_ops) == 3 * 7 + 3 and len(report.high_ops) == 2  # 7 projections + lm_head; sdpa fwd/bwd high
    per_step = losses(plain)  # logged every step; the FP8 run logs the mean of every two
    fp8_losses, plain_losses = losses(t), [(a + b) / 2 for a, b in zip(per_step[::2], per_step[1::2])]
    assert len(fp8_losses) == STEPS // 2 and all(math.isfinite(x) for x in fp8_losses)
    # Against the same Trainer run in fp32: measured within 0.022% over these steps.
    assert fp8_losses == pytest.approx(plain_losses, rel=2e-3)
    assert fp8_losses != plain_losses  # FP8 really ran

    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    tags = set(events.Tags()["scalars"])
    summary = report.summary()
    assert [e.value for e in events.Scalars("train/fp8fx/gemms")] == [summary["gemms"]]  # once, after the first step
    assert events.Scalars("train/fp8fx/fp8_flop_share_forward")[0].value == pytest.approx(summary["fp8_flop_share_forward"])
    monitor = fp8fx.stats(t.model)
    for key, samples in monitor.samples.items():
        amax = events.Scalars(f"train/fp8fx/{key}/amax")
        assert len(amax) == STEPS // 2  # one value per log event (each after new samples)
        assert amax[-1].value == pytest.approx(samples[-1].amax)
        assert {f"train/fp8fx/{key}/{name}" for name in ("scale", "saturated", "underflow", "non_finite")} <= tags
    logged = next(h for h in t.state.log_history if "fp8fx/gemms" in h)  # in trainer_state.json too
    assert logged["step"] == 2
    assert sum(f"fp8fx/{key}/amax" in h for h in t.state.log_history for key in monitor.samples) == len(monitor.samples) * STEPS // 2
    # The console (the Trainer's printer) shows the summary once and no per-cast scalar.
    printed = capsys.readouterr().out
    assert printed.count("'fp8fx/gemms'") == 1 and printed.count("'loss'") == STEPS // 2
    assert "/amax'" not in printed and "/saturated'" not in printed

    for step in (3, 6):
        saved = json.loads((tmp_path / "fp8" / f"checkpoint-{step}" / REPORT_FILE).read_text())
        assert saved["summary"]["gemms"] == summary["gemms"] and len(saved["ops"]) == len(report.history)


def test_console_all_prints_the_per_cast_scalars(tmp_path, capsys):
    t = trainer(tmp_path / "fp8", max_steps=2, logging_steps=2, save_steps=10)
    with pytest.raises(ValueError, match="console must be one of summary, all, got 'quiet'"):
        enable(t, inner="eager", monitor_every=2, console="quiet")
    enable(t, inner="eager", monitor_every=2, console="all")
    t.train()
    printed = capsys.readouterr().out
    keys = fp8fx.stats(t.model).samples
    assert keys and all(f"'fp8fx/{key}/amax'" in printed for key in keys)


def test_evaluation_leaves_delayed_scaling_alone(tmp_path):
    """The Trainer's evaluation loop (no grad, eval mode) reads the delayed scales and does not
    update them: training with an evaluation every 2 steps gives the losses of training without."""

    def run(out, **args):
        torch._dynamo.reset()
        t = trainer(out, save_steps=100, **args)
        enable(t, policy=fp8fx.Policy.from_recipe("delayed", amax_history_len=4), inner="eager")
        t.train()
        return t

    evaluated = run(tmp_path / "eval", eval_strategy="steps", eval_steps=2, eval_dataset=dataset(8))
    plain = run(tmp_path / "plain")
    assert sum("eval_loss" in h for h in evaluated.state.log_history) == STEPS // 2
    assert losses(evaluated) == losses(plain)


@pytest.mark.slow
def test_delayed_scaling_state_survives_checkpoint_and_resume(tmp_path):
    from safetensors.torch import load_file, save_file

    policy = tmp_path / "policy.yaml"  # the policy as users give it: a YAML path
    policy.write_text("version: 1\nrecipe: delayed\ndefaults: {amax_history_len: 4}\n")

    def run(out, stop=None, resume=None):
        torch._dynamo.reset()
        t = trainer(out, save_steps=3)
        enable(t, policy=policy, inner="eager")
        if stop:
            t.add_callback(StopAt(stop))
        t.train(resume_from_checkpoint=resume)
        return losses(t)

    uninterrupted = run(tmp_path / "a")
    first = run(tmp_path / "b", stop=3)
    checkpoint = tmp_path / "b" / "checkpoint-3"
    weights = load_file(checkpoint / "model.safetensors")
    assert any(k.startswith("fp8fx_state.") for k in weights)  # the scales travel in the checkpoint
    resumed = run(tmp_path / "b", resume=str(checkpoint))
    assert first == uninterrupted[:3] and resumed == uninterrupted

    # Without the state the resumed run starts from fresh scales and its losses differ: the
    # state, not luck, is what made them equal.
    save_file(
        {k: v for k, v in weights.items() if not k.startswith("fp8fx_state.")},
        checkpoint / "model.safetensors",
        metadata={"format": "pt"},
    )
    assert run(tmp_path / "b", resume=str(checkpoint)) != uninterrupted


def test_enable_refuses_what_cannot_work(tmp_path):
    with pytest.raises(ValueError, match=r"torch_compile is on.*leave torch_compile off") as e:
        enable(trainer(tmp_path, torch_compile=True, torch_compile_backend="aot_eager"))
    assert "\n" not in str(e.value)
    t = trainer(tmp_path)
    enable(t, inner="eager")
    with pytest.raises(ValueError, match="already enabled"):
        enable(t)
    with pytest.raises(ValueError, match="not compiled with an fp8fx backend"):
        Fp8fxCallback(llama())


def test_a_model_compiled_with_fp8fx_before_the_trainer_keeps_its_backend(tmp_path):
    model = llama()
    backend = fp8fx.backend(inner="eager")
    model.compile(backend=backend)
    t = trainer(tmp_path, model=model, max_steps=1)
    callback = enable(t)
    t.train()
    assert callback.backend is backend and len(fp8fx.report(model).fp8_ops) == 24
    with pytest.raises(ValueError, match="already compiled with fp8fx"):
        enable(trainer(tmp_path, model=model), policy="policy.yaml")


def test_accelerate_rejects_a_backend_name_outside_its_enum(tmp_path):
    """Why `enable` exists: the README says TrainingArguments(torch_compile_backend="fp8fx") fails
    inside Accelerate; this fails the day Accelerate accepts registered backends."""
    with pytest.raises(ValueError, match="not a valid DynamoBackend"):
        trainer(tmp_path, torch_compile_backend="fp8fx")


def test_integrations_import_nothing_at_import_fp8fx_and_say_what_to_install():
    code = "import sys, fp8fx; print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning', 'torchtitan') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert out == "[]"
    with pytest.raises(
        ImportError, match=r"^fp8fx.integrations: torch 2\.\d+\.\d+\S* is too old, fp8fx needs >= 99; pip install 'fp8fx\[x\]'$"
    ):
        require("torch", "99", "x")
    with pytest.raises(ImportError, match=r"no_such_package is not installed; pip install 'fp8fx\[hf\]'"):
        require("no_such_package", "1.0", "hf")
