"""The installed Triton: whether there is one (`triton_available`), whether its interpreter runs
the kernels (`interpreter_active`), its version, and the features fp8fx uses that older releases lack.

fp8fx supports Triton 3.6 (torch 2.11's) through 3.9 (torch 2.13's). Each gap below was measured:
the feature is missing on every release before `since`. `variants` drops what needs a missing
feature (so nothing asks for it), the tests skip what cannot run, and `fp8fx selftest` lists the
gaps (`limits`). Imports no Triton (the version comes from the package metadata), except
`triton_available` and `interpreter_active` when called, and `patch_interpreter`, which runs only
under Triton's interpreter. `cpu_rowwise_scaled_mm` probes one torch 2.11 gap that only tests meet.
Every other module of fp8fx asks these probes, which import nothing of fp8fx, whether Triton is there.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Feature:
    since: tuple[int, int]  # the first Triton release that has it
    lacking: str  # what a release before it cannot do, for people


FEATURES = {
    # TritonGPUAutomaticWarpSpecialization fails on the persistent TMA kernel in Triton 3.6
    # (NVWSInsertAref); 3.7 builds it.
    "sm100_warp_specialize": Feature((3, 7), "no sm_100a warp specialization"),
    # The interpreter runs no `tl.dot_scaled` before 3.8: MX GEMMs there take the default kernel
    # family, which promotes each 32-K block in fp32, instead of the block-scaled MMA's.
    "interpreter_dot_scaled": Feature(
        (3, 8), "no tl.dot_scaled in the interpreter, whose MX GEMMs promote each 32-K block instead"
    ),
    # The interpreter decodes every dot_scaled scale as E8M0 before 3.9, with no hook to teach it
    # NVFP4's E4M3 scales (fp8fx.codegen.launch): NVFP4 GEMMs cannot run in it.
    "interpreter_e4m3_scales": Feature((3, 9), "no NVFP4 GEMMs in the interpreter, which reads dot_scaled scales as E8M0 only"),
    # Triton 3.6 spills 8 bytes (255 registers) in the sm_90a 2D-2D grouped GEMM (MoE weight
    # gradients) with 128 x 128 tiles on 8 warps; 3.7 builds it without (253 registers).
    "sm90_grouped_wgrad_128x128": Feature((3, 7), "no 128 x 128 tiles for sm_90a grouped weight-gradient GEMMs, which spill"),
}
# Before 3.7 the interpreter converts a scalar to an index with int() of a 1-element array, which
# NumPy >= 2.4 refuses: any loop whose bounds are run-time scalars fails. `patch_interpreter`
# applies Triton 3.7's fix (triton-lang/triton#9171), so this is not a gap.
INTERPRETER_INDEX_FIXED = (3, 7)


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported here (Linux wheels; not on macOS or Windows)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_active() -> bool:
    """Triton's interpreter runs the kernels on CPU tensors (TRITON_INTERPRET=1 when Triton was imported)."""
    if not triton_available():
        return False
    import triton

    return bool(triton.knobs.runtime.interpret)


def _parse(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(v) for v in match.groups(default="0")) if match else ()


@functools.cache
def triton_version_string() -> str | None:
    """The installed Triton's version ("3.6.0"), from its package metadata; None without Triton."""
    for dist in ("triton", "pytorch-triton"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def triton_version() -> tuple[int, ...] | None:
    """(major, minor, patch) of the installed Triton; None without Triton."""
    version = triton_version_string()
    return _parse(version) if version else None


def has(feature: str) -> bool:
    """Whether the installed Triton has `feature` (a key of FEATURES). Without Triton: True, since
    nothing of it runs (the offline builds and the interpreter need Triton anyway)."""
    version = triton_version()
    return not version or version[:2] >= FEATURES[feature].since


def missing() -> list[str]:
    """The FEATURES the installed Triton lacks."""
    return [name for name in FEATURES if not has(name)]


def reason(name: str) -> str:
    """What this Triton lacks of feature `name`, for people, e.g.
    "Triton 3.6.0: no sm_100a warp specialization (needs Triton >= 3.7)"."""
    feature = FEATURES[name]
    return f"Triton {triton_version_string()}: {feature.lacking} (needs Triton >= {'.'.join(map(str, feature.since))})"


def limits() -> list[str]:
    """One line per feature this Triton lacks (`reason`); [] when none."""
    return [reason(name) for name in missing()]


@functools.cache
def cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU `torch._scaled_mm` takes rowwise scales (torch 2.13 does; 2.11's
    takes per-tensor scales only). fp8fx itself never runs it on CPU tensors (they take the exact
    emulation); tests that run the CUDA launcher's `torch._scaled_mm` path on CPU need it."""
    import torch

    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    scale_a, scale_b = torch.ones(16, 1), torch.ones(1, 16)
    try:
        torch._scaled_mm(a, a.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def patch_interpreter() -> None:
    """Under Triton's interpreter before 3.7, make a scalar usable as a loop bound with NumPy 2.4.

    The interpreter holds each scalar as a 1-element NumPy array and converts it to an index (the
    bounds of `range` / `tl.range`) with `int(array)`, which NumPy 2.4 refuses for arrays with a
    dimension ("only 0-dimensional arrays can be converted to Python scalars"). The kernels' loops
    over run-time bounds (K, a block's rows, a group's tiles) cannot be written without one, so the
    interpreter gets Triton 3.7's own fix: `int(array.squeeze())`. Nothing changes on a GPU, on
    Triton >= 3.7, or when the interpreter is off."""
    version = triton_version()
    if not version or version[:2] >= INTERPRETER_INDEX_FIXED:
        return
    import triton

    if not triton.knobs.runtime.interpret:
        return
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "fp8fx_index", False):
        return

    def patch_tensor_index_too(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_tensor_index_too.fp8fx_index = True
    interpreter._patch_lang_tensor = patch_tensor_index_too
