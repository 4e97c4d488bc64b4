"""Analysis before training: load a user's model file and run the FP8 passes on it.

The model file convention (what `fp8fx analyze MODEL.py` looks for):

    def build_model() -> nn.Module          # or a module-level `model = ...`
    def example_inputs() -> tuple            # the model's positional inputs (a tensor is fine)
    def loss_fn(output) -> Tensor            # optional, for --train; default: output.float().sum()
    def calibration_data() -> Iterable       # optional, for --numerics: batches like example_inputs()

With `build_model()`, the model is built on the meta device and analysed on fake CPU tensors: no
weights are allocated and the same passes that compile the model decide every GEMM from shapes
alone. For numerics it is built with real (initialised) weights, and measured on
`calibration_data()` or, without it, on batches from `example_inputs()`.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from fp8fx.compiler.backend import backend as make_backend
from fp8fx.compiler.backend import report as report_of
from fp8fx.compiler.prepare import prepare
from fp8fx.compiler.trace import ModelFileError, compiled_once, default_loss
from fp8fx.core.patterns import BY_KIND, POLICY_KINDS
from fp8fx.core.policy import Policy, Rule
from fp8fx.reporting.op_record import has_values
from fp8fx.reporting.records import Report
from fp8fx.reporting.uncaptured import eager_experts, grouped
from fp8fx.runtime.numerics import NumericsCollector, collecting

_BUILD_HINT = (
    "add `def build_model(): return MyModel(...)` (built on the meta device: no weights) or a module-level `model = MyModel(...)`"
)
_INPUTS_HINT = "add `def example_inputs(): return (torch.randn(8, 128),)` returning the model's positional inputs"


class CoverageError(AssertionError):
    """FP8 covers less of the GEMM FLOPs than required, or GEMMs ran outside every graph."""


@dataclass
class ModelFile:
    path: Path
    model: nn.Module
    example_inputs: tuple
    loss_fn: Callable[[Any], torch.Tensor] | None
    shape_only: bool  # built on the meta device
    make_inputs: Callable[[], Any]
    calibration_data: Callable[[], Any] | None
    build: Callable[[], nn.Module] | None  # build_model(), if the file defines it
    _initial: nn.Module | None = field(default=None, init=False, repr=False)  # the module-level model as loaded

    def fresh_model(self, seed: int = 0) -> nn.Module:
        """The same model with real weights on every call: build_model() after seeding, or a copy
        of the module-level model as it was loaded."""
        if self.build is None:
            if self._initial is None:
                self._initial = copy.deepcopy(self.model)
            return copy.deepcopy(self._initial)
        torch.manual_seed(seed)
        return self.build()

    def calibration(self, batches: int) -> list[tuple]:
        """`batches` input tuples from calibration_data() (or example_inputs() called again)."""
        what = "calibration_data()" if self.calibration_data else "example_inputs()"
        found = []
        try:
            for batch in self.calibration_data() if self.calibration_data else (self.make_inputs() for _ in range(batches)):
                found.append(_as_inputs(batch, self.path, what))
                if len(found) == batches:
                    break
        except ModelFileError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ModelFileError(f"{self.path}: {what} raised {type(e).__name__}: {e}{_where(e, self.path)}") from e
        if not found:
            raise ModelFileError(f"{self.path}: {what} gave no batch")
        return found


def error_summary(e: BaseException, path: str | Path | None = None) -> str:
    """The innermost cause of an error in one line, and with `path` the last line of that file it
    passed through (wrappers such as Dynamo's name only themselves)."""
    where = _where(e, path) if path is not None else ""
    while (inner := _wrapped(e)) is not None:
        e = inner
        where = (_where(e, path) if path is not None else "") or where
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}{where}"


def _wrapped(e: BaseException) -> BaseException | None:
    """The error `e` wraps: its cause, or for Dynamo's errors (raised `from None` over another) the
    one it was raised in."""
    return getattr(e, "inner_exception", None) or e.__cause__ or (e.__context__ if isinstance(e, TorchDynamoException) else None)


def _where(exc: BaseException, path: Path) -> str:
    """` (line N)`: the innermost frame in `path` of the exception's traceback (or of the user code
    Dynamo was tracing), or nothing."""
    frames = [*traceback.extract_tb(exc.__traceback__), *(getattr(exc, "real_stack", None) or ())]
    lines = [f.lineno for f in frames if Path(f.filename).resolve() == Path(path).resolve()]
    return f" (line {lines[-1]})" if lines else ""


