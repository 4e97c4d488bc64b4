"""Training steps of a `transformers` Llama on a GPU: fp8fx per recipe and kernel choice, beside BF16
torch.compile and torchao float8 (tensorwise, rowwise).

Run: python bench/llama_gpu.py [--model llama3-8b|gpt3-6.7b|te-layer] [--layers 2 --seq 4096 --batch 2] [--recipes tensorwise,rowwise]
     [--kernels auto,triton,scaled_mm] [--inner inductor|eager] [--variants bf16,fp8fx-rowwise-auto | --variants cudagraphs]
     [--steps 10 --warmup 3] [--json out.json] [--save-code DIR] [--memory] [--memory-cap 40]
     python bench/llama_gpu.py --variants bf16,torchao-rowwise,fp8fx-rowwise-auto,fp8fx-rowwise-auto-savedfp8-o2 --memory-cap 40
     python bench/llama_gpu.py --layers 8 --variants bf16,fp8fx-tensorwise-auto   # a deeper model (the estimate below says what fits)
     python bench/llama_gpu.py --device cpu --tiny --steps 2 --warmup 1 --inner eager   # smoke test

The model is LlamaForCausalLM built from a LlamaConfig (no download), by default with Llama-3-8B's
layer shapes (hidden 4096, MLP 14336, 32 heads, 8 KV heads, head dim 128), 2 layers, vocab 32768,
BF16 weights, SDPA attention, batch 2 x seq 4096. `--model gpt3-6.7b` builds GPT-3 6.7B's layer
shapes instead (hidden 4096, MLP 16384 with GELU, 32 heads of 128, LayerNorm, biases, learned
positions; vocab 50272) as transformers' OPTForCausalLM, whose projections are nn.Linear as
torchao needs. `--model te-layer` is one GPT layer at the shapes of TransformerEngine's published
layer benchmark (hidden 4096, FFN 16384 with GELU, 32 heads, batch 4 x seq 4096: 16k tokens; `GptLayer`),
stepped forward and backward on random activations with no loss and no optimizer, as TE times
it; the table then sets TE's published speedups beside ours. Each step is otherwise forward with labels (the model's
cross-entropy), backward and an AdamW (or SGD) step; every variant gets the same init and the
same random batches. Each variant runs in its own process (`--child`), with a fresh Inductor
and Triton cache directory, so compiles are cold and a crash, an OOM or a timeout only fails its
own row. Per variant: per-step and final loss, the first step (compile included, wall clock), the
median of the timed steps after the warm-up steps (CUDA events), the peak memory of the timed steps
(torch.cuda.max_memory_allocated, reset after warm-up), fp8fx's report summary (GEMMs in FP8, fused
epilogues, memory passes added / saved, kernels), the fp8fx ops Inductor's generated code calls
(only GEMMs cuBLAS cannot take as they are should be left; none on CPU) and its `_scaled_mm`
calls, one more step under torch.profiler (kernels launched, host time, GEMM time, the kernels with the most
GPU time), and the speedup and memory ratio to BF16 from the same run. BF16 and torchao use
`torch.compile` with the same inner compiler as fp8fx ("inductor", or "aot_eager" for --inner eager). Recipes this GPU cannot run are rows marked skipped. Under
torch.compile before torch 2.14, transformers hands SDPA an explicit causal mask (so no flash
attention), in every variant alike.

The bound: what the step would take with every FP8 GEMM at its bare cuBLAS time and
casts that cost nothing, and each FP8 variant's fraction of it (bound / measured step; 1.0 would
leave nothing to gain but faster GEMMs). It is the BF16 step without its GEMMs (its measured step
less the GEMM time of its profiled step, `gemm_ms`: what FP8 leaves as it is, attention, norms,
elementwise ops, loss, optimizer and idle gaps), plus each GEMM of the FP8 variant's report timed
bare in the variant's own process (`gemm_bound`): FP8 GEMMs through `torch._scaled_mm` as fp8fx
calls it, high-precision ones as BF16 `torch.matmul`. A torchao row takes the bound of fp8fx's
recipe of the same name (the same GEMMs). Bare GEMMs are timed on their own with a cold L2 and in
one layout, so the in-step GEMMs may take longer; `gemm_bf16_ms` (every GEMM bare in BF16) beside
the BF16 step's `gemm_ms` shows by how much.

Variant names: bf16 (the baseline in --dtype, without FP8), torchao-tensorwise, torchao-rowwise and
fp8fx-<recipe>-<kernels> (the backend's defaults otherwise), each followed by any of these options
(each once, in any order; fp8fx-rowwise-auto-savedfp8-o2 has two):
- -keep (fp8fx): backend option weight_fp8="keep": backward reads the FP8 copies of the weights forward
  made, where the default casts them again under dynamic scaling;
- -savedfp8 (fp8fx): backend option saved_activations="fp8": what backward reads besides the FP8 GEMMs'
  operands is kept in FP8 too (fp8fx.passes.saved_activations);
- -o2: the step's optimizer is fp8fx.runtime.optim.Fp8AdamW (FP8 first moment, FP16 second: what a
  policy's `level: O2` trains with) in place of --optimizer; the row then also times its step alone
  beside torch.optim.AdamW(fused=True)'s on the same parameters and gradients (`optimizer_times`);
- -cudagraphs: Inductor runs the compiled graphs as CUDA graphs (its `triton.cudagraphs` option, what
  mode="reduce-overhead" sets; no effect on CPU or with --inner eager). `--variants cudagraphs` is
  BF16 and every fp8fx recipe under CUDA graphs.
Under the table, each variant with -savedfp8 or -o2 is set against the same variant without them
(step time and peak) when that ran too, in this run or in the earlier one given by --beside JSON
(its --json; BF16's row is then taken from there too where this run has none).

--memory-cap GIB: for each variant, also the largest multiple of --batch whose step peaks at most
GIB (torch.cuda.max_memory_allocated over the timed steps: the allocator's cache and the CUDA context
are not counted), found by `largest_batch`, and the tokens per second at that batch (`cap_search`).
Each batch tried is a run of the variant's own process, as every variant is: a batch that does not
fit may end in an out-of-memory error, after which a process's allocator, CUDA graph pools and
compiled code are no measure of the next batch, and in one process Dynamo would compile the second
batch size with a dynamic batch dimension (its automatic dynamic shapes), not the program timed. The
price is a cold compile per batch tried (about a minute for an 8B-shaped rowwise step), hence a
search that guesses from the peaks' line before it bisects: 3 runs beyond the first where the peak
grows linearly with the batch. On CPU no peak is measured and the search is not run.
Before the variants run, an estimate of the step's peak memory (`memory_estimate`) and, on a GPU,
how many layers would fit in it.
Output: a Markdown table on stdout, progress on stderr, JSON to --json (default $OUT/llama_gpu.json
when OUT is set). Exit code 0 when every variant not skipped ran, 1 otherwise, 2 without a CUDA GPU.
On CPU (--device cpu) FP8 is emulated (torchao with emulate=True), steps are timed with
time.perf_counter, peak memory is not measured and the kernel choice does not apply (default auto);
the bound's code runs, its numbers mean nothing.
Needs the bench extra (transformers, torchao).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F
from optim_step import ms_per_step  # (bench/, this script's directory)
from torch._inductor.utils import run_and_get_code
from torch.autograd import DeviceType

import fp8fx
from fp8fx.codegen import dispatch
from fp8fx.codegen.variants import GemmVariant, arch_of
from fp8fx.core.formats import Fp8Format
from fp8fx.core.recipes import RECIPES
from fp8fx.ops.gemm_bench import COMPILE_REP_MS, COMPILE_WARMUP_MS, VariantUse, cuda_bench, run_scaled_mm, time_kernels
from fp8fx.runtime.optim import Fp8AdamW

# torch.compile backend of the BF16 and torchao runs, by fp8fx inner compiler.
PLAIN_BACKEND = {"inductor": "inductor", "eager": "aot_eager"}
TORCHAO_RECIPES = ("tensorwise", "rowwise")
# Recipes that need a GPU target beyond FP8 tensor cores (fp8fx.codegen.variants.arch_of's names).
# MX GEMMs run on Hopper and Ada too (each 32-K block promoted to fp32, docs/kernels.md).
RECIPE_NEEDS = {"nvfp4": ("sm_100a", "needs sm_100 (Blackwell's FP4 tensor cores)")}
SHAPES = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "seq", "batch")
LLAMA3_8B = dict(layers=2, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=32768, seq=4096, batch=2)
GPT3_6_7B = dict(LLAMA3_8B, intermediate=16384, kv_heads=32, vocab=50272)  # OPT's vocabulary (a multiple of 16)
# TransformerEngine's published layer benchmark (H100): one layer, 16k tokens; no vocabulary
TE_LAYER = dict(GPT3_6_7B, layers=1, vocab=0, batch=4)
TE_PUBLISHED = "TransformerEngine's published figures for this layer (H100): FP8 Linear 1.53x BF16, fused TransformerLayer 1.65x"
MODELS = {"llama3-8b": LLAMA3_8B, "gpt3-6.7b": GPT3_6_7B, "te-layer": TE_LAYER}
TINY = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=128, seq=32, batch=2)  # the model's layers
CUDAGRAPHS = "-cudagraphs"
OPTIONS = ("keep", "savedfp8", "o2", "cudagraphs")  # a variant name's option suffixes (the module's docstring)
FP8FX_OPTIONS = {"keep", "savedfp8"}  # backend options: fp8fx variants only
MEMORY_OPTIONS = {"savedfp8", "o2"}  # the memory options, set against the same variant without them


# --- variants and what this machine can run -----------------------------------------------------


def split_options(name: str) -> tuple[str, frozenset[str]]:
    """(a variant name without its option suffixes, those options)."""
    parts, options = name.split("-"), set()
    while len(parts) > 1 and parts[-1] in OPTIONS and parts[-1] not in options:
        options.add(parts.pop())
    return "-".join(parts), frozenset(options)


def parse_variant(name: str) -> tuple[str, str | None, str | None]:
    """(kind, recipe, kernels) of a variant name: bf16 | torchao-<recipe> | fp8fx-<recipe>-<kernels>,
    then any of the option suffixes (-keep and -savedfp8 on fp8fx only)."""
    base, options = split_options(name)
    parts = base.split("-")
    parsed = None
    if parts == ["bf16"]:
        parsed = "bf16", None, None
    elif len(parts) == 2 and parts[0] == "torchao" and parts[1] in TORCHAO_RECIPES:
        parsed = "torchao", parts[1], None
    elif len(parts) == 3 and parts[0] == "fp8fx" and parts[1] in RECIPES and parts[2] in ("auto", "triton", "scaled_mm"):
        parsed = "fp8fx", parts[1], parts[2]
    if parsed is None or (parsed[0] != "fp8fx" and options & FP8FX_OPTIONS):
        raise ValueError(
            f"unknown variant {name!r}: bf16, torchao-{{{','.join(TORCHAO_RECIPES)}}} or fp8fx-<recipe>-<auto|triton|scaled_mm> "
            f"with a recipe of {', '.join(RECIPES)}, then any of -o2, -cudagraphs and (fp8fx only) -keep, -savedfp8, each once"
        )
    return parsed


def default_variants(args) -> list[str]:
    torchao = [f"torchao-{r}" for r in TORCHAO_RECIPES]
    return ["bf16", *torchao, *(f"fp8fx-{r}-{k}" for r in args.recipes for k in args.kernels)]


def cudagraph_variants() -> list[str]:
    """`--variants cudagraphs`: every fp8fx recipe under CUDA graphs (a recipe this GPU cannot run is
    a skipped row), beside BF16 with and without them."""
    return ["bf16", f"bf16{CUDAGRAPHS}", *(f"fp8fx-{r}-auto{CUDAGRAPHS}" for r in RECIPES)]


def skip_reason(name: str, env: dict) -> str:
    """Why this machine cannot run the variant ("" when it can)."""
    kind, recipe, _ = parse_variant(name)
    if kind == "torchao" and env["torchao"] is None:
        return "skipped: torchao not installed"
    if kind == "bf16" or env["target"] is None:  # CPU: everything is emulated
        return ""
    if env["target"] == "none":
        return f"skipped: needs sm_89+ (FP8 tensor cores); this GPU is sm_{env['capability'].replace('.', '')}"
    need = RECIPE_NEEDS.get(recipe) if kind == "fp8fx" else None
    if need and env["target"] != need[0]:
        return f"skipped: {need[1]}"
    return ""


def version(package: str) -> str | None:
    """An installed distribution's version, without importing it (torchao's import prints warnings)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict:
    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), python=platform.python_version(),
        torch=torch.__version__, triton=version("triton") or version("pytorch-triton"), transformers=version("transformers"),
        torchao=version("torchao") if importlib.util.find_spec("torchao") else None, fp8fx=fp8fx.__version__,
        cuda=torch.version.cuda, device=device, gpu=None, capability=None, target=None,
    )  # fmt: skip
    if device == "cuda":
        cap = torch.cuda.get_device_capability()
        env.update(gpu=torch.cuda.get_device_name(), capability=f"{cap[0]}.{cap[1]}")
        try:
            env["target"] = arch_of(cap, hip=torch.version.hip is not None)
        except RuntimeError:  # no FP8 tensor cores (or ROCm)
            env["target"] = "none"
        env["dispatch_table"] = dispatch_table_of(env["gpu"])
    return env


