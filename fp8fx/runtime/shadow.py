"""Shadow high-precision checks (policy `shadow: {every, tolerance_db, patience}`).

insert_casts puts an `fp8fx::shadow_check(out, left, right, bias, checks, key)` after each FP8
GEMM: it returns a copy of the FP8 result and, on every `every`-th call, recomputes the product
in high precision from the same operands and records the SQNR of the FP8 result against it. A
GEMM below `tolerance_db` for `patience` consecutive checks is switched to high precision: the
backend recompiles the graphs that hold it, and the report gives the step and the SQNR as the
reason (reason kind `shadow`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fp8fx.core.policy import Shadow
from fp8fx.runtime.numerics import sqnr_db


@dataclass(frozen=True)
class Check:
    site: str
    role: str
    step: int  # calls of this GEMM so far when checked
    sqnr_db: float


class ShadowChecks:
    """The checks of one backend: every result, and the GEMMs switched to high precision."""

    def __init__(self, settings: Shadow, on_switch: Callable[[str, str, str], None]):
        self.settings = settings
        self.on_switch = on_switch
        self.checks: list[Check] = []
        self.switched: list[Check] = []
        self._calls: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        _CHECKS[id(self)] = self

    @staticmethod
    def key(site: str, role: str) -> str:
        return f"{role}|{site}"

    def check(self, key: str, out: Tensor, left: Tensor, right: Tensor, bias: Tensor | None) -> None:
        step = self._calls.get(key, 0)
        self._calls[key] = step + 1
        if step % self.settings.every:
            return
        reference = torch.matmul(left.detach().double(), right.detach().double())
        if bias is not None:
            reference = reference + bias.detach().double()
        sqnr = sqnr_db(reference, out)  # a non-finite FP8 result gives -inf: it fails the check
        role, site = key.split("|", 1)
        result = Check(site, role, step, sqnr)
        self.checks.append(result)
        self._failures[key] = self._failures.get(key, 0) + 1 if sqnr < self.settings.tolerance_db else 0
        if self._failures[key] == self.settings.patience:
            self.switched.append(result)
            reason = (
                f"shadow check: output SQNR below {self.settings.tolerance_db:g} dB for {self.settings.patience} "
                f"consecutive checks (last {sqnr:.1f} dB at step {step}); switched to high precision"
            )
            self.on_switch(site, role, reason)


_CHECKS: weakref.WeakValueDictionary[int, ShadowChecks] = weakref.WeakValueDictionary()


@torch.library.custom_op("fp8fx::shadow_check", mutates_args=())
def shadow_check(out: Tensor, left: Tensor, right: Tensor, bias: Tensor | None, checks: int, key: str) -> Tensor:
    """Check the FP8 result `out` against `left @ right (+ bias)` for `checks` (see the module
    docstring); returns a copy of `out`."""
    found = _CHECKS.get(checks)
    if found is not None:
        found.check(key, out, left, right, bias)
    return out.clone()


@shadow_check.register_fake
def _(out: Tensor, left: Tensor, right: Tensor, bias: Tensor | None, checks: int, key: str) -> Tensor:
    return torch.empty_like(out)
