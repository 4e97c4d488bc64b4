"""One FP8 GEMM run and timed on a device: its inputs, the two kernels that can run it, the same
GEMM in BF16, the clock.

Shared by `fp8fx selftest` (`fp8fx.tools.selftest`, which also checks the results) and the
measuring of a compile's GEMMs (`fp8fx.codegen.autotune`, given `measure_gemm`). Nothing here is
CUDA-specific but `cuda_bench` and `device_tables`: on CPU tensors the runners run the exact
reference (`run_scaled_mm`) or Triton's interpreter (`run_generated`), and the tests pass a fake
clock as the bench.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fp8fx.codegen.autotune import Tables, error_line
from fp8fx.codegen.variants import GemmVariant
from fp8fx.ops.args import Fp8GemmArgs

# Timing during a compile: shorter than fp8fx selftest's (warmup 25 ms, rep 100 ms), since each
# GEMM the compile meets is timed within a budget (fp8fx.codegen.autotune.MEASURE_GEMMS_S).
COMPILE_WARMUP_MS, COMPILE_REP_MS = 5, 25


@dataclass(frozen=True)
class VariantUse:
    """A kernel variant as a training step uses it: the variant, the recipes that generate it, and
    the dtypes of its bias / other / residual inputs in the graph."""

    variant: GemmVariant
    recipes: tuple[str, ...]
    bias_dtype: torch.dtype = torch.bfloat16
    other_dtype: torch.dtype = torch.bfloat16
    residual_dtype: torch.dtype = torch.bfloat16

    @property
    def name(self) -> str:
        return self.variant.name


def make_inputs(use: VariantUse, m: int, n: int, k: int, seed: int = 0, device: str | torch.device = "cpu") -> dict:
    """The arguments of one GEMM of `use`'s variant: FP8 operands quantized as the graph does
    (a [m, k] row-major, b [k, n] column-major), their scale inverses, and the epilogue's tensors."""
    from fp8fx.core.scaling import amax_to_scale, block_amax
    from fp8fx.ops import reference

    v = use.variant
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape) -> Tensor:
        return torch.randn(*shape, generator=g, device=device)

    def operand(x: Tensor, dtype: torch.dtype, block: tuple) -> tuple[Tensor, Tensor]:
        scale = amax_to_scale(block_amax(x, block), torch.finfo(dtype).max)
        return reference.cast(x, scale, dtype, list(block)), scale.reciprocal()

    a, scale_inv_a = operand(randn(m, k), v.a_dtype, v.block_a)
    bt, scale_inv_bt = operand(randn(n, k), v.b_dtype, tuple(reversed(v.block_b)))  # the weight as stored: [n, k]
    e, fp8_out = v.epilogue, v.out_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return {
        "a": a,
        "b": bt.t(),
        "scale_inv_a": scale_inv_a,
        "scale_inv_b": scale_inv_bt.t().contiguous() if v.block_b else scale_inv_bt,
        "bias": randn(n).to(use.bias_dtype) if e.bias else None,
        "other": randn(m, n).to(use.other_dtype) if e.mul != "none" else None,
        "residual": randn(m, n).to(use.residual_dtype) if e.residual else None,
        "out_scale": torch.tensor(4.0, device=device) if fp8_out else None,
    }


def to_device(inputs: dict, device: str | torch.device) -> dict:
    return {k: t.to(device) if t is not None else None for k, t in inputs.items()}


Outputs = tuple[Tensor, Tensor | None, Tensor | None]  # out, aux, amax


def present(use: VariantUse, out: Tensor, aux: Tensor | None, amax: Tensor | None) -> Outputs:
    """Absent outputs as None (the ops return empty tensors for them)."""
    e = use.variant.epilogue
    return out, aux if e.aux != "none" else None, amax if e.out_amax else None


def run_generated(use: VariantUse, t: dict) -> Outputs:
    """The generated Triton kernel, through the one launcher the graph uses."""
    from fp8fx.codegen.launch import fp8_gemm

    v = use.variant
    out, aux, amax = fp8_gemm(
        t["a"],
        t["b"],
        t["scale_inv_a"],
        t["scale_inv_b"],
        block_a=v.block_a,
        block_b=v.block_b,
        epilogue=v.epilogue,
        bias=t["bias"],
        other=t["other"],
        residual=t["residual"],
        out_scale=t["out_scale"],
        out_dtype=v.out_dtype,
        aux_dtype=v.aux_dtype,
        fast_accum=v.fast_accum,
    )
    return present(use, out, aux, amax)


