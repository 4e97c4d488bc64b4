"""Old location of `scaled_mm_supports` (now `fp8fx.codegen.dispatch`); the runtime code is `fp8fx.ops.cuda`."""

from fp8fx.codegen.dispatch import scaled_mm_supports

__all__ = ["scaled_mm_supports"]
