"""What Inductor runs of fp8fx's FP8 work in a Llama training step, countable on any machine.

Run: python bench/fusion_counts.py [--layers 1 --hidden 256 --intermediate 512 --seq 128 --batch 4]
         [--recipes tensorwise,rowwise,torchao-tensorwise,torchao-rowwise] [--device cpu|cuda] [--kernels auto|triton|scaled_mm] [--json OUT]
     TRITON_INTERPRET=1 python bench/fusion_counts.py --kernels triton   # the GEMMs a GPU runs, on CPU
     python bench/fusion_counts.py --cublas   # the graph a GPU's cuBLAS GEMMs make (aten._scaled_mm), on CPU

Per recipe, one training step compiled with `inner="inductor"` (caches off): the fp8fx ops
Inductor's generated code calls, by name (targets: none but GEMMs on a GPU; none at all on CPU,
where Inductor compiles the emulated GEMMs too), and the memory passes FP8 adds (a kernel's read or
write of an operand-sized tensor), counted from the kernels Inductor made (the report's
`memory_passes_added`) beside the same count for the ops run one by one (what the graph would
cost with every amax, scale and cast a kernel of its own, as before Inductor compiled them); both
include the copies of GEMM operands that are not K-contiguous. On CPU a copy of a tensor that
is not cast in the graph (an FP8 tensor forward saved for backward) fuses into the emulated GEMM
reading it and costs nothing; under Triton's interpreter with `--kernels triton` the GEMMs stay
whole, as on a GPU, and the copies are kernels of their own. With `--cublas` the GEMMs that a GPU
gives to cuBLAS become `aten._scaled_mm` calls, as on a GPU (torch's CPU `_scaled_mm` runs them), and
every cast and layout copy feeding them is a kernel of its own: the count closest to a GPU's that a
CPU can make (Inductor's CPU code fuses much as its GPU code does, not exactly). A recipe named
torchao-<recipe> counts torchao's float8 training of the same model alike (`torchao_charge`): its
GEMMs `_scaled_mm` calls with --cublas, emulated otherwise. The project's target: at most torchao's.

`--scheduler triton` (with --cublas) counts the kernels Inductor's Triton scheduler makes of each
graph, as for a GPU, on CPU tensors: Inductor's Triton backend schedules and fuses them, and the
count is taken when it would generate their code (a CPU has no Triton driver to build them, so
nothing runs). One compile per model: its forward graph, once scheduled, is compiled by Inductor's
C++ backend, whose run lets the backward graph compile and be scheduled. Its rows also give
`amax_passes` (forward, backward): the kernels computing an amax and no cast that read an
operand-sized tensor. A recipe with delayed scaling (delayed, megatron) gets `fp8fx.prepare(model)`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import unittest.mock

import torch
from llama_gpu import fp8fx_ops_called
from torch._inductor.utils import run_and_get_code

import fp8fx
from fp8fx.compiler.memory_passes import MemoryPassCounts, computes, counting
from fp8fx.core.formats import FP8_DTYPES


def llama(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab, use_cache=False)  # fmt: skip
    model = LlamaForCausalLM(cfg).to(args.device)
    return model, torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)


def torchao_charge(part) -> tuple[str, str] | None:
    """A scheduled node is torchao's FP8 work where it writes an FP8 tensor (a cast or a copy of
    one) or is an amax (a reduction of an `abs`), from ops traced in torchao's float8 code (their
    stack traces say so; a view inlined into a model's kernel computes nothing there)."""
    node = getattr(part, "node", None)
    if node is None:
        return None
    origins = [o for o in node.get_origins() if "torchao/float8/" in (o.meta.get("stack_trace") or "") and computes(o)]
    amax = part.is_reduction() and any(o.target is torch.ops.aten.abs.default for o in origins)
    fp8 = getattr(node, "get_dtype", lambda: None)() in FP8_DTYPES
    return ("torchao", "float8") if origins and (amax or fp8) else None


def operand_numel(model, args) -> int:
    """The elements of the smallest operand of the model's linear layers' GEMMs."""
    tokens = args.batch * args.seq
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return min(n for m in linears for n in (m.weight.numel(), tokens * m.in_features, tokens * m.out_features))


