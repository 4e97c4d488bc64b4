"""Which kernel runs each FP8 GEMM on a GPU (the implementations that run it: `fp8fx.ops.cuda`).

`choose_kernel` decides once per GEMM, when the graph is rewritten, and the report shows the choice
and its reason. Where no measurement applies, `kernels="auto"` cannot lose to cuBLAS by design: a
GEMM whose fused epilogue saves no memory pass runs `torch._scaled_mm`, and the generated kernel
runs only where fusion saves passes. On a GPU the measurements decide instead, from the measured
shape of the same variant nearest to the GEMM's: the table `fp8fx selftest` wrote for the GPU
model, and the GEMMs measured at the first compile that met them (`fp8fx.codegen.autotune`, whose
`Tables` the caller passes in as `tables`); the choice carries the times it read (`Timing`), BF16's
among them, by which `fp8fx.passes.prefer_bf16` keeps high a GEMM measured slower in FP8. Without
Triton every GEMM runs `torch._scaled_mm`; `scaled_mm_supports` says what PyTorch's scaled-mm
kernels can run at all.

Under Inductor, which fuses elementwise code into its own kernels, an epilogue costs almost nothing
outside the GEMM: `epilogue_to_inductor` leaves it there unless the table shows the generated
kernel with the epilogue beating cuBLAS's bare GEMM. This module imports no Triton.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from fp8fx.codegen.variants import GemmVariant
from fp8fx.codegen.versions import triton_available
from fp8fx.core.epilogue import PLAIN

TABLE_FORMAT = 1


def scaled_mm_kind(block_a: list[int], block_b: list[int]) -> str | None:
    """Which of PyTorch's scaled-mm kernels takes these scale blocks: "tensorwise", "rowwise" (a
    rowwise GEMM may have one tensorwise side) or "blockwise"; None: none of them.

    MX's 1x32 blocks are None: `torch._scaled_mm` runs them only on sm_100 with E8M0 scales in
    cuBLAS's swizzled block layout, not with the fp32 per-block scale inverses fp8fx passes."""
    block_a, block_b = list(block_a), list(block_b)
    if not block_a and not block_b:
        return "tensorwise"
    if block_a in ([], [1, 0]) and block_b in ([], [0, 1]):
        return "rowwise"
    if block_a in ([1, 128], [128, 128]) and block_b in ([128, 1], [128, 128]):
        return "blockwise"
    return None


def scaled_mm_supports(variant: GemmVariant) -> str:
    """Why PyTorch's scaled-mm kernels cannot run `variant`'s GEMM ("" when they can)."""
    block_a, block_b = list(variant.block_a), list(variant.block_b)
    if variant.a_dtype == variant.b_dtype == torch.float8_e5m2:
        return "two E5M2 operands"
    if scaled_mm_kind(block_a, block_b):
        return ""
    if block_a == [1, 32] and block_b == [32, 1]:
        return f"MX scale blocks {block_a} x {block_b}, which it takes only as swizzled E8M0 scales"
    return f"scale blocks {block_a} x {block_b}"


def cache_dir() -> Path:
    """Where fp8fx keeps its measurements: `$FP8FX_CACHE_DIR`, default `~/.cache/fp8fx`."""
    return Path(os.environ.get("FP8FX_CACHE_DIR", Path.home() / ".cache" / "fp8fx"))


def device_label(device_name: str) -> str:
    """A GPU's name as part of a file name ("NVIDIA-H100-80GB-HBM3")."""
    return re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-")


def table_path(device_name: str) -> Path:
    """Where `fp8fx selftest` writes, and the dispatch reads, the measured table of one GPU model:
    `cache_dir()`/dispatch-<device name>.json."""
    return cache_dir() / f"dispatch-{device_label(device_name)}.json"


