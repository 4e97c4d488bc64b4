"""The `fp8fx::*` operators, all defined here: the FP8 chain's schemas, fakes and reference (CPU)
implementations in `library.py`, their GPU implementations in `cuda.py`, the tap op and its
handler registry in `taps.py`, delayed scaling's state ops and their instance registry in
`delayed.py` (both registries: `registry.py`), the ONNX export's ops in `export.py`, NVFP4's
transform, scales and FP4 cast in `nvfp4.py`; the GEMM ops' arguments as records read and written
by name in `args.py`."""

# Imported to register the GPU implementations, fp8fx::tap, the state, export and NVFP4 ops.
from fp8fx.ops import cuda, delayed, export, nvfp4, taps  # noqa: F401
from fp8fx.ops.library import amax, amax_to_scale, cast, delayed_scale_update, fp8_gemm, scaled_mm

__all__ = ["amax", "amax_to_scale", "cast", "delayed_scale_update", "fp8_gemm", "scaled_mm"]
