"""First-step (compile + run) time of tiny `transformers` architectures: fp8fx vs the plain
backend with the same inner compiler, each run in a fresh process.

Run: python bench/compile_time.py [--only llama,gpt2,vit] [--inner eager|inductor|both]
Each (architecture, backend) pair runs one training step in its own process with Inductor's and
AOTAutograd's caches off, after a one-Linear warm-up compile with the plain backend (toolchain
probe, imports), so import and warm-up costs fall alike on both sides. The models are those of
`bench/architectures.py` (hidden 64, 2 layers, random weights). Prints seconds per first step
and fp8fx's ratio to the plain backend (the project's target: at most 1.15x with Inductor).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PLAIN = {"eager": "aot_eager", "inductor": "inductor"}


def child(name: str, backend_name: str, inner: str) -> float:
    """One first step in this process; returns its seconds."""
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
    backend = fp8fx.backend(inner=inner) if backend_name == "fp8fx" else PLAIN[inner]
    compiled = torch.compile(model, backend=backend)
    start = time.perf_counter()
    architectures.step(compiled, inputs)
    return time.perf_counter() - start


def first_step(name: str, backend_name: str, inner: str) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, backend_name, inner], check=False, capture_output=True, text=True
    )
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{name} {backend_name} inner={inner}: {last}")
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="llama,gpt2,vit", help="comma-separated names from bench/architectures.py")
    parser.add_argument("--inner", default="both", choices=["eager", "inductor", "both"])
    parser.add_argument("--child", nargs=3, metavar=("NAME", "BACKEND", "INNER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({"seconds": child(*args.child)}))
        return

    inners = ["eager", "inductor"] if args.inner == "both" else [args.inner]
    print(f"{'architecture':<13} {'inner':<9} {'plain s':>8} {'fp8fx s':>8} {'ratio':>6}")
    for name in args.only.split(","):
        for inner in inners:
            plain = first_step(name, "plain", inner)
            ours = first_step(name, "fp8fx", inner)
            print(f"{name:<13} {inner:<9} {plain:>8.1f} {ours:>8.1f} {ours / plain:>6.2f}", flush=True)
    print("target: fp8fx / plain <= 1.15 with inner=inductor")


if __name__ == "__main__":
    main()