def load_table(path: Path) -> list[dict]:
    """The measured GEMMs of a table file: dicts with variant, m, n, k, generated_ms, scaled_mm_ms
    (scaled_mm_ms includes the epilogue run as separate torch ops) and, where measured, bf16_ms
    (`fp8fx.ops.gemm_bench.bf16_gemm`; absent from tables written before fp8fx timed it, null where
    selftest's BF16 timing failed). Raises naming the file and the first bad entry."""
    return table_entries(read_json(path), path)


def read_json(path: Path):
    """The JSON in `path`; ValueError naming the file when it holds none."""
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None


def table_entries(data, path: Path) -> list[dict]:
    """`data["gemms"]` of a table read from `path`, checked as `load_table` says."""
    if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT or not isinstance(data.get("gemms"), list):
        raise ValueError(f"{path}: not an fp8fx dispatch table (format {TABLE_FORMAT} with a 'gemms' list)")
    for i, e in enumerate(data["gemms"]):
        ok = isinstance(e, dict) and isinstance(e.get("variant"), str)
        ok = ok and all(isinstance(e.get(key), int) and e[key] > 0 for key in ("m", "n", "k"))
        ok = ok and all(isinstance(e.get(key), (int, float)) and e[key] > 0 for key in ("generated_ms", "scaled_mm_ms"))
        ok = ok and (e.get("bf16_ms") is None or isinstance(e["bf16_ms"], (int, float)) and e["bf16_ms"] > 0)
        if not ok:
            raise ValueError(
                f"{path}: gemms[{i}] needs variant (str), m, n, k (positive ints), generated_ms and scaled_mm_ms (> 0), "
                f"and bf16_ms > 0 or null where given: {e!r}"
            )
    return data["gemms"]


class Measurements(Protocol):
    """The measurements that decide GEMMs on one GPU (`fp8fx.codegen.autotune.Tables`)."""

    def entries(self, variants: list[GemmVariant], shape: tuple, hint: tuple | None = None) -> tuple[list[dict], str]:
        """Table entries (load_table's dicts; `source` and `compiled_on` say where one was measured)
        after measuring those of `variants` at `shape` that were missing, and why any was not ("")."""
        ...


def log_distance(entry: dict, shape: tuple) -> float:
    """How far a measured entry lies from (m, n, k): the sum of |log2(entry / shape)| over the
    sizes known (a dynamic size, None, is left out)."""
    return sum(abs(math.log2(entry[d] / v)) for d, v in zip("mnk", shape) if isinstance(v, int) and v > 0)


def nearest(table: list[dict], name: str, shape: tuple) -> dict | None:
    """The measured entry of variant `name` nearest to (m, n, k) in log-distance, the first of
    equally near ones; None without one. A dynamic M (None) matches on N and K."""
    same = [e for e in table if e["variant"] == name]
    return min(same, key=lambda e: log_distance(e, shape)) if same else None


def _measured_at(e: dict) -> str:
    on = f" at first compile on {e['compiled_on']}" if e.get("compiled_on") else ""
    return f"measured{on} at {e['m']}x{e['n']}x{e['k']}"


def _sources(*entries: dict) -> str:
    """The files the entries were read from, as " (file; file)" after a reason; "" if they do not say."""
    files = list(dict.fromkeys(e["source"] for e in entries if e.get("source")))
    return f" ({'; '.join(files)})" if files else ""


