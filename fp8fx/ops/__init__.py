"""The `fp8fx::*` operators: schemas, fakes and reference (CPU) implementations in `library.py`,
the GPU implementations in `cuda.py`, the tap op and its handler registry in `taps.py`."""

from fp8fx.ops import cuda, taps  # noqa: F401  (registers the GPU implementations, and fp8fx::tap)
from fp8fx.ops.library import amax, amax_to_scale, cast, delayed_scale_update, fp8_gemm, scaled_mm

__all__ = ["amax", "amax_to_scale", "cast", "delayed_scale_update", "fp8_gemm", "scaled_mm"]
