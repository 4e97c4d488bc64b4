"""Distributed: bytes each rank communicates per training step, and what it holds, under FSDP2 and
DDP on 2 gloo ranks (CPU), for fp32, BF16 mixed precision, fp8fx, fp8fx with FP8 all-gather, and
each MS-AMP precision level (O1-O3).

Run: python bench/distributed.py [--layers 2 --dim 256 --seq 64 --batch 8 --steps 3] [--runs "FSDP2 fp8fx O1,FSDP2 fp8fx O2"] [--seed 0]
Per run and rank, over the last step: bytes put into all-gathers (FSDP2's parameter gathers),
reduce-scatters (FSDP2's gradients) and all-reduces (DDP's gradients), counted where FSDP2 and
DDP hand them to the collective; bytes saved for backward (saved-tensor hooks, distinct storages,
parameters not counted); and the rank's parameter, gradient and AdamW state bytes (its shards). Also the
training loss, averaged over the last 10 steps: with `--steps` in the hundreds, O2's Fp8AdamW against O1's
AdamW under FSDP2 (same init, from `--seed`, and batches).
fp8fx runs use the tensorwise recipe with lm_head high.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from convergence import corpus  # the convergence bench's text: a loss worth comparing between optimizers
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

import fp8fx
from fp8fx.distributed import ddp_with_level, enable_fp8_all_gather, shard_with_level
from fp8fx.tools.demo import TinyTransformer

WORLD = 2
POLICY = fp8fx.Policy.from_recipe("tensorwise", rules=(fp8fx.Rule(match="lm_head", precision="high"),))
# name: (engine, fp8fx, FSDP2 param dtype, FP8 all-gather, precision level)
RUNS = {
    "FSDP2 fp32": ("fsdp", False, None, False, None),
    "FSDP2 bf16 params": ("fsdp", False, torch.bfloat16, False, None),
    "FSDP2 fp8fx": ("fsdp", True, None, False, None),
    "FSDP2 fp8fx bf16 params": ("fsdp", True, torch.bfloat16, False, None),
    "FSDP2 fp8fx FP8 all-gather": ("fsdp", True, None, True, None),
    "FSDP2 fp8fx FP8 all-gather, bf16 params": ("fsdp", True, torch.bfloat16, True, None),
    "FSDP2 fp8fx O1": ("fsdp", True, None, False, "O1"),
    "FSDP2 fp8fx O2": ("fsdp", True, None, False, "O2"),
    "FSDP2 fp8fx O3": ("fsdp", True, None, False, "O3"),
    "DDP fp32": ("ddp", False, None, False, None),
    "DDP fp8fx": ("ddp", True, None, False, None),
    "DDP fp8fx O1": ("ddp", True, None, False, "O1"),
    "DDP fp8fx O2": ("ddp", True, None, False, "O2"),
}


class Counter:
    def __init__(self):
        self.bytes = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}


class CountingAllGather(DefaultAllGather):
    def __init__(self, counter: Counter):
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: ANN001
        self.counter.bytes["all_gather"] += input_tensor.numel() * input_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, async_op)


class CountingReduceScatter(DefaultReduceScatter):
    def __init__(self, counter: Counter):
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001
        self.counter.bytes["reduce_scatter"] += input_tensor.numel() * input_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def counting_allreduce_hook(counter: Counter):
    def hook(state, bucket):  # noqa: ANN001 - DDP's comm hook signature
        buffer = bucket.buffer()
        counter.bytes["all_reduce"] += buffer.numel() * buffer.element_size()
        buffer.div_(WORLD)
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])

    return hook


def parameter_storages(model: torch.nn.Module) -> set[int]:
    found = set()
    for p in model.parameters():
        p = p.to_local() if hasattr(p, "to_local") else p
        p = getattr(p, "_tensor", p)
        if p.untyped_storage().nbytes():
            found.add(p.untyped_storage().data_ptr())
    return found


def local_bytes(tensors) -> int:  # noqa: ANN001
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        t = getattr(t, "_tensor", t)  # an FP8 all-gather weight holds its high-precision shard
        total += t.numel() * t.element_size()
    return total


def state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor):
                t = t.to_local() if hasattr(t, "to_local") else t
                total += t.numel() * t.element_size()
    return total


def run(name: str, rank: int, args) -> dict:
    engine, use_fp8fx, param_dtype, fp8_gather, level = RUNS[name]
    torch.manual_seed(args.seed)
    model = TinyTransformer(dim=args.dim, layers=args.layers, max_seq=args.seq)
    counter = Counter()
    policy = dataclasses.replace(POLICY, level=level)
    backend = fp8fx.backend(policy=policy, inner="eager") if use_fp8fx else None
    make_optimizer = torch.optim.AdamW
    setup = None
    if level is not None:
        for block in model.blocks:
            block.compile(backend=backend)
        if engine == "ddp":
            step_model, setup = ddp_with_level(model, policy)
        else:
            setup = shard_with_level(model, [*model.blocks, model.lm_head], policy)
            for module in [*model.blocks, model.lm_head, model]:
                module.set_custom_all_gather(CountingAllGather(counter))
            step_model = model
        make_optimizer = setup.optimizer
    elif engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        ddp.register_comm_hook(None, counting_allreduce_hook(counter))
        step_model = torch.compile(ddp, backend=backend) if backend else ddp
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if fp8_gather:
            enable_fp8_all_gather(model, POLICY)
        mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for module in [*model.blocks, model.lm_head, model]:
            if backend is not None and module is not model:
                module.compile(backend=backend)
            fully_shard(module, mp_policy=mp_policy)
            module.set_custom_all_gather(CountingAllGather(counter))
            module.set_custom_reduce_scatter(CountingReduceScatter(counter))
        step_model = model
    opt = make_optimizer(model.parameters(), lr=1e-3)
    saved, losses, text = 0, [], corpus()[0]
    for step in range(args.steps):
        counter.bytes = dict.fromkeys(counter.bytes, 0)
        sent_before = setup.comm.bytes_sent if setup else 0
        g = torch.Generator().manual_seed(step)
        starts = torch.randint(0, len(text) - args.seq - 1, (args.batch,), generator=g).tolist()
        data = torch.stack([text[s : s + args.seq + 1] for s in starts])
        x, y = data[rank :: WORLD, :-1], data[rank :: WORLD, 1:]
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor):
            # parameters (FSDP2 swaps in the unsharded ones while a unit runs) are alive anyway
            if t.untyped_storage().data_ptr() not in parameter_storages(model):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(step_model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=False)
        saved = sum(seen.values())
        if setup is not None:  # the level's FP8 gradient reduction counts its own bytes
            counter.bytes["reduce_scatter" if engine == "fsdp" else "all_reduce"] = setup.comm.bytes_sent - sent_before
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    loss = sum(losses[-10:]) / len(losses[-10:])
    return {**counter.bytes, "saved": saved, "params": local_bytes(model.parameters()), "grads": local_bytes(grads),
            "adamw": state_bytes(opt), "loss": loss}  # fmt: skip


def worker(rank: int, store: str, out: str, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        for name in args.runs:
            torch._dynamo.reset()
            torch.save(run(name, rank, args), Path(out) / f"{args.runs.index(name)}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--layers", 2), ("--dim", 256), ("--seq", 64), ("--batch", 8), ("--steps", 3)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--seed", type=int, default=0, help="the model's initialisation")
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of: " + ", ".join(RUNS))
    args = ap.parse_args()
    args.runs = args.runs.split(",")
    unknown = [name for name in args.runs if name not in RUNS]
    if unknown:
        raise SystemExit(f"unknown run(s) {unknown}; choose from {', '.join(RUNS)}")
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(str(Path(out) / "store"), out, args), nprocs=WORLD, join=True, start_method="spawn")
        results = {name: [torch.load(Path(out) / f"{i}-{r}.pt") for r in range(WORLD)] for i, name in enumerate(args.runs)}
    kib = 1024
    print(f"per rank, last of {args.steps} steps; {args.layers} layers, dim {args.dim}, {args.batch} x {args.seq} tokens over {WORLD} ranks (KiB)")
    print(f"{'run':42s} {'all-gather':>10s} {'reduce-sc.':>10s} {'all-reduce':>10s} {'comm total':>10s} {'vs fp32':>7s} {'vs bf16':>7s} {'saved bw':>9s} {'params':>8s} {'grads':>8s} {'adamw':>8s} {'loss':>7s}")
    totals = {name: sum(r[0][k] for k in ("all_gather", "reduce_scatter", "all_reduce")) for name, r in results.items()}
    for name, ranks in results.items():
        r = ranks[0]
        base = totals.get("DDP fp32" if name.startswith("DDP") else "FSDP2 fp32")
        bf16 = totals.get("FSDP2 bf16 params") if name.startswith("FSDP2") else None
        vs_bf16 = f"{totals[name] / bf16:7.2f}" if bf16 else f"{'-':>7s}"
        cells = [r["all_gather"], r["reduce_scatter"], r["all_reduce"], totals[name]]
        print(f"{name:42s} " + " ".join(f"{c / kib:10.1f}" for c in cells) + f" {f'{totals[name] / base:7.2f}' if base else f'{chr(45):>7s}'} {vs_bf16} {r['saved'] / kib:9.1f} {r['params'] / kib:8.1f}"
              f" {r['grads'] / kib:8.1f} {r['adamw'] / kib:8.1f} {r['loss']:7.4f}")
    pair = ("FSDP2 bf16 params", "FSDP2 fp8fx FP8 all-gather, bf16 params")
    if all(name in results for name in pair):
        ag = {name: results[name][0]["all_gather"] for name in pair}
        print(f"\nFP8 all-gather vs BF16 all-gather: x{ag[pair[1]] / ag[pair[0]]:.2f} bytes")


if __name__ == "__main__":
    main()