@dataclass(frozen=True)
class Timing:
    """The measured entry a kernel choice read, in ms: the generated kernel and `torch._scaled_mm`
    (each with the variant's epilogue, run after `torch._scaled_mm` as torch ops), and BF16's
    `torch.mm` (`addmm` with a bias; None: not in the table) at the same shape."""

    generated_ms: float
    scaled_mm_ms: float
    bf16_ms: float | None
    at: str  # "measured [at first compile on <GPU>] at MxNxK"
    sources: str = ""  # " (<the file>)", or "" when the entry does not say

    @property
    def kernel(self) -> str:
        """The kernel the times favour: "triton" (the generated kernel, also on a tie) or "scaled_mm"."""
        return "triton" if self.generated_ms <= self.scaled_mm_ms else "scaled_mm"

    @property
    def fp8_ms(self) -> float:
        """The time of the kernel the times favour."""
        return min(self.generated_ms, self.scaled_mm_ms)

    def text(self) -> str:
        bf16 = f", BF16 {self.bf16_ms:.3g} ms" if self.bf16_ms is not None else ""
        return f"{self.at}: generated {self.generated_ms:.3g} ms, torch._scaled_mm {self.scaled_mm_ms:.3g} ms{bf16}{self.sources}"

    def bf16_faster(self) -> str:
        """Why BF16 beats the kernel the times favour ("" when it does not, or was not measured)."""
        if self.bf16_ms is None or self.fp8_ms <= self.bf16_ms:
            return ""
        kernel = "the generated kernel" if self.kernel == "triton" else "torch._scaled_mm"
        return (
            f"measured slower in FP8 than in BF16: {kernel} {self.fp8_ms:.3g} ms, BF16 torch.mm {self.bf16_ms:.3g} ms, "
            f"{self.at}{self.sources}"
        )


class KernelChoice(NamedTuple):
    """What `choose_kernel` decided for one FP8 GEMM, why, and the measurement that decided (None:
    none did)."""

    kernel: str
    reason: str
    timing: Timing | None = None


def measured_choice(table: list[dict], variant: GemmVariant, shape: tuple) -> Timing | None:
    """The times measured for `variant` at the shape of the same variant nearest to (m, n, k) in
    log-distance (`Timing.kernel`: the kernel they favour); None without one."""
    e = nearest(table, variant.name, shape)
    if e is None:
        return None
    return Timing(e["generated_ms"], e["scaled_mm_ms"], e.get("bf16_ms"), _measured_at(e), _sources(e))


def _noted(reason: str, note: str) -> str:
    return f"{reason}; {note}" if note else reason


def choose_kernel(
    kernels: str, variant: GemmVariant, shape: tuple, tables: Measurements | None = None, hint: tuple | None = None
) -> KernelChoice:
    """(kernel, reason, timing): "triton" (the generated kernel) or "scaled_mm" (`torch._scaled_mm`,
    then the epilogue as torch ops) for one FP8 GEMM of `shape` (m, n, k; a size may be None when
    dynamic), and the measurement that decided.

    Args:
        tables: the measurements of the GPU that runs the GEMM; None off a GPU (none applies).
        hint: the graph's size hints for `shape`, where a dynamic size is measured.
    """
    if kernels == "scaled_mm":
        if variant.mx and triton_available():  # (fp8fx.ops.cuda runs it there too: not a refusal)
            return KernelChoice(
                "triton", f"torch._scaled_mm cannot: {scaled_mm_supports(variant)} (kernels='scaled_mm' asked for it)"
            )
        return KernelChoice("scaled_mm", "backend option kernels='scaled_mm'")
    if not triton_available():  # (kernels="triton" without Triton is refused by fp8fx.backend)
        return KernelChoice("scaled_mm", "Triton is not installed")
    if kernels == "triton":
        return KernelChoice("triton", "backend option kernels='triton'")
    unsupported = scaled_mm_supports(variant)
    if unsupported:
        return KernelChoice("triton", f"torch._scaled_mm cannot: {unsupported}")
    note = ""
    if tables is not None:
        table, note = tables.entries([variant], shape, hint)
        timing = measured_choice(table, variant, shape)
        if timing is not None:
            return KernelChoice(timing.kernel, _noted(timing.text(), note), timing)
    saved = variant.epilogue.ops() + variant.epilogue.out_amax
    if saved == 0:
        return KernelChoice(
            "scaled_mm", _noted("no epilogue to fuse: cuBLAS's GEMM until a measurement favours the generated kernel", note)
        )
    return KernelChoice("triton", _noted(f"fused epilogue saves {saved} memory pass{'es' if saved > 1 else ''}", note))


