"""How closely two correct FP8 implementations of one training step agree, and how each compares
with the fp32 step: the measurement behind `fp8fx selftest`'s step check (STEP_SQNR_MARGIN_DB).

Run: python bench/step_agreement.py [--recipes tensorwise,rowwise] [--dtype bfloat16]

The selftest's model (a GPT block, then a Llama block) at the selftest's GPU step size, one
forward + backward on the CPU (exact FP8 emulation, `inner="eager"`), three ways: the fp32 model
without FP8, fp8fx with fused epilogues (the epilogue in fp32, as the generated kernel runs it),
and fp8fx with `fuse_epilogues=False` (the GEMM's output rounded to the model's dtype before the
epilogue, as cuBLAS's rowwise GEMM returns BF16). Prints, per output and gradient, the SQNR of
fused against unfused, and of each against fp32; then the minimum and the largest difference
between the two against fp32.
"""

from __future__ import annotations

import argparse

import torch

import fp8fx
from fp8fx.tools.selftest import GPU_STEP_DIMS, SelftestModel, sqnr_db


def step(backend, dtype: torch.dtype, seed: int = 0) -> tuple[list[torch.Tensor], list[str]]:
    dims = GPU_STEP_DIMS
    torch.manual_seed(seed)
    model = SelftestModel(dims).to(dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(dims.batch, dims.seq, dims.dim, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(dims.batch, dims.seq, dims.dim, generator=g).to(dtype)
    out = (torch.compile(model, backend=backend) if backend else model)(x)
    out.backward(dy)
    torch._dynamo.reset()
    return [out.detach(), x.grad, *(p.grad for p in model.parameters())], ["output", "input.grad", *(n for n, _ in model.named_parameters())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="tensorwise,rowwise")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    exact, names = step(None, torch.float32)
    for recipe in args.recipes.split(","):
        policy = fp8fx.Policy.from_recipe(recipe)
        fused, _ = step(fp8fx.backend(policy=policy, inner="eager", kernels="scaled_mm"), dtype)
        unfused, _ = step(fp8fx.backend(policy=policy, inner="eager", kernels="scaled_mm", fuse_epilogues=False), dtype)
        rows = [(n, sqnr_db(f, u), sqnr_db(f, e), sqnr_db(u, e)) for n, f, u, e in zip(names, fused, unfused, exact)]
        print(f"\n{recipe} ({args.dtype}): SQNR dB   fused vs unfused | fused vs fp32 | unfused vs fp32")
        for name, *dbs in rows:
            print(f"  {name:28s} " + " ".join(f"{d:8.1f}" for d in dbs))
        print(f"  {'minimum':28s} " + " ".join(f"{min(r[i] for r in rows):8.1f}" for i in (1, 2, 3)))
        print(f"  largest |fused - unfused| against fp32: {max(abs(r[2] - r[3]) for r in rows):.2f} dB")


if __name__ == "__main__":
    main()
