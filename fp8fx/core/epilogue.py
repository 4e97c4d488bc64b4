"""The fused-epilogue contract between the graph passes, the reference ops and the kernels.

An `Epilogue` is the elementwise chain fused after an FP8 GEMM, in the kernels' fixed order (bias,
activation, product, residual; `aux` keeps one intermediate value, `out_amax` the result's amax).
Graphs carry it as a spec string (`bias,act=gelu,aux=pre_activation`, see `Epilogue.spec`);
`Epilogue.parse` turns it back, once per distinct string.

`ACTIVATIONS` is the one activation table: per name, the torch reference function (what the
reference ops and the torch epilogue after `torch._scaled_mm` run), the ATen graph nodes
`fuse_epilogues` recognises as that activation, and the integer code the Triton kernels switch on
(`fp8fx.codegen.triton_kernels` implements each code; a test runs every entry through the kernel
and the reference). `AUX_STAGES` and `MUL_MODES` are the other codes the kernels switch on: a
name's index is its code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

aten = torch.ops.aten


@dataclass(frozen=True)
class Activation:
    """One fusable activation."""

    name: str
    code: int  # the kernels' ACTIVATION / MUL_ACTIVATION constexpr
    reference: Callable[[Tensor], Tensor]  # on fp32, as the kernels compute it
    # ATen nodes computing it: (target, keyword arguments that must have these values; absent
    # keywords take the schema's default).
    aten: tuple[tuple[object, tuple[tuple[str, object], ...]], ...] = ()


def _identity(y: Tensor) -> Tensor:
    return y


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("none", 0, _identity),
        Activation("relu", 1, torch.relu, ((aten.relu.default, ()),)),
        Activation("gelu", 2, functools.partial(F.gelu, approximate="none"), ((aten.gelu.default, (("approximate", "none"),)),)),
        Activation(
            "gelu_tanh", 3, functools.partial(F.gelu, approximate="tanh"), ((aten.gelu.default, (("approximate", "tanh"),)),)
        ),
        Activation("silu", 4, F.silu, ((aten.silu.default, ()),)),
    )
}
# Where the epilogue's optional second output (`aux`) is taken: the value a backward op needs.
AUX_STAGES = ("none", "pre_activation", "activation", "product", "sum")
MUL_MODES = ("none", "by_other", "gated")  # y * other  |  act(other) * y

ACTIVATION_TARGETS = frozenset(target for a in ACTIVATIONS.values() for target, _ in a.aten)


def _keyword(target, kwargs: dict, name: str):
    if name in kwargs:
        return kwargs[name]
    return next(arg.default_value for arg in target._schema.arguments if arg.name == name)


def activation_of(target, kwargs: dict) -> str | None:
    """The activation an ATen node (`target` called with `kwargs`) computes, None if none of the table's."""
    if target not in ACTIVATION_TARGETS:
        return None
    for a in ACTIVATIONS.values():
        for t, required in a.aten:
            if t == target and all(_keyword(target, kwargs, k) == v for k, v in required):
                return a.name
    return None


@dataclass(frozen=True)
class Epilogue:
    """The elementwise chain fused after an FP8 GEMM, in the kernel's fixed order."""

    bias: bool = False
    activation: str = "none"
    mul: str = "none"
    mul_activation: str = "none"
    residual: bool = False
    aux: str = "none"
    out_amax: bool = False

    def __post_init__(self):
        for field, value, allowed in (
            ("activation", self.activation, tuple(ACTIVATIONS)),
            ("mul_activation", self.mul_activation, tuple(ACTIVATIONS)),
            ("mul", self.mul, MUL_MODES),
            ("aux", self.aux, AUX_STAGES),
        ):
            if value not in allowed:
                raise ValueError(f"fp8fx epilogue: {field}={value!r}; expected one of {', '.join(allowed)}")

    def spec(self) -> str:
        """Compact text form, the op argument in graphs: `bias,act=gelu,aux=pre_activation`."""
        parts = ["bias"] if self.bias else []
        if self.activation != "none":
            parts.append(f"act={self.activation}")
        if self.mul == "by_other":
            parts.append("mul")
        elif self.mul == "gated":
            parts.append(f"gate={self.mul_activation}")
        if self.residual:
            parts.append("residual")
        if self.aux != "none":
            parts.append(f"aux={self.aux}")
        if self.out_amax:
            parts.append("amax")
        return ",".join(parts)

    @classmethod
    def parse(cls, spec: str) -> Epilogue:
        """The epilogue of a `spec()` string (parsed once per distinct string: epilogues are immutable)."""
        return _parse(spec)

    def ops(self) -> int:
        """Elementwise graph ops this epilogue absorbs (each one a memory pass saved)."""
        return sum(
            (
                self.bias,
                self.activation != "none",
                self.mul != "none",
                self.mul == "gated" and self.mul_activation != "none",
                self.residual,
            )
        )

    def constexprs(self) -> dict:
        """The kernels' epilogue constexprs: flags, and the codes of the activation table, AUX_STAGES and MUL_MODES."""
        return {
            "HAS_BIAS": self.bias,
            "AUX_STAGE": AUX_STAGES.index(self.aux),
            "ACTIVATION": ACTIVATIONS[self.activation].code,
            "MUL_MODE": MUL_MODES.index(self.mul),
            "MUL_ACTIVATION": ACTIVATIONS[self.mul_activation].code,
            "HAS_RESIDUAL": self.residual,
            "OUT_AMAX": self.out_amax,
        }


PLAIN = Epilogue()  # the bare GEMM


@functools.cache
def _parse(spec: str) -> Epilogue:
    fields: dict = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        if key == "bias":
            fields["bias"] = True
        elif key == "act":
            fields["activation"] = value
        elif key == "mul":
            fields["mul"] = "by_other"
        elif key == "gate":
            fields["mul"], fields["mul_activation"] = "gated", value
        elif key == "residual":
            fields["residual"] = True
        elif key == "aux":
            fields["aux"] = value
        elif key == "amax":
            fields["out_amax"] = True
        else:
            raise ValueError(f"fp8fx epilogue spec {spec!r}: unknown part {part!r}")
    return Epilogue(**fields)