def _as_inputs(value: Any, path: Path, what: str) -> tuple:
    inputs = (value,) if isinstance(value, torch.Tensor) else value
    if not isinstance(inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise ModelFileError(f"{path}: {what} must give a tensor or a tuple of tensors, got {type(value).__name__}")
    return tuple(inputs)


def load_model_file(path: str | Path, real_weights: bool = False) -> ModelFile:
    """Import `path` and build its model and inputs by the convention above (`real_weights`:
    build_model() allocates and initialises weights, for numerics)."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(f"fp8fx_user_model_{abs(hash(path.resolve()))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any error in the user's file becomes one clear line
        raise ModelFileError(f"{path}: importing it raised {type(e).__name__}: {e}{_where(e, path)}") from e
    build = getattr(module, "build_model", None)
    shape_only = callable(build) and not real_weights
    try:
        if callable(build):
            with torch.device("meta") if shape_only else contextlib.nullcontext():
                model = build()
        else:
            model = getattr(module, "model", None)
            if model is None:
                raise ModelFileError(f"{path}: defines neither build_model() nor model; {_BUILD_HINT}")
    except ModelFileError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ModelFileError(f"{path}: build_model() raised {type(e).__name__}: {e}{_where(e, path)}") from e
    if not isinstance(model, nn.Module):
        raise ModelFileError(f"{path}: the model is a {type(model).__name__}, not a torch.nn.Module")
    make_inputs = getattr(module, "example_inputs", None)
    if not callable(make_inputs):
        raise ModelFileError(f"{path}: does not define example_inputs(); {_INPUTS_HINT}")
    try:
        inputs = make_inputs()
    except Exception as e:  # noqa: BLE001
        raise ModelFileError(f"{path}: example_inputs() raised {type(e).__name__}: {e}{_where(e, path)}") from e
    inputs = _as_inputs(inputs, path, "example_inputs()")
    if shape_only:
        inputs = tuple(t.to("meta") for t in inputs)
    loss_fn = getattr(module, "loss_fn", None)
    calibration = getattr(module, "calibration_data", None)
    return ModelFile(
        path,
        model,
        inputs,
        loss_fn if callable(loss_fn) else None,
        shape_only,
        make_inputs,
        calibration if callable(calibration) else None,
        build if callable(build) else None,
    )


OP_KINDS = (*POLICY_KINDS, "sdpa")  # every op kind a policy rule can name, and attention


def _structure(module: nn.Module) -> tuple:
    return (
        tuple((name, type(m).__name__) for name, m in module.named_modules()),
        tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters()),
    )


def _foldable_blocks(model: nn.Module, policy: Policy) -> list[tuple[str, nn.Module, str, nn.ModuleList]]:
    """ModuleLists of identical blocks whose every module the policy treats alike: tracing the
    first block decides them all. Returns (list FQN, parent module, attribute name, list)."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2 or not name:
            continue
        first = _structure(module[0])
        if any(_structure(block) != first for block in module):
            continue
        subs = [sub for sub, _ in module[0].named_modules()]

        def decisions(i: int) -> list:
            fqns = [f"{name}.{i}" + (f".{sub}" if sub else "") for sub in subs]
            return [(r.rule_index, r.settings) for fqn in fqns for op in OP_KINDS for r in [policy.resolve((fqn, fqn), op)]]

        reference = decisions(0)
        if all(decisions(i) == reference for i in range(1, len(module))):
            parent_name, _, attr = name.rpartition(".")
            found.append((name, model.get_submodule(parent_name), attr, module))
    return found


def _same_rule(policy: Policy, op, copy) -> bool:
    """Whether the policy settles the copied record's GEMM by the same rule as the traced one's.
    Rules see a site by its name and its module path (see `MatmulSite.names`)."""
    kind = BY_KIND[op.op].policy_kind if op.op in BY_KIND else None
    if kind is None:
        return True  # attention, convolutions, opaque ops: no rule decides them

    def settled(record) -> tuple:
        res = policy.resolve(tuple(dict.fromkeys((record.site, record.fqn))), kind)
        return res.rule_index, res.settings, res.forced_fp8

    return settled(op) == settled(copy)


def _renamed(op, prefix: str, new_prefix: str):
    def swap(text: str) -> str:
        return (
            new_prefix + text[len(prefix) :]
            if text == prefix or text.startswith(prefix + ".") or text.startswith(prefix + ":")
            else text
        )

    return replace(op, site=swap(op.site), fqn=swap(op.fqn))


Progress = Callable[[str, int, int], None]  # (stage, done, total)


_aten = torch.ops.aten
_GEMMS = (
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten.addbmm.default,
    _aten.mv.default,
    _aten.addmv.default,
    _aten.dot.default,
)


class _EagerDtypeChecks(FakeTensorMode):
    """Fake tensors whose GEMMs reject mixed operand dtypes as eager PyTorch does, with its message
    ("mat1 and mat2 must have the same dtype"): the meta kernels behind fake tensors check shapes
    only, so an fp64 input to an fp32 model would trace as if it ran. The eager kernel itself is
    asked, on empty tensors of the operands' dtypes."""

    def dispatch(self, func, types, args=(), kwargs=None):
        if func in _GEMMS and len({a.dtype for a in args if isinstance(a, torch.Tensor)}) > 1:
            with unset_fake_temporarily():
                func(
                    *(torch.empty((0,) * a.dim(), dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args),
                    **(kwargs or {}),
                )
        return super().dispatch(func, types, args, kwargs)


def _fake_cpu_if_meta(model: nn.Module, inputs: tuple) -> tuple:
    """A model on the meta device gets fake CPU tensors instead (still no memory), and so do its
    inputs: PyTorch picks attention kernels by device, and on meta it would trace attention as
    unfused matmuls and a softmax over the full score matrix, unlike any real device. A model
    made fake before keeps its fake mode."""
    state = (*model.parameters(), *model.buffers())
    if not any(t.is_meta for t in (*state, *inputs)):
        return inputs
    mode = next((t.fake_mode for t in state if isinstance(t, FakeTensor)), None) or _EagerDtypeChecks(allow_non_fake_inputs=True)
    with mode:
        if any(t.is_meta for t in state):
            model.to_empty(device="cpu")
        return tuple(torch.empty_like(t, device="cpu") if t.is_meta else t for t in inputs)


def failing_module(model: nn.Module, inputs: tuple) -> str | None:
    """The innermost submodule (`'layers.1.mlp' (MLP)`) whose forward raises when `model` runs
    eagerly on `inputs`; None if it runs, or if the error is outside every submodule's forward."""
    names = {id(m): f"{name!r} ({type(m).__name__})" for name, m in reversed(list(model.named_modules())) if name}
    entered: list[str | None] = []  # the modules whose forward is running, outermost first

    def enter(module, args) -> None:
        entered.append(names.get(id(module)))

    def leave(module, args, output) -> None:
        entered.pop()

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.no_grad():
            model(*_fake_cpu_if_meta(model, inputs))
    except Exception:  # noqa: BLE001 - the error itself is the caller's; this only says where
        return next((name for name in reversed(entered) if name), None)
    finally:
        for h in handles:
            h.remove()
    return None


def _compile_and_run(model, batches, policy, train, loss_fn, collector, progress, stage) -> Report:
    # Compiled eagerly, planned as the default (Inductor) compile plans, so the report says what it runs.
    backend = make_backend(policy=policy, inner="eager", epilogues_to_inductor=True)
    backend.numerics = collector
    with compiled_once(model, backend) as compiled, collecting(collector) if collector else contextlib.nullcontext():
        for i, batch in enumerate(batches):
            if progress:
                progress(stage, i, len(batches))
            if train:
                (loss_fn or default_loss)(compiled(*batch)).backward()  # inputs as given: data needs no grad
            else:
                with torch.no_grad():
                    compiled(*batch)
    if progress:
        progress(stage, len(batches), len(batches))
    return report_of(compiled)


def analyze(
    model: nn.Module,
    example_inputs: tuple,
    policy: Policy | None = None,
    train: bool = False,
    loss_fn=None,
    fold_repeated: bool = True,
    calibration: list[tuple] | None = None,
    progress: Progress | None = None,
) -> Report:
    """Compile `model` with fp8fx (eager inner compiler), run the inputs once (and backward with
    `train`), and return the report: every GEMM with its decision and reason.

    `fold_repeated`: a stack of identical blocks (a transformer's layers) that the policy treats
    alike is traced through its first block only; the other blocks' records are copies of it
    under their own names. A stack the policy tells apart (a rule for `layers.0`, say) is traced whole.

    `calibration`: batches (tuples of real inputs) to measure numerics on (`fp8fx.runtime.numerics`); the
    model must hold real weights. A second, probed run measures them (so the report itself comes
    from the same passes as a compile); each record's `numerics` then holds its operands' amax,
    scale, underflow and saturation and its SQNR, for the policy's decision and every named recipe.

    With `train`, a second run with every GEMM high measures what FP8 saves in the activations
    kept for backward. `progress(stage, done, total)` is called as batches run. A policy with delayed scaling calls
    `fp8fx.prepare(model)`: the model gets its scaling state."""
    policy = policy or Policy()
    if calibration is not None:
        if not calibration:
            raise ValueError("fp8fx.analyze: calibration holds no batch")
        if any(not has_values(p) for p in model.parameters()):
            raise ValueError("fp8fx.analyze: numerics need real weights, but the model is on the meta device")
        fold_repeated = False  # the blocks' values differ
    # What a training step's optimizer updates, counted before a meta model becomes fake tensors
    # (which unties shared weights); parameters() counts a shared one once.
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) if train else None
    example_inputs = _fake_cpu_if_meta(model, example_inputs)
    if policy.uses_delayed_scaling:
        prepare(model)  # delayed scaling keeps its state in the model
    shape_only = not all(has_values(t) for t in (*model.parameters(), *model.buffers(), *example_inputs))
    experts = next((f"{name!r} ({type(m).__name__})" for name, m in model.named_modules() if eager_experts(m)), None)
    why = f"transformers' eager experts in module {experts} loop over data-dependent indices" if shape_only and experts else None
    if why:  # known to stop a shape-only trace: not worth tracing up to it first
        example_inputs = _real_tensors(model, example_inputs, why)
    try:
        report = _traced(model, example_inputs, policy, train, loss_fn, fold_repeated, progress, "analysis")
    except Exception as e:  # noqa: BLE001 - only a data-dependent op of a shape-only trace is handled
        why = _data_dependent(model, example_inputs, e)
        if why is None:
            raise
        example_inputs = _real_tensors(model, example_inputs, why)
        report = _traced(model, example_inputs, policy, train, loss_fn, fold_repeated, progress, "analysis")
    report.traced_on_real_tensors, report.param_bytes = why, param_bytes
    if train:  # what the same step saves for backward with every GEMM in high precision
        high = Policy(policy.defaults, (Rule(match="*", precision="high"),))
        baseline = _traced(model, example_inputs, high, train, loss_fn, fold_repeated, progress, "baseline").saved_bytes
        report.saved_bytes_high_precision = sum(baseline.values()) if baseline is not None else None  # None: no training graph
    if calibration is not None:
        collector = NumericsCollector()
        _compile_and_run(model, calibration, policy, train, loss_fn, collector, progress, "numerics")
        measured = collector.results()
        report.ops = [replace(op, numerics=measured.get((op.graph, op.site, op.role))) for op in report.ops]
    return report


def _data_dependent(model: nn.Module, inputs: tuple, e: BaseException) -> str | None:
    """Why a shape-only trace stopped, when it stopped at an op whose output shape or value
    depends on the data (`nonzero`, `.item()`, a loop over them): fake tensors hold no values."""
    if all(has_values(t) for t in (*model.parameters(), *model.buffers(), *inputs)):
        return None
    found = e
    while found is not None and not isinstance(
        found, (DynamicOutputShapeException, DataDependentOutputException, GuardOnDataDependentSymNode)
    ):
        found = _wrapped(found)
    if found is None:
        return None
    module = failing_module(model, inputs)
    return f"the shape-only trace stopped at {error_summary(found)}" + (f" in module {module}" if module else "")


def _real_tensors(model: nn.Module, inputs: tuple, why: str) -> tuple:
    """Give a shape-only model real CPU tensors in place (random weights, ties kept; buffers of ones,
    integer ones of zeros) and return real inputs (random floats; integers and booleans all 1,
    a valid index and an unmasked position), so the model runs as a compile would see it."""
    state = {id(t): t for t in (*model.parameters(), *model.buffers())}
    size = sum(t.numel() * t.element_size() for t in state.values())
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if 2 * size > free:
        raise ModelFileError(
            f"fp8fx.analyze: {why}, and running it on real tensors needs {size / 2**30:.1f} GiB, over half the free memory; "
            "analyse a smaller configuration of the model, or replace the data-dependent code (for transformers' "
            'experts: experts_implementation="grouped_mm")'
        )
    generator = torch.Generator().manual_seed(0)
    made: dict[int, torch.Tensor] = {}

    def real(t: torch.Tensor, param: bool) -> torch.Tensor:
        if has_values(t):
            return t
        if id(t) not in made:
            with unset_fake_temporarily():
                if t.is_floating_point():
                    values = torch.randn(t.shape, generator=generator).mul_(0.02) if param else torch.ones(t.shape)
                else:
                    values = torch.ones(t.shape) if param else torch.zeros(t.shape)
                values = values.to(t.dtype)
            made[id(t)] = nn.Parameter(values, t.requires_grad) if param else values
        return made[id(t)]

    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None:
                module._parameters[key] = real(p, True)
        for key, b in module._buffers.items():
            if b is not None:
                module._buffers[key] = real(b, False)
    with unset_fake_temporarily():
        return tuple(
            t
            if has_values(t)
            else (torch.randn(t.shape, generator=generator) if t.is_floating_point() else torch.ones(t.shape))
            .to(t.dtype)
            .requires_grad_(t.requires_grad)
            for t in inputs
        )


def _traced(model, example_inputs, policy, train, loss_fn, fold_repeated, progress, stage) -> Report:
    """One analysis run; with `fold_repeated`, through one block of each foldable stack."""
    folded = _foldable_blocks(model, policy) if fold_repeated else []
    for _, parent, attr, blocks in folded:
        setattr(parent, attr, nn.ModuleList(blocks[:1]))
    try:
        report = _compile_and_run(model, [example_inputs], policy, train, loss_fn, None, progress, stage)
    finally:
        for _, parent, attr, blocks in folded:
            setattr(parent, attr, blocks)

    def copies(name: str, blocks: nn.ModuleList, fqn: str) -> list[str]:
        """FQNs in the untraced blocks that `fqn` (in block 0) stands for."""
        first = f"{name}.0"
        if fqn != first and not fqn.startswith((first + ".", first + ":")):
            return []
        return [f"{name}.{i}" + fqn[len(first) :] for i in range(1, len(blocks))]

    ops, pairs = [], []
    for op in report.ops:
        ops.append(op)
        for name, _, _, blocks in folded:
            if copies(name, blocks, op.fqn):
                copied = [_renamed(op, f"{name}.0", f"{name}.{i}") for i in range(1, len(blocks))]
                ops += copied
                pairs += [(op, c) for c in copied]
    if any(not _same_rule(policy, op, copy) for op, copy in pairs):
        # A rule names a site in a later block (`layers.1:mm#1`): its GEMMs differ from block 0's.
        return _traced(model, example_inputs, policy, train, loss_fn, False, progress, stage)

    def unfolded(per_fqn: dict[str, int]) -> dict[str, int]:
        out = dict(per_fqn)
        for name, _, _, blocks in folded:
            for fqn, n in per_fqn.items():
                out.update(dict.fromkeys(copies(name, blocks, fqn), n))
        return out

    out = Report(
        ops,
        folded={name: len(blocks) for name, _, _, blocks in folded},
        non_gemm_bytes=unfolded(report.non_gemm_bytes),
        saved_bytes=unfolded(report.saved_bytes) if report.saved_bytes is not None else None,
        saved_tensors=report.saved_tensors,  # (of the blocks traced)
    )
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    found = [*report.uncaptured]
    for u in report.uncaptured:
        for name, _, _, blocks in folded:
            if copies(name, blocks, u.module):
                found += [u.renamed(f"{name}.0", f"{name}.{i}") for i in range(1, len(blocks))]
    out.uncaptured = sorted(found, key=lambda u: order.get(u.module, -1))
    return out


def assert_coverage(report: Report, min_fp8_flop_share: float) -> None:
    """Raise CoverageError if FP8 runs less than `min_fp8_flop_share` of all GEMM FLOPs, or (for
    any share above 0) if GEMMs ran outside every compiled graph, which no share counts."""
    total = sum(op.flops for op in report.ops)
    share = sum(op.flops for op in report.fp8_ops) / total if total else 0.0
    if report.uncaptured and min_fp8_flop_share > 0:
        modules = [u.module for u in report.uncaptured]
        named = ", ".join(modules[:5]) + (f" and {len(modules) - 5} more" if len(modules) > 5 else "")
        raise CoverageError(
            f"the GEMMs of {named} ran outside every compiled graph, in high precision, and no FP8 share counts them "
            f"(FP8 covers {100 * share:.1f}% of the GEMM FLOPs captured): "
            + "; ".join(u.text(n) for u, n in grouped(report.uncaptured))
        )
    if share < min_fp8_flop_share:
        high = sorted(report.high_ops, key=lambda op: -op.flops)[:5]
        biggest = ", ".join(f"{op.site}.{op.role} ({op.reason_kind}: {op.reason})" for op in high)
        raise CoverageError(
            f"FP8 covers {100 * share:.1f}% of GEMM FLOPs, below the required {100 * min_fp8_flop_share:.1f}%; "
            f"largest high-precision GEMMs: {biggest}"
        )