# Why Inductor gets the epilogue when no table says otherwise: on a Llama-3-8B-shaped step, the
# GEMMs the generated kernel ran with fused epilogues took longer than cuBLAS running the same
# GEMMs bare with Inductor fusing their epilogues into the next cast's kernel (docs/results.md,
# "On a GPU", second and third runs); the H200 selftest table has no shape where the fused
# kernel beats cuBLAS's bare GEMM.
UNMEASURED_TO_INDUCTOR = (
    "Inductor fuses the epilogue into its next kernel, and cuBLAS's bare GEMM measured faster than the generated kernel "
    "with the epilogue (H100 and H200) until this GPU's table says otherwise"
)


def bare_variant(variant: GemmVariant) -> GemmVariant:
    """`variant` without its epilogue: the GEMM alone, writing the high-precision result (an FP8
    output is the epilogue's cast)."""
    wide = variant.aux_dtype if variant.out_dtype.itemsize == 1 else variant.out_dtype
    return replace(variant, epilogue=PLAIN, out_dtype=wide, aux_dtype=wide)


def epilogue_to_inductor(
    kernels: str, variant: GemmVariant, shape: tuple, tables: Measurements | None = None, hint: tuple | None = None
) -> str:
    """Why a graph that Inductor compiles should run `variant`'s epilogue (bias, activation, product,
    residual, amax, FP8 output) as its own code after a bare GEMM, rather than in the generated
    kernel ("" when the kernel should fuse it). `tables` and `hint` as for `choose_kernel`."""
    if bare_variant(variant) == variant or kernels == "triton":
        return ""
    if scaled_mm_supports(variant):
        return ""  # only the generated kernel runs this GEMM: the epilogue rides on it
    if kernels == "scaled_mm":
        return "backend option kernels='scaled_mm': cuBLAS's bare GEMM, the epilogue fused by Inductor"
    if not triton_available():
        return "Triton is not installed: cuBLAS's bare GEMM, the epilogue fused by Inductor"
    note = ""
    if tables is not None:
        table, note = tables.entries([variant, bare_variant(variant)], shape, hint)
        measured = measured_fusion(table, variant, shape)
        if measured is not None:
            fuse, where = measured
            return "" if fuse else _noted(f"Inductor fuses the epilogue: {where}", note)
    return _noted(UNMEASURED_TO_INDUCTOR, note)


def measured_fusion(table: list[dict], variant: GemmVariant, shape: tuple) -> tuple[bool, str] | None:
    """Whether the measurements favour the generated kernel with `variant`'s epilogue over cuBLAS's
    bare GEMM (the same variant without epilogue, run by `torch._scaled_mm`), each at its measured
    shape nearest to (m, n, k); None without both."""
    fused, plain = nearest(table, variant.name, shape), nearest(table, bare_variant(variant).name, shape)
    if fused is None or plain is None:
        return None
    on = next((f"measured at first compile on {e['compiled_on']}: " for e in (fused, plain) if e.get("compiled_on")), "")
    where = (
        f"{on}generated kernel with the epilogue {fused['generated_ms']:.3g} ms at {fused['m']}x{fused['n']}x{fused['k']}, "
        f"cuBLAS's bare GEMM {plain['scaled_mm_ms']:.3g} ms at {plain['m']}x{plain['n']}x{plain['k']}{_sources(fused, plain)}"
    )
    return fused["generated_ms"] <= plain["scaled_mm_ms"], where


def grouped_launcher():
    """The generated grouped FP8 GEMM's launcher (`fp8fx.codegen.launch.grouped_fp8_gemm`), or None
    without Triton. Imported when asked for: the launcher imports Triton."""
    if not triton_available():
        return None
    from fp8fx.codegen.launch import grouped_fp8_gemm

    return grouped_fp8_gemm
