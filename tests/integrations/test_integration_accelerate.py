"""A model compiled with fp8fx through Accelerate's `prepare`, with the real Accelerate: in one
process, and on 2 gloo processes started by `accelerate launch` (DistributedDataParallel), each
against the same run without Accelerate (tests/assets/accelerate_train.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
SCRIPT = Path(__file__).parents[1] / "assets" / "accelerate_train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(launcher: list[str], mode: str, out: Path, ranks: int = 1) -> list[dict]:
    """Each run takes about 6 s here: a run that takes 120 s hangs, and its output says where."""
    command = [*launcher, str(SCRIPT), "--mode", mode, str(out)]
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{mode} hung; its output:\n{e.stdout}\n{e.stderr}"[-3000:]) from None
    assert done.returncode == 0, done.stderr[-8000:]  # a stuck rank's stack dump comes before the launcher's summary
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(ranks)]


def test_accelerator_prepare_trains_an_fp8fx_model_as_without_accelerate(tmp_path):
    (plain,) = run([sys.executable], "plain", tmp_path / "plain")
    (accelerated,) = run([sys.executable], "accelerate", tmp_path / "accelerate")
    assert accelerated["losses"] == plain["losses"]
    assert (accelerated["fp8_gemms"], accelerated["gemms"]) == (plain["fp8_gemms"], plain["gemms"]) == (15, 21)


@pytest.mark.slow
def test_accelerate_launch_on_two_gloo_processes_equals_torchrun_ddp(tmp_path):
    """`accelerate launch` with 2 processes and no GPU runs Accelerate's MULTI_CPU mode: gloo and
    DistributedDataParallel. Its FSDP plugin needs GPUs: on CPU Accelerate wraps in DDP instead."""
    # The port is drawn just before its launch (one drawn earlier can be taken by then);
    # torchrun --standalone binds a free one itself.
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]  # fmt: skip
    accelerated = run(accelerate, "accelerate", tmp_path / "accelerate", ranks=2)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    ddp = run(torchrun, "ddp", tmp_path / "ddp", ranks=2)
    (single,) = run([sys.executable], "plain", tmp_path / "plain")

    assert [r["losses"] for r in accelerated] == [r["losses"] for r in ddp]
    assert all(r["fp8_gemms"] == 15 for r in accelerated)
    # Rank 0 sees the single process's data; from step 2 its weights carry rank 1's gradients too.
    assert accelerated[0]["losses"][0] == single["losses"][0] and accelerated[0]["losses"][1:] != single["losses"][1:]