def dispatch_table_of(gpu: str) -> dict | None:
    """This GPU model's table of `fp8fx selftest` measurements, which kernels="auto" follows: its
    path and number of GEMMs (None: no table, every GEMM takes the unmeasured rule)."""
    path = dispatch.table_path(gpu)
    return dict(path=str(path), gemms=len(dispatch.load_table(path))) if path.exists() else None


# --- the child: one variant's training run ---------------------------------------------------------


class GptLayer(torch.nn.Module):
    """A GPT layer as TransformerEngine's TransformerLayer computes it (without dropout): pre-LayerNorm,
    fused QKV projection with biases, causal attention (SDPA: flash attention on a GPU), output
    projection, MLP with TE's (tanh) GELU, residual adds. fp8fx.tools.demo's Block writes its
    attention as matmuls, which TE's layer does not."""

    def __init__(self, hidden: int, ffn: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


def build_model(args, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed(args.seed)  # the same init in every variant's process
    if args.model == "te-layer":
        with device:
            model = torch.nn.Sequential(*(GptLayer(args.hidden, args.intermediate, args.heads) for _ in range(args.layers)))
        return model.to(getattr(torch, args.dtype)).train()
    if args.model == "gpt3-6.7b":
        cls, cfg = OPTForCausalLM, OPTConfig(
            hidden_size=args.hidden, ffn_dim=args.intermediate, num_hidden_layers=args.layers, num_attention_heads=args.heads,
            word_embed_proj_dim=args.hidden, activation_function="gelu", vocab_size=args.vocab,
            max_position_embeddings=max(args.seq, 128), attn_implementation="sdpa", use_cache=False, dropout=0.0,
        )  # fmt: skip
    else:
        cls, cfg = LlamaForCausalLM, LlamaConfig(
            hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
            vocab_size=args.vocab, max_position_embeddings=max(args.seq, 128), attn_implementation="sdpa", use_cache=False,
        )  # fmt: skip
    with device:  # built on the device: an 8B-shaped layer is slow to initialise on the CPU
        model = cls(cfg)
    return model.to(getattr(torch, args.dtype)).train()


def token_batches(args, device: torch.device) -> list:
    """warmup + steps random batches, drawn from their own generator: identical in every variant.
    te-layer: one (activations, output gradient) pair for every step, as TE's benchmark reuses its input."""
    if args.model == "te-layer":
        gen = torch.Generator(device).manual_seed(args.seed + 1)  # drawn on the device: 2 x 16k x 4096 values
        x, grad = (torch.randn(args.batch, args.seq, args.hidden, generator=gen, device=device) for _ in range(2))
        dtype = getattr(torch, args.dtype)
        return [(x.to(dtype).requires_grad_(), grad.to(dtype))] * (args.warmup + args.steps)
    gen = torch.Generator().manual_seed(args.seed + 1)
    shape = (args.batch, args.seq)
    return [torch.randint(0, args.vocab, shape, generator=gen).to(device) for _ in range(args.warmup + args.steps)]


def compile_variant(model: torch.nn.Module, name: str, args):
    """The compiled model of a variant; torchao converts the model's Linears in place first."""
    kind, recipe, kernels = parse_variant(name)
    options = split_options(name)[1]
    if kind == "fp8fx":
        backend = fp8fx.backend(policy=fp8fx.Policy.from_recipe(recipe), inner=args.inner, kernels=kernels,
                                weight_fp8="keep" if "keep" in options else "auto",
                                saved_activations="fp8" if "savedfp8" in options else None)  # fmt: skip
        return torch.compile(fp8fx.prepare(model), backend=backend)  # prepare: delayed recipes keep state there
    if kind == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        if args.device == "cpu":  # torchao's FP8 GEMMs need CUDA; emulate runs them in high precision
            config = dataclasses.replace(config, emulate=True)
        convert_to_float8_training(model, config=config)
    return torch.compile(model, backend=PLAIN_BACKEND[args.inner])


def make_optimizer(model: torch.nn.Module, name: str, args) -> torch.optim.Optimizer | None:
    if args.model == "te-layer":  # forward and backward only, as TE times its layer
        return None
    if "o2" in split_options(name)[1]:
        return Fp8AdamW(model.parameters(), lr=args.lr)
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr)
    return torch.optim.AdamW(model.parameters(), lr=args.lr)


def train_step(compiled, opt: torch.optim.Optimizer | None, batch) -> torch.Tensor:
    torch.compiler.cudagraph_mark_step_begin()  # (with CUDA graphs: each step is a new iteration)
    if opt is None:  # te-layer: the layer's forward and backward from a given output gradient
        x, grad = batch
        out = compiled(x)
        out.backward(grad)
        x.grad = None
        compiled.zero_grad(set_to_none=True)  # no gradient accumulation kernels
        # No loss to log: the last position's mean square, which every weight reaches, compared across variants.
        return out[:, -1].detach().float().square().mean()
    loss = compiled(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    # Read after the run (an .item() per step would stall the timed stream); a copy, since a CUDA
    # graph's next replay overwrites its outputs.
    return loss.detach().clone()


def timed_steps(step, batches: list[torch.Tensor], cuda: bool) -> tuple[list[torch.Tensor], list[float]]:
    """Run `step` over the batches; its losses and the milliseconds of each step."""
    losses = []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in batches]
        for (start, end), tokens in zip(events, batches):
            start.record()
            losses.append(step(tokens))
            end.record()
        torch.cuda.synchronize()
        return losses, [start.elapsed_time(end) for start, end in events]
    times = []
    for tokens in batches:
        t0 = time.perf_counter()
        losses.append(step(tokens))
        times.append(1000 * (time.perf_counter() - t0))
    return losses, times


def run_variant(name: str, args) -> dict:
    """Train one variant: losses, first-step and median step time, peak memory, fp8fx's report."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    options = split_options(name)[1]
    if "cudagraphs" in options:
        torch._inductor.config.triton.cudagraphs = True
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = build_model(args, device)
    batches = token_batches(args, device)
    compiled = compile_variant(model, name, args)
    opt = make_optimizer(model, name, args)  # after torchao's conversion, over the parameters it trains

    def step(tokens):
        return train_step(compiled, opt, tokens)

    sync()
    t0 = time.perf_counter()
    loss, code = run_and_get_code(step, batches[0])  # compiles forward and backward
    losses = [loss]
    sync()
    first_s = time.perf_counter() - t0
    losses += [step(tokens) for tokens in batches[1 : args.warmup]]
    sync()
    if cuda:  # the timed steps' peak: optimizer state is allocated, autotuning is done
        torch.cuda.reset_peak_memory_stats()
    timed_losses, times = timed_steps(step, batches[args.warmup :], cuda)
    losses = [float(x) for x in torch.stack(losses + timed_losses).float().cpu()]
    out = dict(
        losses=losses, final_loss=losses[-1], first_step_s=first_s, step_ms=statistics.median(times), step_ms_all=times,
        peak_memory_bytes=torch.cuda.max_memory_allocated() if cuda else None, optimizer=type(opt).__name__ if opt else None,
    )  # fmt: skip
    out["profile"] = profile_step(step, batches[-1], cuda)
    if args.memory and cuda and "cudagraphs" not in options:
        out["memory_at_peak"] = memory_step(step, batches[-1])
    if "o2" in options and opt is not None:
        out.update(optimizer_times(compiled, model, opt, batches[-1], args.lr, sync))
    if args.save_code:  # Inductor's generated code, forward and backward, for reading afterwards
        os.makedirs(args.save_code, exist_ok=True)
        with open(os.path.join(args.save_code, f"{name}.py"), "w") as f:
            f.write("\n\n# ----- next graph -----\n\n".join(code))
    if parse_variant(name)[0] == "fp8fx":
        report = fp8fx.report(compiled)
        out.update(fp8fx_report=report.summary(), fp8fx_report_lines=report.summary_lines())
        out.update(gemm_bound(report, device, getattr(torch, args.dtype)))
        if args.inner == "inductor":
            out["fp8fx_ops_called"] = fp8fx_ops_called(code)
            out["scaled_mm_called"] = len(re.findall(r"extern_kernels\._scaled_mm\(|aten\._scaled_mm\.default\(", "\n".join(code)))
    return out


def optimizer_times(compiled, model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, lr: float, sync) -> dict:
    """Milliseconds of `opt`'s step alone (`optimizer_ms`) and of torch.optim.AdamW(fused=True)'s
    (`fused_adamw_ms`) on the same parameters, with the gradients of one more forward and backward,
    timed as bench/optim_step.py times them. The target: Fp8AdamW no slower. (The weights
    take these steps too: after every measurement of the variant's training.)"""
    torch.compiler.cudagraph_mark_step_begin()
    compiled(input_ids=tokens, labels=tokens).loss.backward()
    fused = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    return dict(optimizer_ms=ms_per_step(opt, 5, sync), fused_adamw_ms=ms_per_step(fused, 5, sync))


def memory_step(step, tokens: torch.Tensor) -> dict:
    """One more step with the CUDA allocator's history recorded: what is alive at its peak."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    try:
        step(tokens)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return memory_at_peak(snapshot["device_traces"][torch.cuda.current_device()])


def memory_at_peak(entries: list[dict], top: int = 25) -> dict:
    """The allocations a recorded step made that are alive at its most-allocated moment (the tensors
    alive before it, weights and optimizer state, are not in the trace), grouped by where they were
    allocated (`allocation_site`), largest first."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for e in entries:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif e["action"] == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    groups: dict[str, list[int]] = {}
    for e in at_peak:
        group = groups.setdefault(allocation_site(e.get("frames", [])), [0, 0])
        group[0] += 1
        group[1] += e["size"]
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    return dict(peak_bytes=peak, live=[dict(where=w, count=n, bytes=b) for w, (n, b) in rows])


def allocation_site(frames: list[dict]) -> str:
    """Where an allocation was made (its frames innermost first): the line of Inductor's generated
    code, else the innermost frame outside torch, else the innermost one; with the line's source."""
    import linecache

    def outside_torch(f: dict) -> bool:
        return "/torch/" not in f["filename"] and "<" not in f["filename"]

    frame = next((f for f in frames if "torchinductor" in f["filename"]), None) or next(filter(outside_torch, frames), None)
    frame = frame or (frames[0] if frames else None)
    if frame is None:
        return "(no Python frame)"
    source = linecache.getline(frame["filename"], frame["line"]).strip()
    return f"{os.path.basename(frame['filename'])}:{frame['line']} {frame['name']}: {source[:160]}"


# The ops that run a GEMM: aten's (what Inductor's code calls) and fp8fx's.
GEMM_OP = re.compile(
    r"aten::(mm|addmm|bmm|baddbmm|_scaled_mm(_v2)?|_scaled_grouped_mm(_v2)?|_grouped_mm)|fp8fx::(fp8_gemm|scaled_mm|fp8_grouped_mm)"
)


def gemm_ms(events, cuda: bool) -> float:
    """The GEMMs' time in a profiled step: the device time of the kernels each GEMM op launched (on
    CPU, the op's own time), counting a GEMM op inside another one, or inside attention (a math
    SDPA's bmm), not at all."""

    def counted(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if GEMM_OP.fullmatch(parent.name) or "attention" in parent.name:
                return False
            parent = parent.cpu_parent
        return True

    gemms = [e for e in events if e.device_type == DeviceType.CPU and GEMM_OP.fullmatch(e.name) and counted(e)]
    return sum(e.device_time_total if cuda else e.cpu_time_total for e in gemms) / 1000


def profile_step(step, tokens, cuda: bool, top: int = 15) -> dict:
    """One more step under torch.profiler: where its time goes. Kernels launched, the host's wall
    time for the step (launch-bound when close to the device time), its GEMMs' time (`gemm_ms`;
    under CUDA graphs the profiler sees no ops: 0), and the kernels (or, on CPU, the ops) with the
    most self time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step(tokens)
        host_ms = 1000 * (time.perf_counter() - t0)
        sync()
    # On a GPU an op that launched kernels carries their time too (aten::copy_ beside its kernel):
    # the top rows show both, the sums count the device's entries (kernels and copies) alone.
    self_ms = (lambda e: e.self_device_time_total / 1000) if cuda else (lambda e: e.self_cpu_time_total / 1000)
    rows = sorted((e for e in prof.key_averages() if self_ms(e) > 0), key=lambda e: -self_ms(e))
    kernels = [e for e in rows if e.device_type == DeviceType.CUDA] if cuda else rows
    return dict(
        host_ms=host_ms, kernels=sum(e.count for e in kernels) if cuda else None, busy_ms=sum(map(self_ms, kernels)),
        gemm_ms=gemm_ms(prof.events(), cuda), top=[dict(name=e.key[:120], ms=round(self_ms(e), 3), count=e.count) for e in rows[:top]],
    )  # fmt: skip


# The report's ops `gemm_ms` counts as GEMMs (attention and convolutions are the step's other work).
TIMED_OPS = ("mm", "addmm", "bmm", "baddbmm")


def gemm_bound(report, device: torch.device, dtype: torch.dtype) -> dict:
    """Each GEMM of the step (a row of fp8fx's report) timed bare in this process, for the bound:
    `gemms` (one row each: bf16_ms, and fp8_ms for an FP8 GEMM), `gemm_bound_ms` (FP8 GEMMs at
    their FP8 time, the others at BF16's; None if one could not be timed) and `gemm_bf16_ms` (all
    in BF16). Each distinct GEMM is timed once."""
    bench = functools.partial(cuda_bench, warmup=COMPILE_WARMUP_MS, rep=COMPILE_REP_MS) if device.type == "cuda" else cpu_ms
    measured: dict[tuple, dict] = {}
    rows = []
    for op in report.ops:
        if op.op in TIMED_OPS:
            key = (op.precision, op.formats, op.blocks, op.fast_accum, op.batch, op.m, op.n, op.k)
            if key not in measured:
                measured[key] = time_gemm(op, device, dtype, bench)
            rows.append(dict(site=op.site, role=op.role, precision=op.precision, batch=op.batch, m=op.m, n=op.n, k=op.k, **measured[key]))

    def total(times: list) -> float | None:
        return None if None in times else sum(times)

    return dict(
        gemms=rows, gemm_bf16_ms=total([r["bf16_ms"] for r in rows]),
        gemm_bound_ms=total([r["fp8_ms"] if r["precision"] == "fp8" else r["bf16_ms"] for r in rows]),
    )  # fmt: skip


def time_gemm(op, device: torch.device, dtype: torch.dtype, bench) -> dict:
    """One report row's GEMM timed bare: bf16_ms as `torch.matmul` in `dtype`, and for an FP8 GEMM
    fp8_ms as fp8fx's cuBLAS path runs it (fp8fx.ops.gemm_bench's `torch._scaled_mm` runner on its
    quantized inputs; MX blocks, which cuBLAS takes on Blackwell only, run the generated kernel),
    with `error` when it could not be timed. Every role in a forward GEMM's layout (a row-major,
    b column-major)."""
    if not all(isinstance(d, int) for d in (op.batch, op.m, op.n, op.k)):
        return dict(bf16_ms=None, fp8_ms=None, error=f"dynamic shape {op.batch} x {op.m} x {op.n} x {op.k}")
    with torch.no_grad():
        a = torch.randn(op.batch, op.m, op.k, device=device, dtype=dtype).squeeze(0)
        b = torch.randn(op.batch, op.n, op.k, device=device, dtype=dtype).transpose(-1, -2).squeeze(0)
        out = dict(bf16_ms=bench(lambda: torch.matmul(a, b)), fp8_ms=None)
        if op.precision != "fp8":
            return out
        if op.batch != 1:
            return dict(out, error="batched FP8 GEMMs are not timed")
        dtypes = [Fp8Format(f).dtype for f in op.formats]
        variant = GemmVariant(*dtypes, block_a=tuple(op.blocks[0]), block_b=tuple(op.blocks[1]), fast_accum=bool(op.fast_accum))
        times, errors = time_kernels(VariantUse(variant, ()), op.m, op.n, op.k, device, bench, {"scaled_mm": run_scaled_mm})
    return dict(out, fp8_ms=times["scaled_mm"], **({"error": "; ".join(errors.values())} if errors else {}))


def cpu_ms(fn) -> float:
    """One call's milliseconds (the CPU smoke test runs the code path; its numbers mean nothing)."""
    t0 = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - t0)


def fp8fx_ops_called(code: list[str]) -> dict[str, int]:
    """How often Inductor's generated code calls each fp8fx op (the GEMMs on a GPU; none on CPU,
    where Inductor compiles the emulated GEMMs too)."""
    names = re.findall(r"torch\.ops\.fp8fx\.(\w+)\.default\(", "\n".join(code))
    return {name: names.count(name) for name in sorted(set(names))}


def child(args) -> None:
    """Run one variant and write its result (or its error) as JSON to --result."""
    try:
        result = dict(status="ok", **run_variant(args.child, args))
    except Exception as e:  # noqa: BLE001 - the parent turns it into an error row
        tb = traceback.format_exc().rstrip().splitlines()
        result = dict(status="error", error=dict(type=type(e).__name__, message=str(e)[:2000], traceback=tb[-15:]))
    with open(args.result, "w") as f:
        json.dump(result, f, default=str)


# --- the parent: a process per variant, then the table -----------------------------------------------


def child_command(name: str, args, result: str) -> list[str]:
    """The child's command line: the resolved shapes and training options, never --tiny or --json."""
    opts = ["model", *SHAPES, "steps", "warmup", "inner", "device", "dtype", "optimizer", "lr", "seed", "save_code"]
    flags = [x for key in opts if getattr(args, key) is not None for x in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]
    return [sys.executable, os.path.abspath(__file__), *flags, *(["--memory"] if args.memory else []), "--child", name, "--result", result]


def launch(name: str, args) -> dict:
    """Run one variant's process and read its result. A crash or timeout becomes an error, with the
    last lines of the child's output in place of a traceback."""
    with tempfile.TemporaryDirectory(prefix="llama_gpu_") as tmp:
        result = os.path.join(tmp, "result.json")
        # A fresh cache per variant: every first step is a cold compile, and no variant reuses another's kernels.
        caches = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"), "TRITON_CACHE_DIR": os.path.join(tmp, "triton")}
        proc = subprocess.Popen(child_command(name, args, result), env={**os.environ, **caches}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        try:
            output = proc.communicate(timeout=args.timeout)[0]
            failure = "ChildCrashed", f"exit code {proc.returncode}, no result"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the child and its compile workers
            output = proc.communicate()[0]
            failure = "Timeout", f"killed after {args.timeout:g} s"
        except BaseException:  # this process stopped (parent's SIGTERM): no child left running on the GPU
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        if os.path.exists(result):  # (also when it hung after writing it)
            with open(result) as f:
                return json.load(f)
    tail = output.rstrip().splitlines()[-15:]
    return dict(status="error", error=dict(type=failure[0], message=failure[1], traceback=tail))


def largest_batch(peak_of, base: int, cap: float) -> tuple[int | None, dict[int, float | None]]:
    """The largest multiple of `base` whose `peak_of(batch)` (bytes; None: the run failed, as an
    out-of-memory error does) is at most `cap` (None when `base` is over it), and each batch tried
    with its peak. The peak is taken to grow with the batch: the search keeps the largest multiple
    known to fit and the smallest known not to, and tries `next_multiple` between them."""
    peaks: dict[int, float | None] = {}
    fit, over, m = 0, None, 1  # multiples of `base`
    while m:
        peaks[m] = peak_of(m * base)
        if peaks[m] is not None and peaks[m] <= cap:
            fit = m
        else:
            over = m
        m = next_multiple(peaks, fit, over, cap)
    return fit * base or None, {k * base: p for k, p in sorted(peaks.items())}


def next_multiple(peaks: dict[int, float | None], fit: int, over: int | None, cap: float) -> int:
    """The next multiple to try, strictly between `fit` and `over` (0: none is left). A peak grows
    about linearly with the batch, and each try is a cold compile: the third and fourth tries take
    the line through the peaks at 1 and `fit` to where it meets the cap (then one step past it, to
    find the end); the others, or where the line leads outside, double `fit` or bisect."""
    if fit == 0 or (over is not None and over - fit <= 1):
        return 0
    if 1 < fit and len(peaks) <= 3 and peaks[fit] > peaks[1]:  # (only twice: no walk of single steps)
        guess = max(fit + 1, fit + int((cap - peaks[fit]) * (fit - 1) // (peaks[fit] - peaks[1])))
        if over is None or guess < over:
            return guess
    return 2 * fit if over is None else (fit + over) // 2


def cap_search(name: str, args, first: dict) -> dict:
    """`largest_batch` under --memory-cap for one variant, whose run at --batch was `first`; each
    other batch a run of the variant in its own process (the module's docstring says why). Returns
    `cap_batch`, its peak and tokens per second, and every run's batch, status, peak and step."""
    runs = {args.batch: first}

    def peak_of(batch: int) -> int | None:
        if batch not in runs:
            print(f"batch {batch} ...", end=" ", file=sys.stderr, flush=True)
            # (no code saved, no allocator trace: they would replace the first run's)
            runs[batch] = launch(name, argparse.Namespace(**dict(vars(args), batch=batch, save_code=None, memory=False)))
            print(runs[batch]["status"], file=sys.stderr, flush=True)
        return runs[batch].get("peak_memory_bytes")

    batch, _ = largest_batch(peak_of, args.batch, args.memory_cap * 2**30)
    at = runs.get(batch, {})
    return dict(
        cap_batch=batch, cap_peak_bytes=at.get("peak_memory_bytes"),
        cap_tokens_per_s=batch * args.seq / at["step_ms"] * 1000 if batch else None,
        cap_runs=[dict(batch=b, status=r["status"], peak_memory_bytes=r.get("peak_memory_bytes"), step_ms=r.get("step_ms"))
                  for b, r in sorted(runs.items())],
    )  # fmt: skip


def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    """a[key] / b[key], None where either row lacks it (not run, failed, not measured)."""
    x, y = (a or {}).get(key), (b or {}).get(key)
    return x / y if x and y else None


def add_ratios(rows: list[dict], earlier: list[dict] = ()) -> None:
    """Speedup (BF16 step / variant step) and peak memory ratio (variant / BF16); a variant with
    -savedfp8 or -o2 against the same variant without them (`plain`: step and peak ratios); with
    --memory-cap, the largest batch over BF16's and an fp8fx variant's tokens per second there over
    torchao's (same recipe) at its own largest batch. The rows set against are this run's, else
    those of `earlier` (--beside: every variant runs in a process of its own anyway)."""
    ok = {r["name"]: r for r in [*earlier, *rows] if r["status"] == "ok"}
    base = ok.get("bf16")
    for r in rows:
        r["speedup_vs_bf16"] = ratio(base, r, "step_ms")
        r["memory_vs_bf16"] = ratio(r, base, "peak_memory_bytes")
        stem, options = split_options(r["name"])
        if options & MEMORY_OPTIONS:
            plain = next((p for p in ok.values() if split_options(p["name"]) == (stem, options - MEMORY_OPTIONS)), None)
            r.update(plain=plain and plain["name"], step_vs_plain=ratio(r, plain, "step_ms"),
                     memory_vs_plain=ratio(r, plain, "peak_memory_bytes"))  # fmt: skip
        if "cap_batch" in r:
            torchao = ok.get(f"torchao-{r['recipe']}") if r["kind"] == "fp8fx" else None
            r["cap_batch_vs_bf16"] = ratio(r, base, "cap_batch")
            r["cap_tokens_per_s_vs_torchao"] = ratio(r, torchao, "cap_tokens_per_s")


def add_bounds(rows: list[dict]) -> None:
    """Each FP8 row's bound and its fraction of it (bound / step; the module's docstring says how),
    from this run's BF16 row; a torchao row takes the GEMMs of fp8fx's recipe of the same name."""
    base = next((r for r in rows if r["name"] == "bf16" and r["status"] == "ok"), None)
    by_recipe = {r["recipe"]: r["gemm_bound_ms"] for r in rows if r["kind"] == "fp8fx" and r.get("gemm_bound_ms") is not None}
    for r in rows:
        gemms = r.get("gemm_bound_ms") if r["kind"] == "fp8fx" else by_recipe.get(r["recipe"]) if r["kind"] == "torchao" else None
        ok = base is not None and r["status"] == "ok" and gemms is not None
        r["bound_ms"] = base["step_ms"] - base["profile"]["gemm_ms"] + gemms if ok else None
        r["fraction_of_bound"] = r["bound_ms"] / r["step_ms"] if ok else None


def memory_estimate(args) -> dict:
    """An upper estimate of a step's peak memory in bytes: weights, their gradients and AdamW's two
    moments (in --dtype); the activations autograd saves, per token and layer 6 hidden-wide tensors,
    k and v, and 3 MLP-wide ones (in --dtype); the logits with their fp32 copy and its gradient.
    It counts every gradient and every saved activation alive at once, which no step reaches: 9.9
    GiB for the 2-layer Llama-3-8B step whose BF16 peak measured 8.00 GiB (docs/results.md). Returns
    the parameter count, `bytes`, and its `fixed_bytes` and `layer_bytes` (bytes = fixed + layers x layer)."""

    def params(layers: int) -> int:
        shapes_only = build_model(argparse.Namespace(**{**vars(args), "layers": layers}), torch.device("meta"))
        return sum(p.numel() for p in shapes_only.parameters())

    size = getattr(torch, args.dtype).itemsize
    per_param = size * (2 if args.model == "te-layer" or args.optimizer == "sgd" else 4)
    tokens = args.batch * args.seq
    saved = tokens * size * (6 * args.hidden + 2 * args.kv_heads * args.head_dim + 3 * args.intermediate)
    p0, p1 = params(0), params(1)
    fixed, layer = per_param * p0 + tokens * args.vocab * (size + 8), per_param * (p1 - p0) + saved
    return dict(params=p0 + args.layers * (p1 - p0), bytes=fixed + args.layers * layer, fixed_bytes=fixed, layer_bytes=layer)


def fmt(x, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def status_text(r: dict) -> str:
    if r["status"] == "error":
        e = r["error"]
        msg = " ".join(e["message"].split())
        return f"error: {e['type']}: {msg[:160]}{'...' if len(msg) > 160 else ''}"
    return r.get("reason") or r["status"]


def markdown(rows: list[dict]) -> str:
    head = ("variant", "status", "final loss", "step ms", "speedup", "bound ms", "of bound", "first step s", "peak GiB", "mem / bf16",
            "FP8 GEMMs", "fused", "passes +/-", "fp8fx ops in code")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in rows:
        s = r.get("fp8fx_report") or {}
        cells = [
            r["name"], status_text(r).replace("|", "\\|"), fmt(r.get("final_loss"), ".4f"), fmt(r.get("step_ms"), ".1f"),
            fmt(r.get("speedup_vs_bf16"), ".2f") + ("x" if r.get("speedup_vs_bf16") else ""), fmt(r.get("bound_ms"), ".1f"),
            fmt(r.get("fraction_of_bound"), ".2f"), fmt(r.get("first_step_s"), ".1f"),
            fmt(r.get("peak_memory_bytes"), ".2f", 2**-30), fmt(r.get("memory_vs_bf16"), ".2f"),
            f"{s['fp8_gemms']}/{s['gemms']}" if s else "-", str(s["fused_epilogues"]) if s else "-",
            f"+{s['memory_passes_added']}/-{s['memory_passes_saved']}" if s else "-",
            ", ".join(f"{n} {k}" for n, k in r["fp8fx_ops_called"].items()) or "none" if "fp8fx_ops_called" in r else "-",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(rows: list[dict], cap: float | None) -> list[str]:
    """The lines under the table: the option variants against their plain ones, Fp8AdamW's step
    against torch's fused AdamW, and the largest batches under the memory cap."""

    def times(x: float | None, spec: str = ".2f") -> str:
        return fmt(x, spec) + ("x" if x else "")

    lines = []
    for r in rows:
        name = r["name"]
        if r.get("plain"):
            step, peak = times(r["step_vs_plain"], ".3f"), times(r["memory_vs_plain"], ".3f")
            lines.append(f"{name} against {r['plain']}: step {step}, peak {peak}")
        if r.get("optimizer_ms"):
            ms, fused = r["optimizer_ms"], r["fused_adamw_ms"]
            lines.append(f"{name}: {r['optimizer']} step {ms:.2f} ms, AdamW(fused=True) {fused:.2f} ms ({ms / fused:.2f}x)")
        if r.get("cap_runs"):
            runs = ", ".join(f"{t['batch']}: {fmt(t['peak_memory_bytes'], '.1f', 2**-30)} ({t['status']})" for t in r["cap_runs"])
            batch, tokens = fmt(r["cap_batch"], ".0f"), fmt(r["cap_tokens_per_s"], ".0f")
            vs_bf16, vs_torchao = times(r["cap_batch_vs_bf16"]), times(r["cap_tokens_per_s_vs_torchao"])
            lines.append(f"{name}: largest batch under {cap:g} GiB {batch} ({vs_bf16} bf16's), {tokens} tokens/s ({vs_torchao} "
                         f"torchao's at its own); peak GiB by batch: {runs}")  # fmt: skip
    return lines


def write_json(args, env: dict, estimate: dict, rows: list[dict]) -> None:
    if not args.json:
        return
    config = {k: v for k, v in vars(args).items() if k not in ("child", "result", "json")}
    with open(args.json, "w") as f:
        json.dump(dict(env=env, config=config, memory_estimate=estimate, variants=rows), f, indent=2, default=str)


def parent(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("llama_gpu.py: no CUDA GPU found (torch.cuda.is_available() is False); use --device cpu --tiny", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # launch then stops the variant's process
    env = environment(args.device)
    estimate = memory_estimate(args)
    if env["gpu"]:
        total = torch.cuda.get_device_properties(0).total_memory
        estimate.update(gpu_bytes=total, layers_that_fit=(total - estimate["fixed_bytes"]) // estimate["layer_bytes"])
    fit = f"; {estimate['layers_that_fit']} layers would fit in this GPU's {estimate['gpu_bytes'] / 2**30:.0f} GiB" if env["gpu"] else ""
    print(f"memory estimate: {estimate['bytes'] / 2**30:.1f} GiB for {args.layers} layers, {estimate['params'] / 1e9:.2f} B parameters{fit}",
          flush=True)  # fmt: skip
    earlier = []
    if args.beside:  # (a script's earlier stage may have been skipped)
        try:
            with open(args.beside) as f:
                earlier = json.load(f)["variants"]
        except FileNotFoundError:
            print(f"--beside {args.beside}: no such file; ratios from this run's rows alone", file=sys.stderr)
    rows = []
    for name in args.variants or default_variants(args):
        kind, recipe, kernels = parse_variant(name)
        row = dict(name=name, kind=kind, recipe=recipe, kernels=kernels, inner=args.inner)
        reason = skip_reason(name, env)
        if reason:
            rows.append(dict(row, status="skipped", reason=reason))
        else:
            print(f"{name} ...", end=" ", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            rows.append(dict(row, **launch(name, args), wall_s=time.perf_counter() - t0))
            print(f"{rows[-1]['status']} ({rows[-1]['wall_s']:.0f} s)", file=sys.stderr, flush=True)
            if args.memory_cap and env["gpu"] and rows[-1]["status"] == "ok":
                rows[-1].update(cap_search(name, args, rows[-1]))
        add_ratios(rows, earlier)
        add_bounds(rows)
        write_json(args, env, estimate, rows)  # after each variant: a run cut short keeps what it measured
    where = f"{env['gpu']} (sm_{env['capability'].replace('.', '')})" if env["gpu"] else "CPU"
    step = "forward + backward, no optimizer" if args.model == "te-layer" else args.optimizer
    print(f"{args.model} shapes: {args.layers} layers, hidden {args.hidden}, MLP {args.intermediate}, {args.heads} heads / {args.kv_heads} KV "
          f"x {args.head_dim}, vocab {args.vocab}, batch {args.batch} x seq {args.seq}, {args.dtype}, {step}; "
          f"{args.warmup} warm-up + {args.steps} timed steps, inner={args.inner}; {where}, torch {env['torch']}\n")  # fmt: skip
    if args.model == "te-layer":
        print(TE_PUBLISHED + "\n")
    print(markdown(rows))
    cpu_cap = ["--memory-cap: not measured on CPU (no peak memory there)"] if args.memory_cap and not env["gpu"] else []
    lines = [*notes(rows, args.memory_cap), *cpu_cap]
    if lines:
        print("\n" + "\n".join(lines))
    if args.json:
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0 if all(r["status"] != "error" for r in rows) else 1


# --- options --------------------------------------------------------------------------------------


def csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", choices=list(MODELS), help="whose layer shapes (and architecture) the model has")
    for key in SHAPES:
        tiny = f" ({TINY[key]} with --tiny)" if key in TINY else ""
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"default: --model's{tiny}")
    ap.add_argument("--tiny", action="store_true", help="the model tiny (hidden 64, seq 32, vocab 128) for a CPU smoke test")
    ap.add_argument("--steps", type=int, default=10, help="timed steps, after the warm-up steps")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps, the first (compile) included; at least 1")
    ap.add_argument("--recipes", type=csv, default=list(RECIPES),
                    help="fp8fx recipes (default: all; a recipe the GPU cannot run is a skipped row)")
    ap.add_argument("--kernels", type=csv, help="fp8fx kernels choices (default auto,triton,scaled_mm on CUDA, auto on CPU)")
    ap.add_argument("--inner", default="inductor", choices=list(PLAIN_BACKEND))
    ap.add_argument("--variants", type=csv, help="run only these variants (comma-separated names; cudagraphs: every recipe under CUDA graphs)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="weights' dtype (default bfloat16, float32 on CPU)")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per variant process")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON (default $OUT/llama_gpu.json when OUT is set)")
    ap.add_argument("--memory", action="store_true", help="one more step with the CUDA allocator's history: what is alive at its peak")
    ap.add_argument("--save-code", metavar="DIR", help="write each variant's Inductor output code to DIR/<variant>.py")
    ap.add_argument("--beside", metavar="JSON", help="an earlier run's --json: rows the ratios may take (bf16, plain variants)")
    cap_help = "also the largest multiple of --batch whose step peaks under GIB, and its tokens/s (a run per batch; CUDA only)"
    ap.add_argument("--memory-cap", type=float, metavar="GIB", help=cap_help)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    defaults = {**MODELS[args.model], **(TINY if args.tiny else {})}
    for key in SHAPES:
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    if args.model == "te-layer":  # GPT layers: every head has its K and V, and there is no vocabulary
        args.kv_heads, args.vocab = args.heads, 0
    if args.variants == ["cudagraphs"]:
        args.variants = cudagraph_variants()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.kernels = args.kernels or (["auto", "triton", "scaled_mm"] if args.device == "cuda" else ["auto"])
    if args.json is None and os.environ.get("OUT") and not args.child:
        args.json = os.path.join(os.environ["OUT"], "llama_gpu.json")
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be at least 1 (the first warm-up step compiles)")
    try:
        for name in [*(args.variants or []), *([args.child] if args.child else []), *default_variants(args)]:
            parse_variant(name)
    except ValueError as e:
        ap.error(str(e))
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    sys.exit(parent(args))


if __name__ == "__main__":
    main()
