"""`fp8fx::tap`: how compiled graphs hand tensors to Python code that watches them, and the
registry of that code.

    fp8fx::tap(Tensor passthrough, Tensor[] observed, int handler, str key) -> Tensor

returns a copy of `passthrough` and calls `handler.tap(key, passthrough, observed)` on the
handler registered under that number. The graph uses the copy in place of `passthrough`, so the
tap stays in the graph through partitioning, dead-code elimination and Inductor, at the cost of
one copy. Three kinds of handler use it: the runtime monitor (`fp8fx.runtime.monitor`: the scale
of a cast passes through, the cast's input is observed), shadow checks (`fp8fx.runtime.shadow`:
the FP8 GEMM's result passes through, its high-precision operands are observed) and numerics
probes (`fp8fx.runtime.numerics`: a GEMM's left operand passes through, its right one is observed).
What `key` means is the handler's own business.

Handlers are held weakly: a graph outliving its handler (a backend that was dropped) taps nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fp8fx.ops.registry import Registry

_HANDLERS = Registry("tap handler", "tap")


def register(handler) -> int:
    """Register `handler` (held weakly); returns the number graphs pass as the tap's `handler`."""
    return _HANDLERS.register(handler)


def unregister(number: int) -> None:
    """Taps with this number do nothing from now on."""
    _HANDLERS.unregister(number)


def lookup(number: int):
    """The handler registered under `number`, or None (never registered, unregistered, or collected)."""
    return _HANDLERS.lookup(number)


@torch.library.custom_op("fp8fx::tap", mutates_args=())
def tap(passthrough: Tensor, observed: list[Tensor], handler: int, key: str) -> Tensor:
    """Call the registered handler's `tap(key, passthrough, observed)`; returns a copy of `passthrough`."""
    found = _HANDLERS.lookup(handler)
    if found is not None:
        found.tap(key, passthrough, observed)
    return passthrough.clone()


@tap.register_fake
def _(passthrough: Tensor, observed: list[Tensor], handler: int, key: str) -> Tensor:
    return torch.empty_like(passthrough)
