"""The arguments of the FP8 GEMM ops as typed records, matched to each op's schema by name.

`fp8fx::scaled_mm`, `fp8fx::fp8_gemm` and `fp8fx::fp8_grouped_mm` take nine to fifteen arguments,
and a node may hold some of them as keywords or leave a defaulted one out. Code reads them through
a record (`Fp8GemmArgs.of(node).block_a`, `gemm_args(node).operands`), writes a changed one back
(`args.with_operand(0, copy).write(node)`), builds calls and nodes from one (`call_args()`), and the
implementations bind their call to one (`Fp8GemmArgs.bind(args, kwargs)`), so no position is
written twice. tests/ops/test_ops.py checks the fields against the registered schemas.

On a graph the tensor fields hold the `fx.Node`s computing them.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from torch import Tensor, fx

if TYPE_CHECKING:  # (typing.Self is Python 3.11's; fp8fx supports 3.10)
    from typing import Self

Operand = Tensor | fx.Node


class _Arg(NamedTuple):
    name: str
    kwarg_only: bool
    has_default: bool
    default: Any


@functools.cache
def schema_args(name: str) -> tuple[_Arg, ...]:
    """The schema arguments of `torch.ops.fp8fx.<name>`, read once: implementations bind every call,
    and reading the schema itself took most of the time a bind took."""
    schema = getattr(torch.ops.fp8fx, name).default._schema
    return tuple(
        _Arg(a.name, a.kwarg_only, a.has_default_value(), a.default_value if a.has_default_value() else None)
        for a in schema.arguments
    )


@functools.cache
def _names(name: str) -> tuple[tuple[str, ...], frozenset[str]]:
    names = tuple(arg.name for arg in schema_args(name))
    return names, frozenset(names)


def bind(name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by the schema names of `torch.ops.fp8fx.<name>`, with the schema's
    defaults for those left out: what the call means, however it spells it."""
    names, known = _names(name)
    if len(args) > len(names):
        raise TypeError(f"fp8fx::{name}: {len(args)} positional arguments, the schema has {len(names)}")
    values = dict(zip(names, args))
    for key, value in kwargs.items():
        if key in values or key not in known:
            raise TypeError(f"fp8fx::{name}: unexpected or repeated argument {key!r}")
        values[key] = value
    if len(values) < len(names):
        for arg in schema_args(name):
            if arg.name not in values:
                if not arg.has_default:
                    raise TypeError(f"fp8fx::{name}: missing argument {arg.name!r}")
                values[arg.name] = arg.default
    return values


def _is_default(arg: _Arg, value) -> bool:
    return arg.has_default and type(value) is type(arg.default) and value == arg.default


@dataclass(frozen=True)
class OpArgs:
    """One call's arguments of the op `OP` (its name under `torch.ops.fp8fx`); the fields are the
    schema's arguments, in its order. Defaults exist for building a call; reading one fills in
    the schema's."""

    OP: ClassVar[str]

    @classmethod
    def op(cls) -> torch._ops.OpOverload:
        return getattr(torch.ops.fp8fx, cls.OP).default

    @classmethod
    def bind(cls, args: tuple, kwargs: dict | None = None) -> Self:
        record = object.__new__(cls)  # (every field bound: the checks and defaults of __init__ have nothing to do)
        record.__dict__.update(bind(cls.OP, args, kwargs or {}))
        return record

    @classmethod
    def of(cls, node: fx.Node) -> Self:
        if node.target is not cls.op():
            raise ValueError(f"fp8fx: {node.format_node()} is no call of {cls.op()}")
        return cls.bind(node.args, node.kwargs)

    def replace(self, **changes) -> Self:
        return dataclasses.replace(self, **changes)

    def call_args(self) -> tuple[tuple, dict[str, Any]]:
        """(args, kwargs) as a call or a node of the op takes them: keyword-only arguments as keywords."""
        args, kwargs = [], {}
        for arg in schema_args(self.OP):
            if arg.kwarg_only:
                kwargs[arg.name] = getattr(self, arg.name)
            else:
                args.append(getattr(self, arg.name))
        return tuple(args), kwargs

    def write(self, node: fx.Node) -> None:
        """Make `node` (a call of the op) take these arguments, spelt as it spelt them: as many
        positional ones, the rest as keywords, a default it left out still left out (so the graph's
        code, which compile caches key on, changes only where a value does)."""
        if node.target is not self.op():
            raise ValueError(f"fp8fx: {node.format_node()} is no call of {self.op()}")
        args, kwargs = [], {}
        for i, arg in enumerate(schema_args(self.OP)):
            value = getattr(self, arg.name)
            if i < len(node.args):
                args.append(value)
            elif arg.name in node.kwargs or not _is_default(arg, value):
                kwargs[arg.name] = value
        node.args, node.kwargs = tuple(args), kwargs

    def __call__(self):
        """The op called on these arguments."""
        args, kwargs = self.call_args()
        return self.op()(*args, **kwargs)


@dataclass(frozen=True)
class _GemmArgs(OpArgs):
    a: Operand
    b: Operand
    scale_inv_a: Operand
    scale_inv_b: Operand

    @property
    def operands(self) -> tuple[Operand, Operand]:
        return self.a, self.b

    def with_operand(self, side: int, value: Operand) -> Self:
        """These arguments with operand `side` (0: a, 1: b) replaced."""
        return self.replace(**{("a", "b")[side]: value})


@dataclass(frozen=True)
class ScaledMmArgs(_GemmArgs):
    """`fp8fx::scaled_mm`: `(a * scale_inv_a) @ (b * scale_inv_b) + bias`."""

    OP: ClassVar[str] = "scaled_mm"
    _: KW_ONLY
    bias: Operand | None = None
    out_dtype: torch.dtype
    block_a: list[int] = field(default_factory=list)
    block_b: list[int] = field(default_factory=list)
    fast_accum: bool = False


@dataclass(frozen=True)
class Fp8GemmArgs(_GemmArgs):
    """`fp8fx::fp8_gemm`: the GEMM with its fused epilogue (`epilogue`: an `Epilogue.spec()`), and
    which kernel runs it on a GPU."""

    OP: ClassVar[str] = "fp8_gemm"
    _: KW_ONLY
    bias: Operand | None = None
    other: Operand | None = None
    residual: Operand | None = None
    out_scale: Operand | None = None
    out_dtype: torch.dtype
    aux_dtype: torch.dtype
    block_a: list[int] = field(default_factory=list)
    block_b: list[int] = field(default_factory=list)
    epilogue: str = ""
    gpu_kernel: str
    fast_accum: bool = False


@dataclass(frozen=True)
class GroupedMmArgs(_GemmArgs):
    """`fp8fx::fp8_grouped_mm`: the grouped GEMM of groups ending at `offs`."""

    OP: ClassVar[str] = "fp8_grouped_mm"
    _: KW_ONLY
    offs: Operand
    out_dtype: torch.dtype
    block_a: list[int] = field(default_factory=list)
    block_b: list[int] = field(default_factory=list)
    fast_accum: bool = False


GEMM_ARGS = (ScaledMmArgs, Fp8GemmArgs, GroupedMmArgs)


def gemm_args(node: fx.Node) -> ScaledMmArgs | Fp8GemmArgs | GroupedMmArgs:
    """The arguments of an FP8 GEMM node, whichever of the ops it calls."""
    for record in GEMM_ARGS:
        if node.target is record.op():
            return record.of(node)
    raise ValueError(f"fp8fx: {node.format_node()} is no FP8 GEMM")