def torchao_llama(recipe: str, args):
    """The Llama with torchao's float8 training of `recipe` (its GEMMs `_scaled_mm` calls with
    --cublas, as on a GPU; else emulated on CPU), and its input ids."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model, ids = llama(args)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=args.device == "cpu" and not args.cublas)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear))
    return model, ids


def count_torchao(recipe: str, args) -> dict:
    """The same count for torchao's float8 training (`torchao_llama`), charging the kernels that
    compute torchao's float8 code."""
    model, ids = torchao_llama(recipe, args)
    gemms = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    counts = MemoryPassCounts(charge=torchao_charge)
    compiled = torch.compile(model)
    with counting(counts, "forward", operand_numel(model, args) // 4):  # the operand size fp8fx's count uses
        compiled(input_ids=ids, labels=ids).loss.backward()
    return {"recipe": f"torchao-{recipe}", "fp8_gemms": 3 * len(gemms), "fp8fx_ops_called": {},
            "memory_passes_added": sum(counts.counts.values()), "transposed_copies": 0, "memory_passes_one_by_one": None}  # fmt: skip


class _Scheduled(Exception):
    """Raised where Inductor's Triton backend would generate the code of a graph it has scheduled."""


def amax_pass(kernel, min_numel: int) -> bool:
    """Whether a scheduled kernel computes an fp8fx amax but no cast, reading an operand-sized tensor: an amax
    pass of its own over a tensor that a cast's kernel reads too (a dynamic scale's pre-pass)."""
    from torch._inductor.virtualized import V

    from fp8fx.compiler.lowering import LOWERED_FROM

    made = {o.meta.get(LOWERED_FROM) for p in kernel.get_nodes() if p.node is not None for o in p.node.get_origins()}
    large = any(V.graph.sizevars.optimization_hint(d.get_numel(), fallback=0) >= min_numel for d in kernel.read_writes.reads)
    return "fp8fx::amax" in made and "fp8fx::cast" not in made and large


def gpu_realize_rule():
    """Inductor decides which values its kernels store and which each reader computes again by
    rules that differ on a CPU: there it stores any value several kernels read that computes exp,
    log, sigmoid or tanh (SiLU's backward reads its sigmoid twice), and it takes larger op and read
    counts (50 ops against 30) before storing a value. Within this context a CPU graph takes the
    GPU's rules: `ir.is_cpu`, which Inductor's IR module consults for these rules alone (torch 2.11
    to 2.13), says no."""
    from torch._inductor import ir

    return unittest.mock.patch.object(ir, "is_cpu", lambda _: False)


@contextlib.contextmanager
def scheduled_by_triton(counts: list):
    """Inside, each graph Inductor compiles is first scheduled by its Triton backend on CPU tensors,
    up to its fused kernels: the graph's passes (counted as the active `MemoryPassCounts` counts, into
    a fresh one) and generated kernels (each a Triton build and a launch on a GPU) are appended to
    `counts`, and that compile stops with `_Scheduled`. A forward graph is then compiled for real by
    the C++ backend (so that the step runs and its backward compiles); a backward graph is not."""
    import torch.utils._triton as triton_utils
    from torch._inductor import compile_fx, config
    from torch._inductor.scheduler import Scheduler

    from fp8fx.compiler import lowering, memory_passes

    def stop(scheduler):
        kernels = sum(not n.is_extern() for n in scheduler.nodes)
        if not memory_passes._active:  # no FP8 GEMM in the graph (N or K not a multiple of 16): nothing is counted
            counts.append((0, kernels, 0))
            raise _Scheduled
        active = memory_passes._active[-1]
        graph = MemoryPassCounts(charge=active.charge)
        graph.min_numel = active.min_numel
        graph.count(scheduler.nodes)
        amax_passes = sum(not n.is_extern() and amax_pass(n, graph.min_numel) for n in scheduler.nodes)
        counts.append((sum(graph.counts.values()), kernels, amax_passes))
        raise _Scheduled

    @contextlib.contextmanager
    def triton():
        # The backend hash names the driver (none on a CPU); no kernel is built, so any name does.
        with config.patch(cpu_backend="triton"), unittest.mock.patch.object(Scheduler, "codegen", stop), gpu_realize_rule(), \
                unittest.mock.patch.object(triton_utils, "triton_hash_with_backend", lambda: "cpu"):  # fmt: skip
            yield

    real_compile = compile_fx._compile_fx_inner

    # One hook for fp8fx's `compile_partitioned` and plain torch.compile alike: `compile_fx` binds `compile_fx_inner` as
    # a default argument (a patch of it would miss torch.compile), and `compile_fx_inner` looks `_compile_fx_inner` up
    # when called, handing it the graph it got.
    def schedule_then_compile(gm, example_inputs, **kwargs):
        if kwargs.get("is_backward"):
            with triton():
                return real_compile(gm, example_inputs, **kwargs)
        try:
            with triton():  # on a copy: Inductor's post-grad passes change the graph they compile
                real_compile(copy.deepcopy(gm), example_inputs, **kwargs)
        except Exception as e:  # Inductor wraps it
            if not _scheduled(e):
                raise
        return real_compile(gm, example_inputs, **kwargs)

    # A GEMM not given to cuBLAS stays whole, as a GPU's generated kernel, not the CPU's emulation (in the
    # forward graph the C++ backend compiles too: it is the graph counted).
    with unittest.mock.patch.object(compile_fx, "_compile_fx_inner", schedule_then_compile), \
            unittest.mock.patch.object(lowering, "_emulated", lambda a, b, gpu_kernel="scaled_mm": False):  # fmt: skip
        yield


def cublas_devices(args) -> tuple[str, ...]:
    """The backend option `cublas_devices`: with --cublas, the GEMMs a GPU gives cuBLAS are `aten._scaled_mm` on CPU too."""
    return ("cuda", "cpu") if args.cublas else ("cuda",)


def fp8fx_llama(recipe: str, args, **options):
    """The Llama, its input ids and the fp8fx backend of `recipe` (`options`: the backend's others); a recipe
    with delayed scaling gets its model a place for the amax histories and scales (`fp8fx.prepare`)."""
    model, ids = llama(args)
    policy = fp8fx.Policy.from_recipe(recipe)
    if policy.uses_delayed_scaling:
        fp8fx.prepare(model)
    options.setdefault("saved_activations", args.saved_activations)
    return model, ids, fp8fx.backend(policy=policy, inner="inductor", cublas_devices=cublas_devices(args), **options)


def count_triton_scheduled(recipe: str, args) -> dict:
    """The passes and kernels (forward, backward) of one training step's graphs, as Inductor's
    Triton backend fuses them (`scheduled_by_triton`): fp8fx's graphs with their cuBLAS GEMMs as
    `_scaled_mm`, or torchao's (`torchao-<recipe>`). One compile: the forward graph is scheduled,
    then compiled by the C++ backend and run; the backward graph is scheduled."""
    counts = []
    torchao = recipe.startswith("torchao-")
    if torchao:
        model, ids = torchao_llama(recipe.removeprefix("torchao-"), args)
        compiled = torch.compile(model)
    else:
        model, ids, backend = fp8fx_llama(recipe, args)
        compiled = torch.compile(model, backend=backend)
    with contextlib.ExitStack() as stack:
        if torchao:
            stack.enter_context(counting(MemoryPassCounts(charge=torchao_charge), "forward", operand_numel(model, args) // 4))
        stack.enter_context(scheduled_by_triton(counts))
        loss = compiled(input_ids=ids, labels=ids).loss
        assert len(counts) == 1, f"{recipe}: one forward graph expected, {len(counts)} scheduled"
        try:
            loss.backward()
        except Exception as e:  # Dynamo and Inductor wrap it
            if not _scheduled(e):
                raise
    assert len(counts) == 2, f"{recipe}: one backward graph expected, {len(counts) - 1} scheduled"
    fp8_gemms = 3 * sum(isinstance(m, torch.nn.Linear) for m in model.modules()) if torchao else len(fp8fx.report(backend).fp8_ops)
    return {"recipe": recipe, "fp8_gemms": fp8_gemms, "fp8fx_ops_called": None, "memory_passes_added": sum(c[0] for c in counts),
            "transposed_copies": 0, "memory_passes_one_by_one": None, "kernels": [c[1] for c in counts],
            "amax_passes": [c[2] for c in counts]}  # fmt: skip


def _scheduled(e: BaseException | None) -> bool:
    """Whether `e` is `_Scheduled`, or was raised while handling it."""
    while e is not None and not isinstance(e, _Scheduled):
        e = e.__cause__ or e.__context__
    return e is not None


def count(recipe: str, args) -> dict:
    if args.scheduler == "triton":
        return count_triton_scheduled(recipe, args)
    if recipe.startswith("torchao-"):
        return count_torchao(recipe.removeprefix("torchao-"), args)
    model, ids, backend = fp8fx_llama(recipe, args, kernels=args.kernels)
    compiled = torch.compile(model, backend=backend)

    def step():
        compiled(input_ids=ids, labels=ids).loss.backward()

    _, code = run_and_get_code(step)
    report = fp8fx.report(backend)
    one_by_one = sum(op.memory_passes_added or 0 for g in backend.graphs for op in g.ops)  # the records before Inductor's count
    return {
        "recipe": recipe,
        "fp8_gemms": len(report.fp8_ops),
        "fp8fx_ops_called": fp8fx_ops_called(code),
        "memory_passes_added": report.summary()["memory_passes_added"],
        "transposed_copies": sum(op.transposed_copies or 0 for op in report.fp8_ops),  # of those, the GEMMs' operand copies
        "counted_by": sorted({op.memory_passes_from for op in report.fp8_ops}),
        "memory_passes_one_by_one": one_by_one,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 1), ("hidden", 256), ("intermediate", 512), ("heads", 4), ("kv-heads", 2), ("vocab", 512),
                          ("seq", 128), ("batch", 4)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--recipes", default="tensorwise,rowwise")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kernels", default="auto", choices=["auto", "triton", "scaled_mm"])
    ap.add_argument("--cublas", action="store_true", help="lower cuBLAS GEMMs to aten._scaled_mm on CPU too, as on a GPU")
    ap.add_argument(
        "--scheduler",
        default="cpp",
        choices=["cpp", "triton"],
        help="triton (with --cublas): count the kernels of Inductor's Triton backend",
    )
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--saved-activations", choices=["fp8", "high"], help="fp8fx's backend option saved_activations")
    args = ap.parse_args()
    if args.scheduler == "triton" and not (args.cublas and args.device == "cpu"):
        ap.error("--scheduler triton counts the graph a GPU runs on CPU tensors: it needs --cublas and --device cpu")
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    rows = [count(recipe, args) for recipe in args.recipes.split(",")]
    gemms = "cuBLAS (aten._scaled_mm)" if args.cublas else f"kernels={args.kernels}"
    gemms += ", Triton's scheduler" if args.scheduler == "triton" else ""
    print(f"Llama {args.layers} layer(s), hidden {args.hidden}, batch {args.batch} x seq {args.seq}, {args.device}, {gemms}")
    print(f"{'recipe':<12} {'FP8 GEMMs':>9} {'passes (Inductor)':>18} {'of which copies':>16} {'passes (one by one)':>20}  "
          "fp8fx ops in Inductor's code")  # fmt: skip
    for r in rows:
        ops = "-" if r["fp8fx_ops_called"] is None else ", ".join(f"{n} {k}" for n, k in r["fp8fx_ops_called"].items()) or "none"
        one_by_one = "-" if r["memory_passes_one_by_one"] is None else r["memory_passes_one_by_one"]
        kernels = f"  (kernels: forward {r['kernels'][0]}, backward {r['kernels'][1]})" if "kernels" in r else ""
        print(f"{r['recipe']:<12} {r['fp8_gemms']:>9} {r['memory_passes_added']:>18} {r['transposed_copies']:>16} "
              f"{one_by_one:>20}  {ops}{kernels}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
