"""A few training steps of fp8fx's demo transformer, compiled with fp8fx, through Accelerate or
without it; writes each rank's losses as JSON. Run by tests/integrations/test_integration_accelerate.py:

    python accelerate_train.py --mode plain OUT          # one process, no Accelerate
    python accelerate_train.py --mode accelerate OUT     # Accelerator(cpu=True), one process
    accelerate launch --cpu --num_processes 2 accelerate_train.py --mode accelerate OUT
    torchrun --nproc_per_node 2 accelerate_train.py --mode ddp OUT     # the same run without Accelerate

Each rank draws its own batches from a generator seeded by its rank, so a run with and without
Accelerate sees the same data on the same rank.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os

import torch
import torch.distributed as dist

import fp8fx
from fp8fx.tools.demo import TinyTransformer

STEPS = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["plain", "accelerate", "ddp"], required=True)
    parser.add_argument("out")
    args = parser.parse_args()
    # A run takes seconds: one still going after 90 s is stuck, and says where before it exits.
    faulthandler.dump_traceback_later(90, exit=True)

    torch.manual_seed(0)
    model = TinyTransformer(dim=64, heads=4, layers=1, max_seq=32)
    model.compile(backend=fp8fx.backend(inner="eager"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank, train = 0, model
    backward = torch.Tensor.backward
    if args.mode == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        train, optimizer = accelerator.prepare(model, optimizer)
        rank, backward = accelerator.process_index, lambda loss: accelerator.backward(loss)
    elif args.mode == "ddp":
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        train = torch.nn.parallel.DistributedDataParallel(model)

    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (4, 32), generator=data)
        loss = train(tokens).float().logsumexp(-1).mean()
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    report = fp8fx.report(model)
    result = {"rank": rank, "losses": losses, "fp8_gemms": len(report.fp8_ops), "gemms": len(report.ops)}
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # Freeing this function's objects (DDP, Accelerate's state, gloo's) once the process group is
    # gone sometimes hangs in torch's C++ teardown: ranks stuck for minutes after the results
    # were written, with no Python frame but the call of main(). Nothing is left to do: leave.
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
