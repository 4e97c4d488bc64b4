"""Bytes saved for backward and peak memory of a training step: fp8fx vs the fp32 model, or (--bf16)
fp8fx with and without saved_activations="fp8" vs the BF16 model compiled without FP8.

Run: python bench/saved_memory.py [--layers 4 --dim 256 --seq 128 --batch 8]
     python bench/saved_memory.py --bf16 --inner inductor --model llama|gpt2 [--layers 2 --dim 64 --seq 32 --batch 2]
Every tensor autograd keeps for backward passes through the pack hook, for eager and compiled
models alike; the bench sums the bytes of distinct storages (a view of a parameter counts as the
parameter, which is alive anyway and is not counted). Target: fp8fx <= 0.5x fp32.
Peak: the most the CPU allocator held during one forward and backward above what it held before
(PyTorch's memory profiler reports every allocation with the allocator's total).
"""

from __future__ import annotations

import argparse

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import fp8fx
from fp8fx.tools.demo import TinyTransformer


class Logits(torch.nn.Module):
    """A transformers model returning its logits tensor only."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits


def saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, int]:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, torch.dtype]] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = (t.untyped_storage().nbytes(), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).float().pow(2).mean()
    loss.backward()
    by_dtype: dict[str, int] = {}
    for nbytes, dtype in seen.values():
        by_dtype[str(dtype).removeprefix("torch.")] = by_dtype.get(str(dtype).removeprefix("torch."), 0) + nbytes
    return by_dtype


def peak_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Peak bytes the CPU allocator held during one training step, above what it held before."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(tokens).float().pow(2).mean().backward()
    allocations = []

    def walk(events) -> None:
        for event in events:
            if event.tag == _EventType.Allocation:
                allocations.append((event.start_time_ns, event.extra_fields.total_allocated, event.extra_fields.alloc_size))
            walk(event.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    allocations.sort()
    before = allocations[0][1] - allocations[0][2]  # the first event's total, less its own size
    return max(total for _, total, _ in allocations) - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    ap.add_argument("--model", default="llama", choices=["llama", "gpt2", "transformer"], help="transformers Llama or GPT-2, or fp8fx's demo model")
    ap.add_argument("--bf16", action="store_true", help="a BF16 model: fp8fx with and without saved_activations='fp8' against it without FP8")
    ap.add_argument("--no-fusion", action="store_true", help="keep the FP8 GEMMs unfused (fuse_epilogues=False)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            hidden_size=args.dim,
            intermediate_size=4 * args.dim,
            num_hidden_layers=args.layers,
            num_attention_heads=max(1, args.dim // 64),
            vocab_size=256,
        )
        model = Logits(LlamaForCausalLM(cfg))
    elif args.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_embd=args.dim, n_layer=args.layers, n_head=max(1, args.dim // 64), vocab_size=256,
                         n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
        model = Logits(GPT2LMHeadModel(cfg))
    else:
        model = TinyTransformer(dim=args.dim, heads=max(1, args.dim // 64), layers=args.layers, max_seq=args.seq)
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    if args.bf16:
        return bf16_run(model.to(torch.bfloat16), tokens, args)
    base = saved_bytes(model, tokens)
    peaks = {"fp32": peak_bytes(model, tokens)}
    measured = {}
    # fp32 GEMM outputs kept for backward as computed, then in BF16 (the default), with the weights'
    # FP8 copies kept; then the default: the weights cast again in backward (weight_fp8="auto" under
    # dynamic scaling).
    for saved, weight in (("high", "keep"), ("bf16", "keep"), ("bf16", "recompute")):
        torch._dynamo.reset()
        backend = fp8fx.backend(inner=args.inner, fuse_epilogues=not args.no_fusion, saved_outputs=saved, weight_fp8=weight)
        compiled = torch.compile(model, backend=backend)
        saved_bytes(compiled, tokens)  # compile
        name = f"saved_outputs={saved}, weight_fp8={weight}"
        measured[name] = saved_bytes(compiled, tokens)
        peaks[f"fp8fx {name}"] = peak_bytes(compiled, tokens)
    total_base = sum(base.values())
    print(f"model: {args.model}, {args.layers} layers, dim {args.dim}, batch {args.batch} x seq {args.seq}, inner={args.inner}")
    print(f"{'fp32 eager':<52}: {total_base / 2**20:8.2f} MiB saved for backward  {base}")
    for name, fp8 in measured.items():
        print(f"fp8fx {name:<46}: {sum(fp8.values()) / 2**20:8.2f} MiB saved for backward  {fp8}")
    for name, fp8 in measured.items():
        print(f"ratio fp8fx ({name}) / fp32 = {sum(fp8.values()) / total_base:.3f}")
    print("target: fp8fx (the default: saved_outputs=bf16, weight_fp8=recompute) <= 0.5")
    for name, peak in peaks.items():
        print(f"peak during a step, {name:<52}: {peak / 2**20:8.2f} MiB ({peak / peaks['fp32']:.3f} of fp32)")


def bf16_run(model: torch.nn.Module, tokens: torch.Tensor, args) -> None:
    """Bytes autograd keeps for a BF16 model: compiled without FP8, with fp8fx's defaults, and with
    saved_activations="fp8"."""
    plain = "inductor" if args.inner == "inductor" else "aot_eager"
    variants = {
        f"bf16 ({plain})": plain,
        "fp8fx": fp8fx.backend(inner=args.inner),
        "fp8fx saved_activations=fp8": fp8fx.backend(inner=args.inner, saved_activations="fp8"),
    }
    totals = {}
    for name, backend in variants.items():
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        saved_bytes(compiled, tokens)  # compile
        totals[name] = saved_bytes(compiled, tokens)
    base = sum(totals[f"bf16 ({plain})"].values())
    print(f"model: {args.model} in BF16, {args.layers} layers, dim {args.dim}, batch {args.batch} x seq {args.seq}, inner={args.inner}")
    for name, kept in totals.items():
        print(f"{name:<30}: {sum(kept.values()) / 2**20:8.3f} MiB saved for backward ({sum(kept.values()) / base:.3f}x)  {kept}")
    print("target: saved_activations=fp8 <= 0.6x BF16's")


if __name__ == "__main__":
    main()
