"""Divergence bisection: which FP8 GEMMs make an FP8 run's loss leave the fp32 one?

The same deterministic steps (a fresh model from the same seed, the same batches, plain SGD) are
trained in fp32 and with fp8fx under the policy. The gap is the mean relative difference of the
per-step losses. Then, over the candidates (every FP8 GEMM: site x {output, grad_input,
grad_weight}), a recursive bisection finds a smallest set whose high precision closes the gap
(leaves at most `close` of it), and the result is written as a policy patch that keeps exactly
that set high (`fp8fx analyze --policy` and compilation accept it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fp8fx.compiler.backend import backend as make_backend
from fp8fx.compiler.backend import report as report_of
from fp8fx.compiler.prepare import prepare
from fp8fx.core.policy import Policy
from fp8fx.core.policy_yaml import policy_from_yaml
from fp8fx.reporting.op_record import OpRecord
from fp8fx.tools.suggest import Flag, policy_keeping_high

Gemm = tuple[str, str]  # (site, role)


@dataclass
class BisectResult:
    gap: float  # the FP8 run's mean relative loss gap to fp32
    culprits: list[Gemm]  # a smallest set whose high precision closes it
    remaining_gap: float  # the gap with the culprits high
    runs: int  # training runs it took (fp32 and the FP8 baseline included)
    policy_yaml: str  # the policy with rules keeping the culprits high
    trials: list[tuple[int, float]] = field(default_factory=list)  # (set size, gap) of each trial


def _losses(
    make_model: Callable[[], nn.Module], batches: list[tuple], loss_fn, lr: float, policy: Policy | None
) -> tuple[list[float], list[OpRecord]]:
    model = make_model()
    if policy is not None and policy.uses_delayed_scaling:
        prepare(model)
    backend = make_backend(policy=policy, inner="eager") if policy is not None else None
    run = torch.compile(model, backend=backend) if backend is not None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    try:
        for batch in batches:
            loss = loss_fn(run(*batch))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    finally:
        torch._dynamo.reset()
    return losses, (report_of(backend).ops if backend is not None else [])


DIVERGED = 1e6  # the gap a non-finite loss counts as: any set that keeps the run finite beats it


def _gap(losses: list[float], reference: list[float]) -> float:
    return sum(abs(a - b) / max(abs(b), 1e-12) if math.isfinite(a) else DIVERGED for a, b in zip(losses, reference)) / len(
        reference
    )


def _patch(
    policy: Policy, records: list[OpRecord], ops: dict[Gemm, OpRecord], gemms: list[Gemm], why: Callable[[Gemm], str], basis: str
) -> str:
    """The policy YAML keeping `gemms` high (every trial runs the same text the result is written as)."""
    flagged: dict[str, list[Flag]] = {}
    for gemm in gemms:
        flagged.setdefault(gemm[0], []).append(Flag(ops[gemm], why(gemm)))
    return policy_keeping_high(records, flagged, policy, "fp8fx bisect", basis)[0]


def bisect(
    make_model: Callable[[], nn.Module],
    batches: list[tuple],
    policy: Policy | None = None,
    loss_fn: Callable | None = None,
    lr: float = 1e-2,
    close: float = 0.1,
    progress: Callable[[int, float], None] | None = None,
) -> BisectResult:
    """Find a smallest set of FP8 GEMMs whose high precision closes the loss gap to fp32.

    `make_model()` must build the same model every call (seed inside it); one training step runs
    per batch. A set closes the gap when the gap with it high is at most `close` times the FP8
    run's. `progress(runs, gap)` is called after each trial run."""
    policy = policy or Policy()
    loss_fn = loss_fn or (lambda out: (out if isinstance(out, torch.Tensor) else out[0]).float().pow(2).mean())
    reference, _ = _losses(make_model, batches, loss_fn, lr, None)
    fp8_losses, records = _losses(make_model, batches, loss_fn, lr, policy)
    ops = {(op.site, op.role): op for op in records if op.precision == "fp8"}
    gap = _gap(fp8_losses, reference)
    trials: list[tuple[int, float]] = []
    cache: dict[frozenset, float] = {}

    def gap_with_high(gemms: list[Gemm]) -> float:
        key = frozenset(gemms)
        if key not in cache:
            trial = policy_from_yaml(_patch(policy, records, ops, gemms, lambda g: "trial", "a bisection trial"))
            cache[key] = _gap(_losses(make_model, batches, loss_fn, lr, trial)[0], reference) if gemms else gap
            trials.append((len(gemms), cache[key]))
            if progress:
                progress(len(trials) + 2, cache[key])
        return cache[key]

    def closes(gemms: list[Gemm]) -> bool:
        return gap_with_high(gemms) <= close * gap

    def minimize(candidates: list[Gemm], fixed: list[Gemm]) -> list[Gemm]:
        """A smallest part of `candidates` that closes the gap together with `fixed`."""
        if len(candidates) <= 1:
            return candidates
        half = len(candidates) // 2
        first, second = candidates[:half], candidates[half:]
        if closes(fixed + first):
            return minimize(first, fixed)
        if closes(fixed + second):
            return minimize(second, fixed)
        kept_first = minimize(first, fixed + second)
        return kept_first + minimize(second, fixed + kept_first)

    candidates = list(ops)
    culprits = minimize(candidates, []) if candidates and gap > 0 and closes(candidates) else []
    remaining = gap_with_high(culprits) if culprits else gap

    def why(gemm: Gemm) -> str:
        return (
            f"{gemm[1]}: with the GEMMs kept high here the loss gap to fp32 falls from {100 * gap:.3g}% to {100 * remaining:.3g}%"
        )

    text = _patch(
        policy, records, ops, culprits, why, f"bisection over {len(candidates)} FP8 GEMMs and {len(batches)} training steps"
    )
    return BisectResult(gap, culprits, remaining, len(trials) + 2, text, trials)
