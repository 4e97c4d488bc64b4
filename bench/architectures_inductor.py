"""FP8 training steps under Inductor over the architectures `transformers` ships (tiny, random weights).

Run: python bench/architectures_inductor.py [--only llama,gpt2] [--recipes tensorwise,rowwise] [--cublas] [--json OUT]
Each architecture of bench/architectures.py (same configs and inputs), in BF16, takes one training
step compiled by fp8fx with inner="inductor" (with --cublas, the graph a GPU runs: cuBLAS GEMMs as
`aten._scaled_mm`, compiled by Inductor's CPU backend), and the same step with inner="eager", which
runs the `fp8fx::` ops one by one. Both are measured against the step of the FP32 model without FP8
(dropout off: Inductor draws other random numbers than eager). Prints per architecture and recipe
the lowest gradient SQNR under Inductor and the drop, in dB, from eager's SQNR for the same
parameter, mean and largest over the parameters (parameters whose exact gradient is zero but for rounding, such as a key projection's bias, are left
out).
Where fp8fx's Inductor step fails, plain `torch.compile` of the BF16 step runs too, so a failure of
Inductor itself is told apart from one of fp8fx.
"""

from __future__ import annotations

import argparse
import copy
import json
import warnings

import torch
from architectures import ARCHITECTURES, build, make_inputs, one_line, step

import fp8fx


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    noise = (ref - x).pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(ref.pow(2).sum() / noise))


def grads(model, fn, inputs) -> dict[str, torch.Tensor]:
    step(fn, inputs)
    return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def compiled_grads(model, inputs, backend) -> dict[str, torch.Tensor]:
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    return grads(model, torch.compile(model, backend=backend), inputs)


def measure(name: str, recipes: list[str], cublas_devices: tuple[str, ...] = ("cuda",)) -> dict:
    model_type, auto, overrides, kind = ARCHITECTURES[name]
    model = build(model_type, auto, overrides).eval()
    inputs = make_inputs(kind, model.config)
    exact = grads(model, model, inputs)
    model = model.bfloat16()
    inputs = {k: v.bfloat16() if v.is_floating_point() else v for k, v in inputs.items()}
    norms = {k: float(g.norm()) for k, g in exact.items()}
    nonzero = [k for k, n in norms.items() if n > 1e-5 * max(norms.values())]
    rows = {}
    for recipe in recipes:
        policy = fp8fx.Policy.from_recipe(recipe)
        try:
            eager = compiled_grads(model, inputs, fp8fx.backend(policy=policy, inner="eager"))
            backend = fp8fx.backend(policy=policy, inner="inductor", cublas_devices=cublas_devices)
            inductor = compiled_grads(model, inputs, backend)
        except Exception as e:  # noqa: BLE001 - one line per failure, then plain Inductor to place it
            try:
                compiled_grads(model, inputs, "inductor")
                plain = "plain Inductor runs"
            except Exception as plain_error:  # noqa: BLE001
                plain = f"plain Inductor fails too: {one_line(plain_error)}"
            rows[recipe] = {"error": one_line(e), "plain": plain}
            continue
        lowest = min((sqnr_db(exact[k], inductor[k]), k) for k in nonzero)
        drops = [(sqnr_db(exact[k], eager[k]) - sqnr_db(exact[k], inductor[k]), k) for k in nonzero]
        rows[recipe] = {"fp8_gemms": len(fp8fx.report(backend).fp8_ops), "lowest_sqnr": lowest, "largest_drop": max(drops),
                        "mean_drop": sum(d for d, _ in drops) / len(drops)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated architecture names: " + ",".join(ARCHITECTURES))
    parser.add_argument("--recipes", default="tensorwise,rowwise")
    parser.add_argument("--cublas", action="store_true", help="lower cuBLAS GEMMs to aten._scaled_mm on CPU too, as on a GPU")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(ARCHITECTURES)
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        parser.error(f"unknown architecture(s) {', '.join(unknown)}; known: {', '.join(ARCHITECTURES)}")
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    results = {}
    for name in names:
        try:
            results[name] = measure(name, args.recipes.split(","), ("cuda", "cpu") if args.cublas else ("cuda",))
        except Exception as e:  # noqa: BLE001 - the model did not build or run without FP8
            results[name] = {"error": one_line(e)}
            print(f"{name:<14} error: {one_line(e)}", flush=True)
            continue
        for recipe, r in results[name].items():
            if "error" in r:
                print(f"{name:<14} {recipe:<11} error: {r['error']} ({r['plain']})", flush=True)
            else:
                (low, low_at), (drop, drop_at) = r["lowest_sqnr"], r["largest_drop"]
                print(f"{name:<14} {recipe:<11} {r['fp8_gemms']:>3} FP8 GEMMs  lowest SQNR {low:5.1f} dB ({low_at})  "
                      f"drop from eager: mean {r['mean_drop']:+4.1f} dB, largest {drop:+4.1f} dB ({drop_at})", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
