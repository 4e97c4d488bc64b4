"""The `fp8fx::*` operators that the graph passes insert (see `library.py`)."""

from fp8fx.ops.library import amax, amax_to_scale, cast, scaled_mm

__all__ = ["amax", "amax_to_scale", "cast", "scaled_mm"]
