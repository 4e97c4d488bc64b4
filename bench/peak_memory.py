"""Peak memory of a BF16 Llama training step as a GPU runs it, measured on the CPU: fp8fx per recipe
against plain BF16 Inductor and torchao's float8 training, in one run.

Run: python bench/peak_memory.py [--layers 2 --hidden 256 --intermediate 896 --vocab 2048 --seq 256 --batch 2]
         [--variants bf16,fp8fx-tensorwise,fp8fx-rowwise,fp8fx-rowwise-savedfp8,torchao-tensorwise,torchao-rowwise]
         [--top 12] [--cpu-realize]

Every variant is compiled with Inductor, its FP8 GEMMs as `aten._scaled_mm` (the graph a GPU's cuBLAS
GEMMs make; torch's CPU build runs them), and one step (forward and backward of the loss) runs
under PyTorch's memory profiler. The peak is the most the step's allocations held at once, above
what was allocated before it (weights, and on a GPU the optimizer's state, which every variant holds
alike). Allocations made and freed inside one `aten._scaled_mm` call are left out: torch's CPU kernel
upcasts its operands to fp32 there, where cuBLAS allocates nothing. Inductor decides which values to
store by a GPU's rule (`gpu_realize_rule`; `--cpu-realize` keeps the CPU's). Prints each variant's peak, its
ratio to BF16's, and the sizes alive at that moment (`--top`). The project's target: at most BF16's.

fp8fx-<recipe>-savedfp8 sets the backend option saved_activations="fp8" (what backward reads besides
the FP8 GEMMs' operands kept in FP8 too), and its line gives the ratio to fp8fx-<recipe>'s peak as
well. O2's optimizer (fp8fx.runtime.optim.Fp8AdamW) has no variant here: it changes only the
optimizer's state, allocated before the step and so no part of this peak (bench/llama_gpu.py's -o2
variants measure a whole step with it).
"""

from __future__ import annotations

import argparse
import collections
import contextlib

import torch
from fusion_counts import cublas_devices, gpu_realize_rule, llama, torchao_llama  # the same Llama, and torchao's conversion of it
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import fp8fx

SCALED_MM = "aten::_scaled_mm"
SAVED_FP8 = "-savedfp8"


class Loss(torch.nn.Module):
    """The model's loss alone, as a training loop reads it (the logits are not kept)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def compiled_step(variant: str, args) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the BF16 Llama, its loss compiled as `variant`: bf16, fp8fx-<recipe>[-savedfp8] or torchao-<recipe>)."""
    saved = variant.endswith(SAVED_FP8)
    kind, _, recipe = variant.removesuffix(SAVED_FP8).partition("-")
    if (kind not in ("fp8fx", "torchao") and variant != "bf16") or (saved and kind != "fp8fx"):
        raise SystemExit(f"unknown variant {variant!r}: bf16, fp8fx-<recipe>[{SAVED_FP8}] or torchao-<recipe>")
    model, _ = torchao_llama(recipe, args) if kind == "torchao" else llama(args)
    model = model.to(torch.bfloat16)
    if kind == "fp8fx":
        backend = fp8fx.backend(policy=fp8fx.Policy.from_recipe(recipe), inner="inductor", cublas_devices=cublas_devices(args),
                                saved_activations="fp8" if saved else None)  # fmt: skip
        return model, torch.compile(Loss(model), backend=backend)
    return model, torch.compile(Loss(model))


def allocations(step) -> list[tuple[int, int, int, tuple[str, ...]]]:
    """(time, address, bytes: negative when freed, the ops it was made under) of each allocator
    event while `step()` runs, in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = []

    def walk(nodes, ops: tuple[str, ...]) -> None:
        for e in nodes:
            if e.tag == _EventType.Allocation:
                events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size, ops))
            walk(e.children, (*ops, e.name))

    walk(prof.profiler.kineto_results.experimental_event_tree(), ())
    return sorted(events, key=lambda e: e[0])


def peak(events) -> tuple[int, collections.Counter]:
    """The most bytes the events held at once, and the sizes alive then (bytes: count). An
    allocation made and freed under the same `aten::_scaled_mm` call is not counted."""
    inside: set[int] = set()
    opened: dict[int, int] = {}
    for i, (_, ptr, size, ops) in enumerate(events):
        if size > 0:
            opened[ptr] = i
        elif ptr in opened:
            j = opened.pop(ptr)
            if SCALED_MM in ops and SCALED_MM in events[j][3]:
                inside.update((i, j))
    live: dict[int, int] = {}
    held = top = 0
    at_top: collections.Counter = collections.Counter()
    for i, (_, ptr, size, _) in enumerate(events):
        if i in inside:
            continue
        if size > 0:
            live[ptr] = size
            held += size
        elif ptr in live:
            held -= live.pop(ptr)
        if held > top:
            top, at_top = held, collections.Counter(live.values())
    return top, at_top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 2), ("hidden", 256), ("intermediate", 896), ("heads", 4), ("kv-heads", 2), ("vocab", 2048),
                          ("seq", 256), ("batch", 2), ("top", 12)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    variants = "bf16,fp8fx-tensorwise,fp8fx-tensorwise-savedfp8,fp8fx-rowwise,fp8fx-rowwise-savedfp8,torchao-tensorwise,torchao-rowwise"
    ap.add_argument("--variants", default=variants)
    ap.add_argument("--cpu-realize", action="store_true", help="store values as Inductor does on a CPU, not as on a GPU")
    args = ap.parse_args()
    # (what fusion_counts' models and fp8fx's backends read: torchao's GEMMs `_scaled_mm` calls too, and
    # fp8fx's GEMMs a GPU gives cuBLAS are `aten._scaled_mm`)
    args.device, args.cublas = "cpu", True
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    print(f"Llama {args.layers} layer(s), hidden {args.hidden}, MLP {args.intermediate}, vocab {args.vocab}, {args.batch} x {args.seq} tokens, "
          f"bf16, Inductor, FP8 GEMMs as aten._scaled_mm, values stored by {'a CPU' if args.cpu_realize else 'a GPU'}'s rule")  # fmt: skip
    peaks = {}
    for variant in args.variants.split(","):
        model, step = compiled_step(variant, args)
        with contextlib.nullcontext() if args.cpu_realize else gpu_realize_rule():
            for _ in range(2):  # compile, then a step with the allocator warm
                step(ids).backward()
            model.zero_grad(set_to_none=True)
            peaks[variant], sizes = peak(allocations(lambda: step(ids).backward()))
        plain = variant.removesuffix(SAVED_FP8)
        against = ["bf16", *([plain] if plain != variant else [])]
        ratios = ", ".join(f"{peaks[variant] / peaks[other]:.3f}x {other}'s" for other in against if other in peaks)
        alive = ", ".join(f"{n} x {b / 2**10:.0f} KiB" for b, n in sorted(sizes.items(), reverse=True)[: args.top])
        print(f"{variant:<26} peak {peaks[variant] / 2**20:7.2f} MiB  {ratios:>14}   alive then: {alive}", flush=True)
    print("target: every fp8fx variant at most BF16's peak")


if __name__ == "__main__":
    main()
