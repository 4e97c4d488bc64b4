"""Shadow high-precision checks (policy `shadow: {every, tolerance_db, patience}`).

insert_casts puts an `fp8fx::tap(out, [left, right(, bias)], checks, key)` (`fp8fx.ops.taps`)
after each FP8 GEMM: it returns a copy of the FP8 result and, on every `every`-th call, the
`ShadowChecks` recompute the product in high precision from the same operands and record the SQNR
of the FP8 result against it. A
GEMM below `tolerance_db` for `patience` consecutive checks is switched to high precision: the
backend recompiles the graphs that hold it, and the report gives the step and the SQNR as the
reason (reason kind `shadow`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fp8fx.core.policy import Shadow
from fp8fx.ops import taps
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
        self.tap_handler = taps.register(self)  # the `handler` of the checks' taps

    @staticmethod
    def key(site: str, role: str) -> str:
        """The tap's `key` for one GEMM."""
        return f"{role}|{site}"

    def tap(self, key: str, out: Tensor, observed: list[Tensor]) -> None:
        """The tap after one FP8 GEMM: its result `out` passes through, `observed` is [left, right(, bias)]."""
        left, right, *bias = observed
        self.check(key, out, left, right, bias[0] if bias else None)

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
