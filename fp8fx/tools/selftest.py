"""`fp8fx selftest`: check fp8fx's kernels on this machine, time them, and record the measurements.

On an NVIDIA GPU with FP8 tensor cores:
1. every kernel variant a training step of a small transformer generates (tensorwise, rowwise and
   blockwise recipes) runs on a few shapes, through the generated kernel and through
   `torch._scaled_mm` + the epilogue as torch ops, and is compared with the exact CPU reference;
   a training step compiled with fp8fx (`kernels="auto"` and `"triton"`) must match the same step
   with `kernels="scaled_mm"`;
2. the step's GEMMs without epilogue that `torch._scaled_mm` runs too, and a fused-epilogue
   variant, are timed against `torch._scaled_mm` and BF16 `torch.mm` on the GEMM shapes of
   bench/gemm_gpu.py, and a transformer block's training step is timed;
3. the timings become the dispatch table `kernels="auto"` reads (`fp8fx.codegen.dispatch`).

Without one: the same variant collection, offline builds for sm_89 / sm_90a / sm_100a, and a few
variants plus a training step run by Triton's interpreter in a child process (the interpreter has
to be switched on before Triton is imported). Both branches share the variant collection, the
inputs, the comparisons and the JSON writer; only the device differs. Nothing here prints.

The child process is this module: `TRITON_INTERPRET=1 python -m fp8fx.tools.selftest JOB.json OUT.json`.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fp8fx.codegen.variants import GemmVariant
from fp8fx.core.epilogue import Epilogue
from fp8fx.ops.args import Fp8GemmArgs
from fp8fx.ops.gemm_bench import (
    RUNNERS,
    Outputs,
    VariantUse,
    bf16_gemm,
    cuda_bench,
    error_line,
    gemm_args,
    make_inputs,
    present,
    time_kernels,
    to_device,
)
from fp8fx.passes.annotation import annotation
from fp8fx.runtime import numerics
from fp8fx.runtime.numerics import EXACT_DB

SCHEMA = "fp8fx.selftest/1"
RECIPES = ("tensorwise", "rowwise", "blockwise")
# A GEMM passes when its output is within the output format's last place of the exact reference,
# or (GPUs: Hopper's fast accumulation, a different summation order) its SQNR is at least this.
GEMM_SQNR_DB = 40.0
# A whole training step passes when no tensor's SQNR against the fp32 step without FP8 falls more
# than this short of the kernels="scaled_mm" step's (check_step): above the spread between two
# correct FP8 implementations of the step (docs/results.md, "On a GPU", first run).
STEP_SQNR_MARGIN_DB = 1.0
AMAX_RTOL = 1e-2  # an epilogue's amax against the reference's (consistent with 40 dB)
ULP = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float8_e4m3fn: 2**-3, torch.float8_e5m2: 2**-2}

# GEMM shapes (m, n, k) of the correctness checks: odd token counts (7, 1000), a token-count K
# (the weight gradient's), and a multi-wave one. Under the interpreter, small ones (it is slow).
GPU_CHECK_SHAPES = ((7, 512, 256), (1000, 768, 1024), (256, 384, 1000), (4096, 1024, 2048))
INTERPRETER_SHAPES = ((7, 64, 256), (37, 48, 144))
BUILD_ARCHS = ("sm_89", "sm_90a", "sm_100a")
FP8_MMA_PREFIX = {"sm_89": "mma.sync", "sm_90a": "wgmma.mma_async", "sm_100a": "tcgen05.mma"}
INTERPRETER_TIMEOUT_S = 900

# bench/gemm_gpu.py's shapes (it is not installed with the package): square sizes, and the four
# linear layers of GPT-3 blocks at two sequence lengths with their backward GEMMs.
BENCH_SQUARE = (1024, 2048, 4096, 8192, 16384)
BENCH_MODELS = {"gpt3-1.3b": 2048, "gpt3-6.7b": 4096, "gpt3-13b": 5120}  # hidden size
BENCH_SEQS = (2048, 4096)

Progress = Callable[[str, int, int], None]
# What a dispatch-table entry keeps of a timing row: load_table's keys, then the rest for people.
TABLE_KEYS = (
    "variant",
    "m",
    "n",
    "k",
    "generated_ms",
    "scaled_mm_ms",
    "generated_tflops",
    "scaled_mm_tflops",
    "bf16_ms",
    "bf16_tflops",
    "shape",
)


class SelftestError(ValueError):
    """Bad input to the self-test (an output path it cannot write): one line for the user."""


# --- the model whose training step defines the variants -------------------------------------------


@dataclass(frozen=True)
class ModelDims:
    dim: int
    heads: int
    hidden: int  # the Llama block's MLP width (the GPT block's is 4 * dim)
    batch: int
    seq: int


COLLECT_DIMS = ModelDims(64, 4, 128, 2, 16)  # variants do not depend on sizes (N, K multiples of 16)
INTERPRETER_STEP_DIMS = ModelDims(64, 4, 128, 1, 13)  # 13 tokens: odd M, and an odd K in grad_weight
GPU_STEP_DIMS = ModelDims(256, 4, 512, 2, 125)
GPU_SPEED_DIMS = ModelDims(4096, 32, 11008, 1, 2048)


class LlamaBlock(nn.Module):
    """Llama's block without rotary embeddings (they hold no GEMM): RMSNorm, causal attention,
    SiLU-gated MLP, residual adds."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, s, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class SelftestModel(nn.Module):
    """fp8fx demo's GPT block (biases, GELU) then a Llama block (gated MLP): between them every
    epilogue the fusion pass makes in training."""

    def __init__(self, dims: ModelDims):
        super().__init__()
        from fp8fx.tools.demo import Block

        self.gpt = Block(dims.dim, dims.heads)
        self.llama = LlamaBlock(dims.dim, dims.heads, dims.hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.llama(self.gpt(x))


# --- kernel variants -------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"fp8fx selftest: unknown dtype {name!r}")
    return dtype


def use_to_dict(use: VariantUse) -> dict:
    """JSON form of a VariantUse (and what the interpreter child is sent)."""
    v = use.variant
    return dict(
        name=v.name,
        recipes=list(use.recipes),
        a=_dtype_name(v.a_dtype),
        b=_dtype_name(v.b_dtype),
        block_a=list(v.block_a),
        block_b=list(v.block_b),
        epilogue=v.epilogue.spec(),
        out=_dtype_name(v.out_dtype),
        aux=_dtype_name(v.aux_dtype),
        fast_accum=v.fast_accum,
        bias_dtype=_dtype_name(use.bias_dtype),
        other_dtype=_dtype_name(use.other_dtype),
        residual_dtype=_dtype_name(use.residual_dtype),
    )


def use_from_dict(d: dict) -> VariantUse:
    variant = GemmVariant(
        _dtype(d["a"]),
        _dtype(d["b"]),
        tuple(d["block_a"]),
        tuple(d["block_b"]),
        Epilogue.parse(d["epilogue"]),
        _dtype(d["out"]),
        _dtype(d["aux"]),
        bool(d["fast_accum"]),
    )
    return VariantUse(
        variant, tuple(d["recipes"]), _dtype(d["bias_dtype"]), _dtype(d["other_dtype"]), _dtype(d["residual_dtype"])
    )


def collect_variants(
    recipes=RECIPES, dims: ModelDims = COLLECT_DIMS, dtype: torch.dtype = torch.bfloat16, progress: Progress | None = None
) -> list[VariantUse]:
    """Every kernel variant of a training step (forward and backward) of SelftestModel under each
    recipe, in first-seen order. Compiled on the CPU with the eager inner compiler: which variants
    a graph needs does not depend on the device, and BF16 is what a GPU trains in."""
    from fp8fx.compiler.backend import backend as fp8fx_backend
    from fp8fx.core.policy import Policy

    seen: dict = {}
    for i, recipe in enumerate(recipes):
        torch.manual_seed(0)
        model = SelftestModel(dims).to(dtype)
        backend = fp8fx_backend(policy=Policy.from_recipe(recipe), inner="eager", keep_graphs=True)
        x = torch.randn(dims.batch, dims.seq, dims.dim, dtype=dtype, requires_grad=True)
        try:
            torch.compile(model, backend=backend)(x).float().sum().backward()
        finally:
            torch._dynamo.reset()
        for _, gm in backend.kept_graphs:
            for node in gm.graph.nodes:
                if node.target != torch.ops.fp8fx.fp8_gemm.default:
                    continue
                variant = annotation(node).fusion.variant
                recipes_of, _ = seen.setdefault(variant, ([], _extra_dtypes(node)))
                if recipe not in recipes_of:
                    recipes_of.append(recipe)
        if progress:
            progress("collecting kernel variants", i + 1, len(recipes))
    return [VariantUse(v, tuple(r), *d) for v, (r, d) in seen.items()]


def _extra_dtypes(node) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """The graph's dtypes of the fp8fx::fp8_gemm node's bias, other, residual; BF16 if absent."""

    def dtype_of(arg) -> torch.dtype:
        val = getattr(arg, "meta", {}).get("val") if arg is not None else None
        return val.dtype if isinstance(val, Tensor) else torch.bfloat16

    g = Fp8GemmArgs.of(node)
    return dtype_of(g.bias), dtype_of(g.other), dtype_of(g.residual)


def _weight(use: VariantUse) -> tuple:
    e = use.variant.epilogue
    return (e.ops() + e.out_amax + (e.aux != "none"), use.name)


def heaviest_per_recipe(uses: list[VariantUse], recipes=RECIPES) -> list[VariantUse]:
    """Per recipe, its variant with the most fused epilogue work: what the CPU checks build and
    interpret (a handful, not all: the interpreter and ptxas are slow)."""
    picks = []
    for recipe in recipes:
        mine = [u for u in uses if recipe in u.recipes]
        if mine:
            pick = max(mine, key=_weight)
            if pick not in picks:
                picks.append(pick)
    return picks


def speed_uses(uses: list[VariantUse]) -> list[tuple[str, VariantUse]]:
    """The GEMMs timed, as (role, use): "plain", the forward tensorwise GEMM without epilogue;
    "fused", the tensorwise variant with the most fused epilogue; "bare", every other GEMM of the
    step without its epilogue (as Inductor leaves them) that `torch._scaled_mm` runs too. Each GEMM
    of those variants then runs on the kernel measured faster (`fp8fx.codegen.dispatch`), rowwise
    and the backward's variants included."""
    from fp8fx.codegen.dispatch import bare_variant, scaled_mm_supports

    tensorwise = [u for u in uses if "tensorwise" in u.recipes and not u.variant.block_a and not u.variant.block_b]
    plain = [u for u in tensorwise if _weight(u)[0] == 0]
    fused = [u for u in tensorwise if _weight(u)[0] > 0]
    chosen = []
    if plain:  # E4M3 x E4M3 (forward) first, then the BF16 output
        chosen.append(
            (
                "plain",
                min(
                    plain, key=lambda u: (u.variant.a_dtype != torch.float8_e4m3fn, u.variant.out_dtype != torch.bfloat16, u.name)
                ),
            )
        )
    if fused:
        chosen.append(("fused", max(fused, key=_weight)))
    recipes: dict[GemmVariant, list[str]] = {}
    for u in uses:
        bare = bare_variant(u.variant)
        if not scaled_mm_supports(bare):
            mine = recipes.setdefault(bare, [])
            mine += [r for r in u.recipes if r not in mine]
    taken = {u.variant for _, u in chosen}
    chosen += [("bare", VariantUse(v, tuple(r))) for v, r in recipes.items() if v not in taken]
    return chosen


# --- the reference, and the comparison ------------------------------------------------------------
# (The inputs and the two kernels a GPU runs: fp8fx.ops.gemm_bench, shared with the measuring at compile.)


def run_reference(use: VariantUse, t: dict) -> Outputs:
    """fp8fx's exact emulation (CPU tensors): fp32 products of the FP8 values, fp32 accumulation."""
    from fp8fx.ops import reference

    # kernel "scaled_mm": the emulation itself, never the interpreter (even in the child process)
    return present(use, *reference.fp8_gemm(gemm_args(use, t, "scaled_mm")))


def sqnr_db(actual: Tensor, reference: Tensor) -> float | None:
    """`fp8fx.runtime.numerics.sqnr_db` of `actual` against `reference`, capped at EXACT_DB (equal tensors);
    None if either is not finite, 0 for a zero reference."""
    a, r = actual.detach().cpu().float().double(), reference.detach().cpu().float().double()
    if not (torch.isfinite(a).all() and torch.isfinite(r).all()):
        return None
    db = numerics.sqnr_db(r, a)
    return 0.0 if db == -math.inf else min(EXACT_DB, db)


def compare_tensor(out: Tensor, ref: Tensor, min_sqnr: float = GEMM_SQNR_DB) -> dict:
    """Within the output format's last place (plus a small absolute term for cancellation, as
    tests/codegen/interpreter's close_as), or at least `min_sqnr` dB."""
    if tuple(out.shape) != tuple(ref.shape) or out.dtype != ref.dtype:
        return dict(passed=False, error=f"got {out.dtype} {tuple(out.shape)}, expected {ref.dtype} {tuple(ref.shape)}")
    o, r = out.detach().cpu().float(), ref.detach().cpu().float()
    atol = 1e-5 * r.abs().max().item() + (2**-9 if out.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 0.0)
    within = bool(torch.isfinite(o).all() and ((o - r).abs() <= atol + ULP[out.dtype] * r.abs()).all())
    db = sqnr_db(o, r)
    return dict(passed=within or (db is not None and db >= min_sqnr), within_ulps=within, sqnr_db=_round(db))


def compare_outputs(got: Outputs, ref: Outputs) -> dict:
    """{"passed", "out": ..., "aux": ..., "amax": ...} of one GEMM against the reference."""
    result: dict = {"out": compare_tensor(got[0], ref[0])}
    if ref[1] is not None:
        result["aux"] = compare_tensor(got[1], ref[1]) if got[1] is not None else dict(passed=False, error="no aux output")
    if ref[2] is not None:
        if got[2] is None:
            result["amax"] = dict(passed=False, error="no amax output")
        else:
            a, r = float(got[2].float().cpu()), float(ref[2].float().cpu())
            rel = abs(a - r) / max(abs(r), 1e-30)
            result["amax"] = dict(passed=rel <= AMAX_RTOL, value=a, reference=r, rel_err=_round(rel, 6))
    result["passed"] = all(part["passed"] for part in result.values())
    return result


def check_gemm(
    use: VariantUse, m: int, n: int, k: int, paths, device: str | torch.device, where: str, seed: int = 0
) -> list[dict]:
    """One GEMM of `use` through each of `paths` ("generated", "scaled_mm") on `device`, against
    the reference on CPU copies of the same inputs. A check that raises fails with the error."""
    base = dict(kind="gemm", where=where, variant=use.name, recipes=list(use.recipes), m=m, n=n, k=k)
    try:
        inputs = make_inputs(use, m, n, k, seed)
        ref = run_reference(use, inputs)
        on_device = to_device(inputs, device)
    except Exception as e:  # noqa: BLE001 - reported in the results
        return [dict(base, path=p, passed=False, error=error_line(e)) for p in paths]
    checks = []
    for path in paths:
        try:
            got = RUNNERS[path](use, on_device)
            checks.append(dict(base, path=path, **compare_outputs(got, ref)))
        except Exception as e:  # noqa: BLE001
            checks.append(dict(base, path=path, passed=False, error=error_line(e)))
    return checks


def scaled_mm_paths(use: VariantUse) -> tuple[str, ...]:
    """("generated", "scaled_mm"), without scaled_mm where torch._scaled_mm cannot run the variant."""
    from fp8fx.codegen.dispatch import scaled_mm_supports

    return ("generated",) if scaled_mm_supports(use.variant) else ("generated", "scaled_mm")


# --- a training step -------------------------------------------------------------------------------


def step_tensors(
    recipe: str | None,
    kernels: str,
    dims: ModelDims,
    device,
    dtype: torch.dtype = torch.bfloat16,
    inner: str = "eager",
    seed: int = 0,
) -> list[Tensor]:
    """Output, input gradient and parameter gradients of one forward+backward of SelftestModel
    compiled with fp8fx under `recipe` and `kernels`; `recipe` None: the model in fp32 without
    FP8, eagerly (the reference both FP8 steps are measured against)."""
    from fp8fx.compiler.backend import backend as fp8fx_backend
    from fp8fx.core.policy import Policy

    torch.manual_seed(seed)
    dtype = dtype if recipe else torch.float32
    model = SelftestModel(dims).to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(dims.batch, dims.seq, dims.dim, generator=g).to(device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(dims.batch, dims.seq, dims.dim, generator=g).to(device=device, dtype=dtype)
    backend = fp8fx_backend(policy=Policy.from_recipe(recipe), inner=inner, kernels=kernels) if recipe else None
    try:
        out = (torch.compile(model, backend=backend) if backend else model)(x)
        out.backward(dy)
    finally:
        torch._dynamo.reset()
    return [out.detach(), x.grad, *(p.grad for p in model.parameters())]


def check_step(
    recipe: str, kernels: str, dims: ModelDims, device, where: str, inner: str = "eager", dtype: torch.dtype = torch.bfloat16
) -> dict:
    """A training step with `kernels` against the same step with kernels="scaled_mm", each measured
    against the fp32 step without FP8: for the output and every gradient, the SQNR of `kernels`'
    step may fall short of kernels="scaled_mm"'s by at most STEP_SQNR_MARGIN_DB.

    Not the two FP8 steps against each other: two correct implementations that round one
    intermediate differently (an epilogue in fp32 or after a BF16 output) move some values across
    an FP8 rounding boundary at the next cast, and the steps then differ by about FP8's own
    quantization noise, while their SQNRs against the fp32 step stay close (fused against unfused
    epilogues on the CPU emulation of GPU_STEP_DIMS in bf16: docs/results.md, "On a GPU", first
    run)."""
    base = dict(
        kind="step",
        where=where,
        recipe=recipe,
        kernels=kernels,
        baseline="scaled_mm",
        tokens=dims.batch * dims.seq,
        dim=dims.dim,
        dtype=_dtype_name(dtype),
    )
    try:
        exact = step_tensors(None, kernels, dims, device, dtype, inner)
        ref = step_tensors(recipe, "scaled_mm", dims, device, dtype, inner)
        got = step_tensors(recipe, kernels, dims, device, dtype, inner)
    except Exception as e:  # noqa: BLE001
        return dict(base, passed=False, error=error_line(e))
    if any(t is None for t in got + ref):  # a missing gradient fails
        return dict(base, passed=False, error="a gradient is missing")
    got_db = [sqnr_db(t, e) for t, e in zip(got, exact, strict=True)]
    ref_db = [sqnr_db(t, e) for t, e in zip(ref, exact, strict=True)]
    if None in got_db + ref_db:  # sqnr_db: a tensor that is not finite
        return dict(base, passed=False, error="a non-finite output or gradient")
    shortfall = max(r - g for g, r in zip(got_db, ref_db))
    return dict(
        base,
        passed=shortfall <= STEP_SQNR_MARGIN_DB,
        min_sqnr_db=_round(min(got_db)),
        baseline_min_sqnr_db=_round(min(ref_db)),
        max_shortfall_db=_round(shortfall),
        tensors=len(got_db),
    )


# --- offline builds and the interpreter (the CPU branch) ------------------------------------------


def build_plan(uses: list[VariantUse], archs=BUILD_ARCHS) -> list[tuple[VariantUse, str]]:
    """One variant per architecture, taking `uses` in turn: with the heaviest variant of each
    recipe, every granularity is built once (ptxas takes seconds per build)."""
    return [(uses[i % len(uses)], arch) for i, arch in enumerate(archs)] if uses else []


def build_checks(plan: list[tuple[VariantUse, str]], progress: Progress | None = None) -> list[dict]:
    """Each (variant, architecture) built on the CPU: no register spills, shared memory within the
    limit, the architecture's FP8 tensor-core instruction in the PTX. In this process: for a
    handful of builds, worker processes cost more in imports than they save (docs/results.md,
    "Benchmarks (CPU)")."""
    from fp8fx.codegen.targets import build_all

    checks = []
    for i, (use, arch) in enumerate(plan):
        base = dict(kind="build", where="offline", variant=use.name, recipes=list(use.recipes), arch=arch)
        try:
            for r in build_all([use.variant], archs=(arch,), workers=1):
                mma_ok = r.fp8_mma is not None and r.fp8_mma.startswith(FP8_MMA_PREFIX[arch])
                checks.append(dict(base, **dataclasses.asdict(r), passed=bool(r.ok and mma_ok)))
        except Exception as e:  # noqa: BLE001
            checks.append(dict(base, passed=False, error=error_line(e)))
        if progress:
            progress("offline builds", i + 1, len(plan))
    return checks


def interpreter_job(
    uses: list[VariantUse],
    shapes=INTERPRETER_SHAPES,
    step_recipe: str | None = "tensorwise",
    dims: ModelDims = INTERPRETER_STEP_DIMS,
) -> dict:
    """What the interpreter child runs: GEMMs of `uses` at `shapes`, and one training step.

    The step runs in fp32: Triton's interpreter truncates fp32 -> bf16 conversions (a GPU rounds
    to nearest), which leaves single BF16 GEMMs within a last place but biases a whole BF16 step
    far from kernels="scaled_mm"'s, where an fp32 step agrees with it (docs/results.md,
    "Benchmarks (CPU)")."""
    step = dict(recipe=step_recipe, dims=dataclasses.asdict(dims), dtype="float32") if step_recipe else None
    return dict(uses=[use_to_dict(u) for u in uses], shapes=[list(s) for s in shapes], step=step)


def run_interpreter_job(job: dict) -> list[dict]:
    """In the child (TRITON_INTERPRET=1): the same checks as on a GPU, on CPU tensors."""
    from fp8fx.codegen.versions import interpreter_active

    if not interpreter_active():
        raise RuntimeError("Triton's interpreter is off: TRITON_INTERPRET=1 must be set before Triton is imported")
    checks = []
    for d in job["uses"]:
        use = use_from_dict(d)
        for m, n, k in job["shapes"]:
            checks += check_gemm(use, m, n, k, ("generated",), "cpu", where="interpreter")
    if job.get("step"):
        dims = ModelDims(**job["step"]["dims"])
        checks.append(
            check_step(job["step"]["recipe"], "triton", dims, "cpu", where="interpreter", dtype=_dtype(job["step"]["dtype"]))
        )
    return checks


def start_interpreter(job: dict, workdir: Path) -> subprocess.Popen:
    """The child process, started now so that it runs beside the builds (2 cores are enough)."""
    (workdir / "job.json").write_text(json.dumps(job))
    log = open(workdir / "child.log", "w")  # a file, not a pipe: a full pipe would block the child
    cmd = [sys.executable, "-m", "fp8fx.tools.selftest", str(workdir / "job.json"), str(workdir / "result.json")]
    try:
        return subprocess.Popen(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def finish_interpreter(proc: subprocess.Popen, workdir: Path, timeout: float = INTERPRETER_TIMEOUT_S) -> list[dict]:
    """The child's checks; one failed check naming the cause if it died or timed out."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return [
            dict(
                kind="interpreter", where="interpreter", passed=False, error=f"the interpreter process took over {timeout:.0f} s"
            )
        ]
    result = workdir / "result.json"
    if code != 0 or not result.exists():
        tail = (workdir / "child.log").read_text()[-1500:].strip()
        return [
            dict(
                kind="interpreter",
                where="interpreter",
                passed=False,
                error=f"the interpreter process exited with code {code}: {tail}",
            )
        ]
    return json.loads(result.read_text())["checks"]


def cpu_checks(uses: list[VariantUse], progress: Progress | None = None) -> list[dict]:
    """Offline builds and the interpreter for the heaviest variant of each recipe; the builds run
    here while the interpreter's process runs beside them."""
    picks = heaviest_per_recipe(uses)
    with tempfile.TemporaryDirectory(prefix="fp8fx-selftest-") as d:
        proc = start_interpreter(interpreter_job(picks), Path(d))
        try:
            builds = build_checks(build_plan(picks), progress=progress)
        finally:
            if progress:
                progress("Triton interpreter (child process)", 0, 1)
            interpreted = finish_interpreter(proc, Path(d))
    if progress:
        progress("Triton interpreter (child process)", 1, 1)
    return builds + interpreted


# --- timing (GPU) ----------------------------------------------------------------------------------


def gemm_shapes(quick: bool = False) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of bench/gemm_gpu.py (batch 1, with dgrad and wgrad), unique by (m, n, k);
    `quick`: a few square sizes and one model at one sequence length."""
    squares = (1024, 4096, 8192) if quick else BENCH_SQUARE
    models = {"gpt3-6.7b": BENCH_MODELS["gpt3-6.7b"]} if quick else BENCH_MODELS
    seqs = BENCH_SEQS[:1] if quick else BENCH_SEQS
    shapes = [(f"square {s}", s, s, s) for s in squares]
    for model, h in models.items():
        for seq in seqs:
            for layer, k, n in (("qkv", h, 3 * h), ("attn_out", h, h), ("mlp_up", h, 4 * h), ("mlp_down", 4 * h, h)):
                name = f"{model} s{seq} {layer}"
                shapes += [(name, seq, n, k), (f"{name}.dgrad", seq, k, n), (f"{name}.wgrad", n, k, seq)]
    unique: dict = {}
    for name, m, n, k in shapes:
        unique.setdefault((m, n, k), name)
    return [(name, m, n, k) for (m, n, k), name in unique.items()]


def tflops(m: int, n: int, k: int, ms: float | None) -> float | None:
    return 2 * m * n * k / (ms * 1e-3) / 1e12 if ms else None


def time_gemms(
    chosen: list[tuple[str, VariantUse]], shapes, device, bench: Callable | None = None, progress: Progress | None = None
) -> list[dict]:
    """One row per (variant, shape): generated_ms, scaled_mm_ms, bf16_ms and their TFLOP/s (None
    and an error where a kernel failed; the BF16 GEMM, `gemm_bench.bf16_gemm`, timed once per shape
    without a bias and once with one)."""
    bench = bench if bench is not None else cuda_bench
    rows = []
    for i, (name, m, n, k) in enumerate(shapes):
        errors: dict = {}
        bf16: dict[bool, float | None] = {}  # by whether the variant has a bias
        for role, use in chosen:
            bias = use.variant.epilogue.bias
            if bias not in bf16:
                bf16[bias] = _timed(functools.partial(bf16_gemm, use.variant, m, n, k, device), bench, "bf16", errors)
            bf16_ms = bf16[bias]
            row = dict(variant=use.name, role=role, shape=name, m=m, n=n, k=k)
            times, failed = time_kernels(use, m, n, k, device, bench)
            for path, ms in times.items():
                row[f"{path}_ms"], row[f"{path}_tflops"] = _round(ms, 5), _round(tflops(m, n, k, ms), 1)
            for path, why in failed.items():  # the first error of each column at this shape
                errors.setdefault(path, why)
            row["bf16_ms"], row["bf16_tflops"] = _round(bf16_ms, 5), _round(tflops(m, n, k, bf16_ms), 1)
            if errors:
                row["errors"] = dict(errors)
            rows.append(row)
        if progress:
            progress("timing GEMMs", i + 1, len(shapes))
    return rows


def _timed(make: Callable[[], Callable], bench: Callable, name: str, errors: dict, **bench_kwargs) -> float | None:
    """bench(make()) in ms, or None with the column's first error kept in `errors`."""
    try:
        return bench(make(), **bench_kwargs)
    except Exception as e:  # noqa: BLE001 - one failing kernel should not stop the table
        errors.setdefault(name, error_line(e))
        return None


def speed_summary(rows: list[dict]) -> list[dict]:
    """Per variant timed, in order: its role, the median TFLOP/s of each kernel over the shapes
    measured, and on how many shapes the generated kernel beat torch._scaled_mm."""
    summary = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        med = {p: _median([r[f"{p}_tflops"] for r in mine]) for p in ("generated", "scaled_mm", "bf16")}
        both = [r for r in mine if r["generated_ms"] and r["scaled_mm_ms"]]
        summary.append(
            dict(
                role=mine[0]["role"],
                variant=variant,
                shapes=len(mine),
                median_tflops=med,
                generated_faster=sum(r["generated_ms"] <= r["scaled_mm_ms"] for r in both),
                compared=len(both),
            )
        )
    return summary


def time_block(
    dims: ModelDims, device, bench: Callable | None = None, inner: str = "inductor", baseline_backend: str = "inductor"
) -> dict:
    """Training-step time of SelftestModel in BF16: fp8fx (kernels auto), fp8fx with
    kernels="scaled_mm", and plain torch.compile; milliseconds (None and an error if one failed)."""
    from fp8fx.compiler.backend import backend as fp8fx_backend

    bench = bench if bench is not None else cuda_bench
    torch.manual_seed(0)
    base = SelftestModel(dims).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(dims.batch, dims.seq, dims.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    result: dict = dict(dims=dataclasses.asdict(dims), recipe="tensorwise", inner=inner)
    errors: dict = {}
    backends = (
        ("fp8fx_auto", lambda: fp8fx_backend(inner=inner, kernels="auto")),
        ("fp8fx_scaled_mm", lambda: fp8fx_backend(inner=inner, kernels="scaled_mm")),
        ("bf16", lambda: baseline_backend),
    )
    for name, make_backend in backends:
        model = copy.deepcopy(base)

        def make_step(model=model, make_backend=make_backend) -> Callable[[], None]:
            compiled = torch.compile(model, backend=make_backend())

            def step() -> None:
                compiled(x).backward(dy)

            for _ in range(2):  # compile, then settle autotuning, outside the timing
                step()
            return step

        try:
            # Gradients reset before each run: every step writes them rather than accumulating.
            result[f"{name}_ms"] = _round(_timed(make_step, bench, name, errors, grad_to_none=[x, *model.parameters()]), 4)
        finally:
            torch._dynamo.reset()
    for name in ("fp8fx_auto", "fp8fx_scaled_mm"):
        fp8, bf16 = result[f"{name}_ms"], result["bf16_ms"]
        result[f"{name}_speedup_over_bf16"] = _round(bf16 / fp8, 3) if fp8 and bf16 else None
    if errors:
        result["errors"] = errors
    return result


# --- environment, results, the dispatch table ------------------------------------------------------


@dataclass(frozen=True)
class GpuStatus:
    info: dict | None  # name, capability, target, sms, memory_gib; None when the GPU branch cannot run
    reason: str  # why not ("" when it can)
    label: str  # the device in file names: the GPU's name, or "cpu"


def _label(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") or "gpu"


def gpu_status() -> GpuStatus:
    """Whether this machine has a GPU fp8fx's kernels run on, and what it is."""
    if not torch.cuda.is_available():
        return GpuStatus(None, "no CUDA GPU found (torch.cuda.is_available() is False)", "cpu")
    from fp8fx.codegen.variants import device_target

    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    name, (major, minor) = props.name, torch.cuda.get_device_capability(device)
    try:
        target = device_target(device)
    except RuntimeError as e:  # no FP8 tensor cores, or ROCm
        return GpuStatus(None, f"{name}: {e}", "cpu")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SelftestError(
            "TRITON_INTERPRET is set: fp8fx's kernels would run in Triton's interpreter, not on the GPU; unset it"
        )
    info = dict(
        name=name,
        capability=f"{major}.{minor}",
        target=target,
        sms=props.multi_processor_count,
        memory_gib=round(props.total_memory / 2**30, 1),
    )
    return GpuStatus(info, "", _label(name))


def environment() -> dict:
    """Versions: fp8fx, torch, Triton, CUDA (torch's build), Python, the platform; and what this
    Triton lacks of what fp8fx uses (`fp8fx.codegen.versions.limits`)."""
    from fp8fx.codegen import versions
    from fp8fx.core.version import VERSION

    return dict(
        fp8fx=VERSION,
        torch=torch.__version__,
        triton=versions.triton_version_string(),
        cuda=torch.version.cuda,
        python=platform.python_version(),
        platform=platform.platform(),
        limits=versions.limits(),
    )


def default_output(status: GpuStatus) -> Path:
    return Path.cwd() / f"fp8fx-selftest-{status.label}.json"


def check_output_path(path: Path) -> Path:
    """`path` if a JSON file can be written there; SelftestError naming the problem otherwise."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise SelftestError(f"{path} is a directory; give a file name, e.g. {path / 'fp8fx-selftest.json'}")
    parent = path.parent
    if not parent.exists():
        raise SelftestError(f"cannot write {path}: directory {parent} does not exist")
    if not parent.is_dir():
        raise SelftestError(f"cannot write {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise SelftestError(f"cannot write {path}: permission denied")
    return path


def check_groups(checks: list[dict]) -> list[dict]:
    """Checks counted per (kind, where), with the lowest SQNR seen: the summary people read."""
    groups: dict = {}
    for c in checks:
        g = groups.setdefault(
            (c["kind"], c["where"]), dict(kind=c["kind"], where=c["where"], passed=0, total=0, min_sqnr_db=None)
        )
        g["total"] += 1
        g["passed"] += bool(c["passed"])
        for db in _sqnrs(c):
            g["min_sqnr_db"] = db if g["min_sqnr_db"] is None else min(g["min_sqnr_db"], db)
    return list(groups.values())


def _sqnrs(check: dict) -> list[float]:
    found = [check["min_sqnr_db"]] if check.get("min_sqnr_db") is not None else []
    return found + [
        part["sqnr_db"]
        for part in (check.get("out"), check.get("aux"))
        if isinstance(part, dict) and part.get("sqnr_db") is not None
    ]


def build_report(
    env: dict,
    status: GpuStatus,
    uses: list[VariantUse],
    checks: list[dict],
    speed: dict | None,
    seconds: float,
    table: str | None,
) -> dict:
    """The JSON document of one self-test. `passed`: every correctness check passed (and there was one)."""
    data = dict(
        schema=SCHEMA,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        passed=bool(checks) and all(c["passed"] for c in checks),
        environment=env,
        gpu=status.info,
        no_gpu_reason=status.reason or None,
        thresholds=dict(gemm_sqnr_db=GEMM_SQNR_DB, step_sqnr_margin_db=STEP_SQNR_MARGIN_DB, amax_rtol=AMAX_RTOL, ulp=_ulps()),
        variants=[use_to_dict(u) for u in uses],
        summary=check_groups(checks),
        checks=checks,
        speed=speed,
        dispatch_table=table,
        seconds=round(seconds, 1),
    )
    return _json_safe(data)


def dispatch_table(env: dict, gpu: dict, rows: list[dict]) -> dict:
    """The measured table `fp8fx.codegen.dispatch.load_table` reads: `format`, and one entry per
    row where both kernels were timed (plus the device and versions, for people)."""
    from fp8fx.codegen.dispatch import TABLE_FORMAT

    gemms = [{key: r[key] for key in TABLE_KEYS} for r in rows if r.get("generated_ms") and r.get("scaled_mm_ms")]
    return _json_safe(
        dict(
            format=TABLE_FORMAT, device=gpu["name"], capability=gpu["capability"], target=gpu["target"], versions=env, gemms=gemms
        )
    )


def write_json(data: dict, path: Path) -> None:
    """Write `data` to `path` through a temporary file, so a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    tmp.replace(path)


@dataclass
class SelftestResult:
    data: dict  # the JSON document written to json_path
    json_path: Path
    table_path: Path | None  # the dispatch table written (None: none written)
    table_error: str | None  # why writing the table failed

    @property
    def passed(self) -> bool:
        return bool(self.data["passed"])


def run(
    out: Path | None = None, write_table: bool = True, quick: bool = False, progress: Progress | None = None
) -> SelftestResult:
    """Run the self-test on this machine (GPU branch or CPU branch) and write its JSON to `out`
    (default: fp8fx-selftest-<device>.json in the current directory) and, on a GPU, the dispatch
    table at `fp8fx.codegen.dispatch.table_path(name)` unless `write_table` is False.
    Raises SelftestError, before any work, when `out` cannot be written."""
    start = time.perf_counter()
    status = gpu_status()
    out = check_output_path(out if out is not None else default_output(status))
    env = environment()
    uses = collect_variants(progress=progress)
    speed = None
    if status.info is None:
        checks = cpu_checks(uses, progress)
    else:
        checks, speed = gpu_checks(uses, gpu_plan(quick), torch.device("cuda", torch.cuda.current_device()), progress=progress)
    table_path = table_error = None
    if status.info is not None and write_table and speed is not None:
        from fp8fx.codegen.dispatch import table_path as dispatch_path

        table = dispatch_table(env, status.info, speed["gemms"])
        try:
            write_json(table, dispatch_path(status.info["name"]))
            table_path = dispatch_path(status.info["name"])
        except OSError as e:
            table_error = f"could not write the dispatch table {dispatch_path(status.info['name'])}: {e.strerror or e}"
    data = build_report(env, status, uses, checks, speed, time.perf_counter() - start, str(table_path) if table_path else None)
    try:
        write_json(data, out)
    except OSError as e:
        raise SelftestError(f"cannot write {out}: {e.strerror or e}") from e
    return SelftestResult(data, out, table_path, table_error)


@dataclass(frozen=True)
class GpuPlan:
    """What the GPU branch runs: the GEMM check shapes, the training-step checks, what is timed."""

    check_shapes: tuple = GPU_CHECK_SHAPES
    recipes: tuple = RECIPES
    step_kernels: tuple = ("auto", "triton")  # each checked against kernels="scaled_mm"
    step_dims: ModelDims = GPU_STEP_DIMS
    timing_shapes: tuple = ()  # (name, m, n, k)
    block_dims: ModelDims = GPU_SPEED_DIMS
    inner: str = "inductor"  # the compiler of the timed block steps (correctness steps run eagerly)
    baseline: str = "inductor"  # plain torch.compile's backend for the BF16 block


def gpu_plan(quick: bool = False) -> GpuPlan:
    """The default plan; `quick` times 12 GEMM shapes and a block of 1024 tokens."""
    block = dataclasses.replace(GPU_SPEED_DIMS, seq=1024) if quick else GPU_SPEED_DIMS
    return GpuPlan(timing_shapes=tuple(gemm_shapes(quick)), block_dims=block)


def gpu_checks(
    uses: list[VariantUse], plan: GpuPlan, device, bench: Callable | None = None, progress: Progress | None = None
) -> tuple[list[dict], dict]:
    """The GPU branch: every variant at the plan's shapes through both kernels, the training steps,
    then the timings. `device` and `bench` are parameters so the tests can run it on the CPU."""
    checks: list[dict] = []
    cases = [(u, shape) for u in uses for shape in plan.check_shapes]
    for i, (use, (m, n, k)) in enumerate(cases):
        checks += check_gemm(use, m, n, k, scaled_mm_paths(use), device, where="gpu")
        if progress:
            progress("GEMMs against the CPU reference", i + 1, len(cases))
    steps = [(r, kernels) for r in plan.recipes for kernels in plan.step_kernels]
    for i, (recipe, kernels) in enumerate(steps):
        checks.append(check_step(recipe, kernels, plan.step_dims, device, where="gpu"))
        if progress:
            progress("training steps against kernels=scaled_mm", i + 1, len(steps))
    rows = time_gemms(speed_uses(uses), plan.timing_shapes, device, bench, progress)
    if progress:
        progress("timing a transformer block", 0, 1)
    block = time_block(plan.block_dims, device, bench, plan.inner, plan.baseline)
    if progress:
        progress("timing a transformer block", 1, 1)
    return checks, dict(gemms=rows, summary=speed_summary(rows), block=block)


# --- small helpers ---------------------------------------------------------------------------------


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, digits)


def _median(values) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 1) if present else None


def _ulps() -> dict:
    return {_dtype_name(d): u for d, u in ULP.items()}


def _json_safe(obj):
    """Non-finite floats as None (JSON has no inf or NaN), tuples as lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _child_main(argv: list[str]) -> int:
    """The interpreter child: read the job, run it, write the checks."""
    job_path, out_path = argv
    checks = run_interpreter_job(json.loads(Path(job_path).read_text()))
    Path(out_path).write_text(json.dumps(dict(checks=_json_safe(checks))))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