def run_scaled_mm(use: VariantUse, t: dict) -> Outputs:
    """`torch._scaled_mm` (scaled_mm_2d) to fp32, then the epilogue as torch ops: exactly what
    `fp8fx.ops.cuda` runs for kernel "scaled_mm"."""
    from fp8fx.ops.cuda import fp8_gemm_on_cuda

    return present(use, *fp8_gemm_on_cuda(gemm_args(use, t, "scaled_mm")))


def gemm_args(use: VariantUse, t: dict, gpu_kernel: str) -> Fp8GemmArgs:
    """The `fp8fx::fp8_gemm` arguments of `use`'s variant on the tensors `t` (`make_inputs`)."""
    v = use.variant
    operands = {k: t[k] for k in ("a", "b", "scale_inv_a", "scale_inv_b", "bias", "other", "residual", "out_scale")}
    return Fp8GemmArgs(
        **operands,
        out_dtype=v.out_dtype,
        aux_dtype=v.aux_dtype,
        block_a=list(v.block_a),
        block_b=list(v.block_b),
        epilogue=v.epilogue.spec(),
        gpu_kernel=gpu_kernel,
        fast_accum=v.fast_accum,
    )


RUNNERS = {"generated": run_generated, "scaled_mm": run_scaled_mm}


def time_kernels(
    use: VariantUse, m: int, n: int, k: int, device, bench: Callable, runners: dict = RUNNERS
) -> tuple[dict[str, float | None], dict[str, str]]:
    """Milliseconds of each runner on one GEMM of `use` at (m, n, k) on `device` (None where it
    failed), and the errors by runner ("inputs" when the inputs could not be made)."""
    try:
        t = make_inputs(use, m, n, k, device=device)
    except Exception as e:  # noqa: BLE001 - a failure is a result here
        return dict.fromkeys(runners), {"inputs": error_line(e)}
    times: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    for path, runner in runners.items():
        try:
            times[path] = bench(functools.partial(runner, use, t))
        except Exception as e:  # noqa: BLE001 - one failing kernel should not stop the others
            times[path], errors[path] = None, error_line(e)
    return times, errors


def bf16_gemm(variant: GemmVariant, m: int, n: int, k: int, device) -> Callable[[], Tensor]:
    """The same GEMM as a model without FP8 runs it: `torch.mm` of a BF16 [m, k] input by a BF16
    [k, n] column-major weight (nn.Linear's), `torch.addmm` with a BF16 bias where `variant` has
    one. The rest of an epilogue is left out: BF16 would run it as ops of their own."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    wt = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()
    if not variant.epilogue.bias:
        return lambda: torch.mm(x, wt)
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    return lambda: torch.addmm(bias, x, wt)


KERNEL_NAMES = {
    "generated": "the generated kernel",
    "scaled_mm": "torch._scaled_mm",
    "bf16": "BF16 torch.mm",
    "inputs": "making its inputs",
}


def measure_gemm(variant: GemmVariant, shape: tuple[int, int, int], device, bench: Callable, runners: dict = RUNNERS):
    """(generated_ms, scaled_mm_ms, bf16_ms) of one GEMM of `variant` at `shape` on `device`, its
    bias, other and residual in BF16, and of the same GEMM in BF16 (`bf16_gemm`;
    `fp8fx.codegen.autotune.Measure`). Raises RuntimeError naming the kernel that failed. Runs
    outside whatever tracing modes the compile has active (fake tensors)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        times, errors = time_kernels(VariantUse(variant, ()), *shape, device, bench, runners)
        if not errors:
            try:
                times["bf16"] = bench(bf16_gemm(variant, *shape, device))
            except Exception as e:  # noqa: BLE001 - raised below as the others are
                errors["bf16"] = error_line(e)
    if errors:
        path, why = next(iter(errors.items()))
        raise RuntimeError(f"{KERNEL_NAMES[path]} failed: {why}")
    return times["generated"], times["scaled_mm"], times["bf16"]


def cuda_bench(fn: Callable[[], object], grad_to_none: list[Tensor] | None = None, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of `fn` (triton.testing.do_bench) after a first call outside the timing
    (autotuning, compilation)."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def device_tables(device: torch.device, measure_gemms: float) -> Tables | None:
    """The measurements that decide `kernels="auto"` on `device`, measuring what they lack within
    `measure_gemms` seconds per process: None off CUDA (CPU tensors run the exact reference)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    bench = functools.partial(cuda_bench, warmup=COMPILE_WARMUP_MS, rep=COMPILE_REP_MS)
    return Tables(torch.cuda.get_device_name(index), functools.partial(measure_gemm, device=device, bench=bench), measure_gemms)
