"""The `fp8fx::*` operators that the graph passes insert (see `library.py`)."""

from fp8fx.ops.library import amax, amax_to_scale, cast, delayed_scale_update, scaled_mm

__all__ = ["amax", "amax_to_scale", "cast", "delayed_scale_update", "scaled_mm"]
