"""What Inductor runs of fp8fx's FP8 work in a Llama training step, countable on any machine.

Run: python bench/fusion_counts.py [--layers 1 --hidden 256 --intermediate 512 --seq 128 --batch 4]
         [--recipes tensorwise,rowwise] [--device cpu|cuda] [--kernels auto|triton|scaled_mm] [--json OUT]
     TRITON_INTERPRET=1 python bench/fusion_counts.py --kernels triton   # the GEMMs a GPU runs, on CPU

Per recipe, one training step compiled with `inner="inductor"` (caches off): the fp8fx ops
Inductor's generated code calls, by name (targets: none but GEMMs on a GPU; none at all on CPU,
where Inductor compiles the emulated GEMMs too), and the memory passes FP8 adds (a kernel's read or
write of an operand-sized tensor), counted from the kernels Inductor made (the report's
`memory_passes_added`) beside the same count for the ops run one by one (what the graph would
cost with every amax, scale and cast a kernel of its own, as before Inductor compiled them); both
include the copies of GEMM operands that are not K-contiguous. On CPU a copy of a tensor that
is not cast in the graph (an FP8 tensor forward saved for backward) fuses into the emulated GEMM
reading it and costs nothing; under Triton's interpreter with `--kernels triton` the GEMMs stay
whole, as on a GPU, and the copies are kernels of their own.
"""

from __future__ import annotations

import argparse
import json

import torch
from llama_gpu import fp8fx_ops_called
from torch._inductor.utils import run_and_get_code

import fp8fx


def count(recipe: str, args) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab, use_cache=False)  # fmt: skip
    model = LlamaForCausalLM(cfg).to(args.device)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    backend = fp8fx.backend(policy=fp8fx.Policy.from_recipe(recipe), inner="inductor", kernels=args.kernels)
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
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    rows = [count(recipe, args) for recipe in args.recipes.split(",")]
    print(f"Llama {args.layers} layer(s), hidden {args.hidden}, batch {args.batch} x seq {args.seq}, {args.device}")
    print(f"{'recipe':<12} {'FP8 GEMMs':>9} {'passes (Inductor)':>18} {'of which copies':>16} {'passes (one by one)':>20}  "
          "fp8fx ops in Inductor's code")  # fmt: skip
    for r in rows:
        ops = ", ".join(f"{n} {k}" for n, k in r["fp8fx_ops_called"].items()) or "none"
        print(f"{r['recipe']:<12} {r['fp8_gemms']:>9} {r['memory_passes_added']:>18} {r['transposed_copies']:>16} "
              f"{r['memory_passes_one_by_one']:>20}  {ops}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
