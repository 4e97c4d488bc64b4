"""The options of a compile: one frozen value, validated once, passed whole.

`fp8fx.backend(...)` builds a `BackendOptions` from its keyword arguments and the policy; the
backend keeps it, the passes read it from their `PassContext`, and a variant of it is made with
`dataclasses.replace` (which validates again). It lives with the passes, the lowest layer that can
check everything an option needs: the policy (`fp8fx.core`) and whether Triton imports here
(`fp8fx.codegen`), and a layer that the passes and the compiler both import.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from fp8fx.codegen.autotune import MEASURE_GEMMS_S
from fp8fx.codegen.dispatch import triton_available
from fp8fx.core.policy import Policy, Precision
from fp8fx.core.policy_yaml import as_policy

INNER_COMPILERS = ("inductor", "eager")
KERNELS = ("auto", "triton", "scaled_mm")  # see fp8fx.codegen.dispatch.choose_kernel
SAVED_OUTPUTS = ("bf16", "high")  # see fp8fx.passes.saved_outputs
SAVED_ACTIVATIONS = ("fp8", "high")  # see fp8fx.passes.saved_activations
WEIGHT_FP8 = ("auto", "keep", "recompute")  # see fp8fx.passes.insert_casts


@dataclass(frozen=True, kw_only=True)
class BackendOptions:
    """What a backend compiles with; `fp8fx.backend` says what each option does.

    Built from what the caller gave, then resolved: `policy` becomes the `Policy` it names (a file
    is read), `weight_fp8="auto"` becomes "keep" or "recompute" by the policy's scaling, and
    `epilogues_to_inductor=None` becomes whether `inner` is "inductor". Invalid values raise the
    errors `fp8fx.backend` raises."""

    policy: Policy | str | Path | None = None  # a Policy once built
    inner: str = "inductor"
    keep_graphs: bool = False
    fuse_epilogues: bool = True
    kernels: str = "auto"
    # Seconds per process that kernels="auto" may spend timing, at compile, the GEMMs no measurement
    # covers on a GPU (fp8fx.codegen.autotune); 0: none.
    measure_gemms: float = MEASURE_GEMMS_S
    monitor_every: int = 0
    saved_outputs: str = "bf16"
    # What backward reads besides FP8 GEMM operands, kept in FP8 or high precision where the policy's
    # `saved_activations` section sets no precision; None: the policy's (high when it sets none).
    saved_activations: str | None = None
    weight_fp8: str = "auto"
    # The device types whose GEMMs the graph gives to cuBLAS become `aten._scaled_mm` under Inductor
    # (`fp8fx.compiler.lowering`); ("cpu", "cuda") runs on CPU tensors the graph a GPU runs.
    cublas_devices: tuple[str, ...] = ("cuda",)
    # Plan epilogues for Inductor's fusion (fp8fx.codegen.dispatch.epilogue_to_inductor); None:
    # when `inner` is "inductor" (fp8fx.analyze compiles eagerly but plans what Inductor runs).
    epilogues_to_inductor: bool | None = None

    def __post_init__(self) -> None:
        if self.inner not in INNER_COMPILERS:
            raise ValueError(f"fp8fx.backend: inner must be one of {', '.join(INNER_COMPILERS)}, got {self.inner!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"fp8fx.backend: kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if self.kernels == "triton" and not triton_available():
            raise RuntimeError("fp8fx.backend(kernels='triton') needs Triton, which is not installed here; use kernels='auto'")
        m = self.measure_gemms
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (0 <= m < math.inf):
            raise ValueError(
                f"fp8fx.backend: measure_gemms must be the seconds per process that kernels='auto' may spend measuring "
                f"GEMMs on a GPU, a number >= 0 (0 measures none), got {m!r}"
            )
        if self.saved_outputs not in SAVED_OUTPUTS:
            choices = ", ".join(SAVED_OUTPUTS)
            raise ValueError(f"fp8fx.backend: saved_outputs must be one of {choices}, got {self.saved_outputs!r}")
        if self.saved_activations is not None and self.saved_activations not in SAVED_ACTIVATIONS:
            choices = ", ".join(SAVED_ACTIVATIONS)
            raise ValueError(f"fp8fx.backend: saved_activations must be one of {choices} or None, got {self.saved_activations!r}")
        if self.weight_fp8 not in WEIGHT_FP8:
            raise ValueError(f"fp8fx.backend: weight_fp8 must be one of {', '.join(WEIGHT_FP8)}, got {self.weight_fp8!r}")
        policy = as_policy(self.policy, "fp8fx.backend")
        weight_fp8 = self.weight_fp8
        if weight_fp8 == "auto":  # delayed scaling cannot cast again in backward (see below)
            weight_fp8 = "keep" if policy.uses_delayed_scaling else "recompute"
        if weight_fp8 == "recompute" and policy.uses_delayed_scaling:  # the state moves on at the end of forward
            raise ValueError(
                "fp8fx.backend: weight_fp8='recompute' needs dynamic scaling: with delayed scaling backward would "
                "cast the weight with the scale updated after forward"
            )
        saved = policy.saved_activations.precision
        if self.saved_activations is not None and saved is not None and saved.value != self.saved_activations:
            raise ValueError(
                f"fp8fx.backend: saved_activations={self.saved_activations!r} contradicts the policy's "
                f"saved_activations.precision: {saved.value}{f' ({policy.source})' if policy.source else ''}; give one of them"
            )
        if self.saved_outputs == "high" and (
            self.saved_activations == "fp8"
            or saved is Precision.FP8
            or any(r.precision is Precision.FP8 for r in policy.saved_activations.rules)
        ):
            raise ValueError(
                "fp8fx.backend: saved_outputs='high' keeps the GEMM outputs backward reads in their precision, and "
                "saved_activations keeps them in FP8: turn one of them off"
            )
        devices = self.cublas_devices
        if isinstance(devices, str) or not all(isinstance(d, str) for d in devices):
            raise TypeError(f"fp8fx.backend: cublas_devices must be a tuple of device types such as ('cuda',), got {devices!r}")
        to_inductor = self.inner == "inductor" if self.epilogues_to_inductor is None else self.epilogues_to_inductor
        resolved = dict(policy=policy, weight_fp8=weight_fp8, cublas_devices=tuple(devices), epilogues_to_inductor=to_inductor)
        for name, value in resolved.items():
            object.__setattr__(self, name, value)  # (frozen: set once, here)

    @property
    def saved_precision(self) -> Precision:
        """The precision of saved activations where the policy's `saved_activations` section sets none."""
        return Precision(self.saved_activations or "high")

    @property
    def saves_fp8(self) -> bool:
        """Whether any saved activation may be kept in FP8 (the partitioner then rewrites them)."""
        saved = self.policy.saved_activations
        if (saved.precision or self.saved_precision) is Precision.FP8:
            return True
        return any(r.precision is Precision.FP8 for r in saved.rules)

    def replace(self, **changes) -> BackendOptions:
        """These options with `changes` (`dataclasses.replace`: validated again)."""
        return dataclasses.replace(self, **changes)
