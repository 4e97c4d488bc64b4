"""First-step (compile + run) time of tiny `transformers` architectures: fp8fx vs the plain
backend with the same inner compiler, each run in a fresh process.

Run: python bench/compile_time.py [--only llama,gpt2,vit] [--inner eager|inductor|both]
         [--recipes default,tensorwise,delayed,...] [--profile] [--repeats N] [--torchao]
Each (architecture, backend) pair runs one training step in its own process with Inductor's and
AOTAutograd's caches off and an empty Inductor / Triton cache directory (no C++ or Triton build reused), after a one-Linear warm-up compile with the plain backend (toolchain
probe, imports), so import and warm-up costs fall alike on both sides. The models are those of
`bench/architectures.py` (hidden 64, 2 layers, random weights). Prints seconds per first step
and fp8fx's ratio to the plain backend (the project's target: at most 1.15x with Inductor), one row
per named recipe in --recipes ("default": fp8fx's default policy); with --repeats N, the medians
of N interleaved runs of each. --torchao adds torchao's float8 training (emulate mode, tensorwise) with the
same inner compiler, and fp8fx's ratio to it (the GPU target: a first step at most torchao's). --profile adds where fp8fx's first step goes (and plain's): Dynamo's tracing, fp8fx's passes, and
Inductor's forward / backward compiles and C++ builds (from `torch._dynamo.utils.compile_times`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLAIN = {"eager": "aot_eager", "inductor": "inductor"}


# Phases reported by --profile: ours (timed around fp8fx's functions) and Dynamo's / Inductor's own.
TORCH_PHASES = {
    "dynamo trace": "bytecode_tracing",
    "backend": "OutputGraph.call_user_compiler",
    "inductor fw": "compile_fx.<locals>.fw_compiler_base",
    "inductor bw": "compile_fx.<locals>.bw_compiler",
    "c++/triton build": "compile_file",
}


def _timed(owner, attr: str, spent: dict, phase: str) -> None:
    original = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[phase] = spent.get(phase, 0.0) + time.perf_counter() - start

    setattr(owner, attr, wrapper)


def child(name: str, backend_name: str, inner: str, recipe: str) -> dict:
    """One first step in this process: its seconds and, for fp8fx, the time of each phase."""
    import warnings

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import architectures
    import transformers

    import fp8fx

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    lin = torch.nn.Linear(16, 16)
    torch.compile(lin, backend=PLAIN[inner])(torch.randn(4, 16)).sum().backward()
    torch._dynamo.reset()

    model_type, auto, overrides, kind = architectures.ARCHITECTURES[name]
    model = architectures.build(model_type, auto, overrides).train()
    inputs = architectures.make_inputs(kind, model.config)
    spent: dict[str, float] = {}
    if backend_name == "fp8fx":
        from fp8fx.compiler import backend as fp8fx_backend

        _timed(fp8fx_backend, "run_passes", spent, "fp8fx passes")
        policy = None if recipe == "default" else fp8fx.Policy.from_recipe(recipe)
        if policy is not None and policy.uses_delayed_scaling:
            fp8fx.prepare(model)
        backend = fp8fx.backend(policy=policy, inner=inner)
    else:
        backend = PLAIN[inner]
    if backend_name == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    compiled = torch.compile(model, backend=backend)
    torch._dynamo.utils.reset_frame_count()
    start = time.perf_counter()
    architectures.step(compiled, inputs)
    seconds = time.perf_counter() - start
    times = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    torch_phases = dict(zip(times[0], times[1])) if times and len(times) == 2 else {}
    for phase, key in TORCH_PHASES.items():
        spent[phase] = float(torch_phases.get(key, 0.0))
    return {"seconds": seconds, "phases": spent}


def first_step(name: str, backend_name: str, inner: str, recipe: str = "default") -> dict:
    with tempfile.TemporaryDirectory() as cache:  # no C++ or Triton build reused from an earlier process
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache}
        out = subprocess.run(
            [sys.executable, __file__, "--child", name, backend_name, inner, recipe],
            check=False,
            capture_output=True,
            text=True,
            env=env,
        )
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{name} {backend_name} inner={inner} recipe={recipe}: {last}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _phases(results: list[dict]) -> str:
    """Median seconds per compile phase over the runs, the phases that took any time."""
    medians = {phase: statistics.median(r["phases"][phase] for r in results) for phase in results[0]["phases"]}
    return ", ".join(f"{phase} {s:.2f}s" for phase, s in medians.items() if s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="llama,gpt2,vit", help="comma-separated names from bench/architectures.py")
    parser.add_argument("--inner", default="both", choices=["eager", "inductor", "both"])
    parser.add_argument("--recipes", default="default", help="comma-separated named recipes, or default (fp8fx's default policy)")
    parser.add_argument("--profile", action="store_true", help="print where each fp8fx first step's time goes")
    parser.add_argument("--repeats", type=int, default=1, help="first steps per (backend, recipe); prints the medians")
    parser.add_argument("--torchao", action="store_true", help="time torchao's float8 emulate mode too")
    parser.add_argument("--child", nargs=4, metavar=("NAME", "BACKEND", "INNER", "RECIPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return

    inners = ["eager", "inductor"] if args.inner == "both" else [args.inner]
    recipes = args.recipes.split(",")
    torchao_col = f" {'torchao s':>9} {'/torchao':>8}" if args.torchao else ""
    print(f"{'architecture':<13} {'inner':<9} {'recipe':<14} {'plain s':>8} {'fp8fx s':>8} {'ratio':>6}{torchao_col}")
    for name in args.only.split(","):
        for inner in inners:
            # Repeats interleave the runs, so a slow spell of the machine falls on both sides.
            runs = {recipe: [] for recipe in ["plain", *(["torchao"] if args.torchao else []), *recipes]}
            for _ in range(args.repeats):
                for recipe, results in runs.items():
                    backend_name = recipe if recipe in ("plain", "torchao") else "fp8fx"
                    results.append(first_step(name, backend_name, inner, "default" if backend_name != "fp8fx" else recipe))
            plain_runs = runs.pop("plain")
            plain = statistics.median(r["seconds"] for r in plain_runs)
            torchao = statistics.median(r["seconds"] for r in runs.pop("torchao")) if args.torchao else None
            if args.profile:
                print(f"{name:<13} {inner:<9} plain: {_phases(plain_runs)}", flush=True)
            for recipe, results in runs.items():
                seconds = statistics.median(r["seconds"] for r in results)
                vs_torchao = f" {torchao:>9.1f} {seconds / torchao:>8.2f}" if torchao is not None else ""
                print(f"{name:<13} {inner:<9} {recipe:<14} {plain:>8.1f} {seconds:>8.1f} {seconds / plain:>6.2f}{vs_torchao}", flush=True)
                if args.profile:
                    print(f"    {_phases(results)}", flush=True)
    print("target: fp8fx / plain <= 1.15 with inner=inductor")


if __name__ == "__main__":
    main()
