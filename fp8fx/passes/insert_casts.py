"""insert_casts: make every FP8 decision explicit in the graph.

For each FP8 GEMM, each operand gets `fp8fx::amax -> fp8fx::amax_to_scale -> fp8fx::cast` (and
`fp8fx::scale_inverse`), and the GEMM becomes `fp8fx::scaled_mm`. With delayed scaling the cast
takes the state's scale (and its inverse) from `fp8fx::delayed_scales` at the graph's start, and
`fp8fx::delayed_scale_steps`, at its end, records the amaxes and updates the states in place: each
op once for forward's casts and once for backward's (both find the states through the graph's
handle input, `fp8fx.ops.delayed`). Casts are made on the operand's
root tensor (before transposes, views and dtype casts) and cached per (root, format), so the
weight's E4M3 copy serves both output and grad_input, and the input's E4M3 copy serves output and
grad_weight: after partitioning, backward consumes the FP8 tensors forward made.

A grouped GEMM (op kind grouped_mm) becomes `fp8fx::fp8_grouped_mm`, its operands scaled within
each group (`fp8fx.core.grouped`): one scale per group, or per row / column within each group,
through `fp8fx::grouped_amax -> amax_to_scale -> grouped_cast`; plain blocks through the chain
above; blocks along a grouped K after `fp8fx::pad_groups` has padded every group to a multiple of
the block. transformers' fused backward becomes one FP8 grouped GEMM per FP8 gradient.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from fp8fx.codegen.versions import triton_available
from fp8fx.core import grouped
from fp8fx.core.formats import Fp8Format
from fp8fx.core.grouped import OperandScales
from fp8fx.core.recipes import AmaxComputeAlgo, Precision, ScaleRounding
from fp8fx.ops.args import GroupedMmArgs, ScaledMmArgs
from fp8fx.passes.annotation import META_KEY, DelayedSpec, Fusion, ReasonKind, annotate, annotation, node_annotations, state_key
from fp8fx.passes.find_matmuls import fused_backward, group_offsets, matmul_operands, parameter_derived
from fp8fx.passes.graph_utils import (
    PassContext,
    PassResult,
    add_node,
    copy_meta,
    fake_mode_of,
    is_backward,
    node_values,
    op_args,
    reads_state,
    strip_layout,
    views_key,
)
from fp8fx.runtime.monitor import Monitor
from fp8fx.runtime.shadow import ShadowChecks

fp8fx_ops = torch.ops.fp8fx
aten = torch.ops.aten

# Transposes of a 2-D tensor (a grouped GEMM's operand is cast on its root through them).
_TRANSPOSES_2D = {aten.t.default, aten.transpose.int, aten.permute.default}


def _swaps(view: fx.Node) -> int:
    """1 when a view in `_TRANSPOSES_2D` of a 2-D tensor swaps its dimensions, else 0."""
    if view.target is aten.permute.default:
        return int([d % 2 for d in view.args[1]] == [1, 0])
    if view.target is aten.transpose.int:
        return int(view.args[1] % 2 != view.args[2] % 2)
    return 1


@dataclass
class Quantized:
    fp8: fx.Node
    scale_inv: fx.Node
    state_key: str | None = None  # delayed scaling: whose state the scale comes from


@dataclass(frozen=True)
class CastSpec:
    """How one operand is cast: the decision's settings for that side."""

    fmt: Fp8Format
    block: tuple
    power_of_two: bool
    margin: int
    delayed: DelayedSpec | None
    stochastic: bool = False  # NVFP4: round to E2M1 stochastically
    hadamard_dim: int | None = None  # NVFP4: the contraction dim the random Hadamard transform runs along
    rounding: str | None = None  # mx's floor rounding; rceil is amax_to_scale's power of two with margin 0


def _rounding(d) -> str | None:
    """The rounding a cast's amax_to_scale takes: MX's floor; None otherwise (rceil is its power of
    two with margin 0, which keeps a zero block's scale at 1)."""
    return ScaleRounding.FLOOR.value if d.scale_rounding is ScaleRounding.FLOOR else None


class _Inserter:
    def __init__(self, graph: fx.Graph, ctx: PassContext):
        self.graph = graph
        self.ctx = ctx
        self.fake_mode = fake_mode_of(graph)
        self.output = next(n for n in reversed(graph.nodes) if n.op == "output")
        self.cache: dict[tuple, Quantized] = {}
        self.views: dict[tuple, fx.Node] = {}  # high-precision operand views rebuilt from their root
        # Delayed scaling: the state updates forward's casts (False) and backward's (True) make, and
        # the reads per (side, device): the read and the keys it reads.
        self.updates: dict[bool, list[tuple[tuple, fx.Node]]] = {}
        self.reads: dict[tuple[bool, torch.device], tuple[fx.Node, list[str]]] = {}
        # weight_fp8="recompute": the weights (parameter inputs), whose casts backward makes again.
        self.weights: set[fx.Node] = set()
        if ctx.options.weight_fp8 == "recompute":
            self.weights = {n for n in graph.nodes if n.op == "placeholder"} & parameter_derived(graph, ctx.param_inputs)

    def add(self, target, args, kwargs=None, *, tag_from: fx.Node) -> fx.Node:
        return add_node(self.graph, self.fake_mode, target, args, kwargs, tag_from=tag_from)

    def quantize(self, x: fx.Node, spec: CastSpec, gemm: fx.Node, state_key: str) -> Quantized:
        if (x, spec) in self.cache:
            return self.cache[(x, spec)]
        # Right after the producer, so every GEMM that needs it is dominated; placeholders (and the
        # state reads after them) stay first.
        at = self.start() if x.op == "placeholder" else x.next
        tag_from = gemm if x.op == "placeholder" else x
        fmt, block = spec.fmt, list(spec.block)
        if fmt is Fp8Format.NVFP4:
            return self.quantize_nvfp4(x, spec, at, tag_from, state_key)
        delayed = self.ctx.delayed if spec.delayed is not None else None
        # A graph compiled without autograd (evaluation) casts with the delayed state's scale and
        # leaves the state alone, unless the policy calibrates (TransformerEngine updates only with
        # grad enabled): how often a run evaluates must not change how it trains.
        update = delayed is not None and (not self.ctx.inference or self.ctx.options.policy.calibrate)
        with self.graph.inserting_before(at):
            amax = self.add(fp8fx_ops.amax.default, (x, block), tag_from=tag_from) if delayed is None or update else None
            if spec.delayed is not None:
                self.ctx.delayed_states[state_key] = spec.delayed.history_len
            scale_inv = None  # the scale's inverse, where it comes with the scale
            if delayed is None:  # dynamic scaling (or an export, which casts with dynamic scales)
                args = (amax, fmt.max, spec.margin, spec.power_of_two, spec.rounding)
                scale = self.add(fp8fx_ops.amax_to_scale.default, args, tag_from=tag_from)
            else:  # delayed: cast with the scale in use, then record this amax and update the state
                scale, scale_inv = self.read_scale(state_key, x.meta["val"].device, tag_from)
                d = spec.delayed
                if update and delayed.amax_group is not None:  # every rank updates from the same amax
                    reduce = (amax, "max", delayed.amax_group)
                    amax = self.add(torch.ops._c10d_functional.all_reduce.default, reduce, tag_from=tag_from)
                    amax = self.add(torch.ops._c10d_functional.wait_tensor.default, (amax,), tag_from=tag_from)
                most_recent = d.algo is AmaxComputeAlgo.MOST_RECENT
                update_args = (state_key, amax, fmt.max, spec.margin, spec.power_of_two, most_recent, d.interval)
            if self.ctx.taps.monitor is not None:  # the runtime monitor samples what this cast receives
                tap_args = (scale, [x], self.ctx.taps.monitor, Monitor.tap_key(state_key, fmt, block))
                scale = self.add(fp8fx_ops.tap.default, tap_args, tag_from=tag_from)
                scale_inv = None  # (the inverse of the scale the tap hands on)
            fp8 = self.add(fp8fx_ops.cast.default, (x, scale, fmt.dtype, block), tag_from=tag_from)
            if scale_inv is None:
                scale_inv = self.add(fp8fx_ops.scale_inverse.default, (scale,), tag_from=tag_from)
        if update:
            self.updates.setdefault(is_backward(tag_from), []).append((update_args, tag_from))
        if x in self.weights:  # backward casts the weight again, with the scale forward saved (a
            # scalar or a few, where an amax again reads the weight), and the scale's inverse forward
            # saved: computed again in backward it was a kernel of its own there (a GPU launch).
            fp8.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        q = Quantized(fp8, scale_inv, state_key if spec.delayed is not None else None)
        self.cache[(x, spec)] = q
        return q

    def step_states(self) -> None:
        """One `fp8fx::delayed_scale_steps` per side (forward, backward) for the updates its casts
        made, at the graph's end: after every read of the states' old values."""
        for updates in self.updates.values():
            keys, *columns = zip(*(args for args, _ in updates))  # keys, amaxes, fp8_max, margin, ...
            args = (self.ctx.delayed.handle, "\n".join(keys), *map(list, columns))
            with self.graph.inserting_before(self.output):
                self.add(fp8fx_ops.delayed_scale_steps.default, args, tag_from=updates[0][1])

    def start(self) -> fx.Node:
        """The graph's first node that is neither an input nor a delayed-scaling read."""
        reads = {read for read, _ in self.reads.values()}
        return next(n for n in self.graph.nodes if n.op != "placeholder" and n not in reads and not reads_state(n))

    def read_scale(self, key: str, device: torch.device, tag_from: fx.Node) -> tuple[fx.Node, fx.Node]:
        """The scale state `key` holds and its inverse, read at the graph's start (before any GEMM
        whose fused epilogue writes FP8 with it): two values of one `fp8fx::delayed_scales` per side
        (forward's casts, backward's: the partitioner puts backward's into backward, which gets the
        handle) and device, whose keys grow with each state read."""
        side = (is_backward(tag_from), device)
        handle = self.ctx.delayed.handle
        if side not in self.reads:
            with self.graph.inserting_before(self.start()):
                self.reads[side] = (self.add(fp8fx_ops.delayed_scales.default, (handle, key, device), tag_from=tag_from), [key])
        else:
            read, keys = self.reads[side]
            keys.append(key)
            read.args = (handle, "\n".join(keys), device)
            with self.fake_mode:
                read.meta["val"] = read.target(*node_values(read.args))
        read, keys = self.reads[side]
        with self.graph.inserting_after(read):
            return tuple(self.add(operator.getitem, (read, 2 * (len(keys) - 1) + i), tag_from=tag_from) for i in range(2))

    def quantize_nvfp4(self, x: fx.Node, spec: CastSpec, at: fx.Node, tag_from: fx.Node, key: str) -> Quantized:
        """NVFP4: block amaxes -> the two-level scales (and their inverses) -> the E2M1 cast."""
        block = list(spec.block)
        with self.graph.inserting_before(at):
            amax = self.add(fp8fx_ops.amax.default, (x, block), tag_from=tag_from)
            scales = self.add(fp8fx_ops.nvfp4_scale.default, (amax,), tag_from=tag_from)
            scale, scale_inv = (self.add(operator.getitem, (scales, i), tag_from=tag_from) for i in range(2))
            if self.ctx.taps.monitor is not None:
                tap_args = (scale, [x], self.ctx.taps.monitor, Monitor.tap_key(key, spec.fmt, block))
                scale = self.add(fp8fx_ops.tap.default, tap_args, tag_from=tag_from)
            fp4 = self.add(fp8fx_ops.cast_nvfp4.default, (x, scale, block, spec.stochastic), tag_from=tag_from)
        q = Quantized(fp4, scale_inv)
        self.cache[(x, spec)] = q
        return q

    def replay(self, x: fx.Node, chain: list[fx.Node], gemm: fx.Node) -> fx.Node:
        with self.graph.inserting_before(gemm):
            for view in chain:
                args = (x, *view.args[1:])
                if not _applies(view.target, args, view.kwargs, self.fake_mode):
                    # The skipped dtype cast made the copy the view relied on (a broadcast root
                    # has stride 0, which no view can flatten): make that copy here.
                    x = self.add(aten.clone.default, (x,), {"memory_format": torch.contiguous_format}, tag_from=gemm)
                    args = (x, *view.args[1:])
                x = self.add(view.target, args, dict(view.kwargs), tag_from=gemm)
        return x

    def operand(self, x: fx.Node, spec: CastSpec, gemm: fx.Node, state_key: str) -> tuple[fx.Node, Quantized]:
        root, chain = strip_layout(x)
        if root.op != "placeholder":
            # A dtype cast is skipped only to a graph input (a master weight, read once). A value
            # the graph computes is cast as the model rounded it: reading its fp32 source (e.g. a
            # BF16 model's gradient before rounding) makes Inductor keep that in fp32, twice the bytes.
            root, chain = strip_layout(x, dtype_casts=False)
        if not spec.block:  # tensorwise: cast the root once, replay the views on FP8
            q = self.quantize(root, spec, gemm, state_key)
            return self.replay(q.fp8, chain, gemm), q
        # Per-row / per-block scales follow the GEMM's layout: cast the operand as the GEMM sees
        # it, rebuilt from the root (so a weight's dtype cast, autocast's bf16 copy, is skipped).
        key = views_key(root, chain)
        if key not in self.views:  # e.g. q, k and v projections share one cast of their input
            self.views[key] = self.replay(root, chain, gemm)
        if spec.hadamard_dim is not None and (key, spec.hadamard_dim) not in self.views:  # NVFP4's transform, along K
            with self.graph.inserting_before(gemm):
                args = (self.views[key], spec.hadamard_dim)
                self.views[(key, spec.hadamard_dim)] = self.add(fp8fx_ops.hadamard.default, args, tag_from=gemm)
        q = self.quantize(self.views[key if spec.hadamard_dim is None else (key, spec.hadamard_dim)], spec, gemm, state_key)
        return q.fp8, q

    def grouped_operand(
        self, x: fx.Node, scales: OperandScales, spec: CastSpec, offs: fx.Node, gemm: fx.Node
    ) -> tuple[fx.Node, Quantized]:
        """One operand of a grouped GEMM scaled per group. A 2-D operand reached through transposes is
        cast on its root with the grouped dimension moved along, so dgrad and wgrad share one copy."""
        root, chain = strip_layout(x)
        dim = scales.group_dim
        if all(v.target in _TRANSPOSES_2D for v in chain) and root.meta["val"].dim() == 2:
            dim = (dim + sum(_swaps(v) for v in chain)) % 2
        else:
            root, chain = self.replay(root, chain, gemm), []
        key = ("grouped", root, dim, scales.lines, spec, offs)
        if key not in self.cache:
            with self.graph.inserting_before(gemm):  # after the offsets, which a router computes late
                amax = self.add(fp8fx_ops.grouped_amax.default, (root, offs, dim, scales.lines), tag_from=gemm)
                scale = self.add(
                    fp8fx_ops.amax_to_scale.default, (amax, spec.fmt.max, spec.margin, spec.power_of_two), tag_from=gemm
                )
                fp8 = self.add(fp8fx_ops.grouped_cast.default, (root, scale, offs, dim, spec.fmt.dtype), tag_from=gemm)
                self.cache[key] = Quantized(fp8, self.add(fp8fx_ops.scale_inverse.default, (scale,), tag_from=gemm))
        q = self.cache[key]
        return self.replay(q.fp8, chain, gemm), q

    def grouped_gemm(self, gemm: fx.Node, ann, left: fx.Node, right: fx.Node, offs: fx.Node, out_dtype: torch.dtype) -> fx.Node:
        """The `fp8fx::fp8_grouped_mm` node of one FP8 grouped GEMM, with its operands' casts."""
        d = ann.decision
        form = grouped.form_of(left.meta["val"].dim(), right.meta["val"].dim())
        scales = [grouped.operand_scales(form, side, block) for side, block in enumerate(d.blocks)]
        align = max(s.align for s in scales)
        if align > 1:  # blocks along a grouped K: pad every group to a multiple of the block
            with self.graph.inserting_before(gemm):
                left, right = (
                    self.add(fp8fx_ops.pad_groups.default, (x, offs, s.group_dim, align), tag_from=gemm)
                    for x, s in zip((left, right), scales)
                )
                offs = self.add(fp8fx_ops.pad_offsets.default, (offs, align), tag_from=gemm)
        quantized = []
        for side, x in enumerate((left, right)):
            spec = CastSpec(d.formats[side], scales[side].block or (), d.power_of_two, d.margin, None, rounding=_rounding(d))
            if scales[side].per_group:
                quantized.append(self.grouped_operand(x, scales[side], spec, offs, gemm))
            else:
                quantized.append(self.operand(x, spec, gemm, state_key(ann.site, ann.role, d.operand_roles[side])))
        (a, qa), (b, qb) = quantized
        args, kwargs = GroupedMmArgs(
            a,
            b,
            qa.scale_inv,
            qb.scale_inv,
            offs=offs,
            out_dtype=out_dtype,
            block_a=list(d.blocks[0]),
            block_b=list(d.blocks[1]),
            fast_accum=d.fast_accum,
        ).call_args()
        with self.graph.inserting_before(gemm):
            new = self.add(GroupedMmArgs.op(), args, kwargs, tag_from=gemm)
        copy_meta(gemm, new)  # the FP8 GEMM takes the replaced one's place
        kernel, why = grouped.gpu_kernel(tuple(f.value for f in d.formats), tuple(scales), triton_available())
        annotate(
            new,
            replace(
                ann, state_keys=(None, None), fusion=Fusion(kernel=kernel, kernel_reason=why, stop="grouped GEMMs are not fused")
            ),
        )
        return new

    def rewrite_grouped(self, gemm: fx.Node) -> None:
        """A grouped GEMM, or transformers' fused backward (one FP8 grouped GEMM per FP8 gradient)."""
        offs = group_offsets(gemm)
        if not fused_backward(gemm):
            left, right, _ = matmul_operands(gemm)
            new = self.grouped_gemm(gemm, annotation(gemm), left, right, offs, gemm.meta["val"].dtype)
            gemm.replace_all_uses_with(new)
            self.graph.erase_node(gemm)
            return
        args = op_args(gemm)  # (input, weight, offs, grad_output) -> (grad_input, grad_weight)
        with self.graph.inserting_before(gemm):  # permute: what Inductor lowers (t and transpose are decomposed before)
            weight_t = self.add(aten.permute.default, (args["weight"], [0, 2, 1]), tag_from=gemm)
            input_t = self.add(aten.permute.default, (args["input"], [1, 0]), tag_from=gemm)
        products = {"grad_input": (0, args["grad_output"], weight_t), "grad_weight": (1, input_t, args["grad_output"])}
        outputs = {user.args[1]: user for user in gemm.users if user.target is operator.getitem}
        kept, unread = [], []
        for ann in node_annotations(gemm):
            index, left, right = products[ann.role]
            if ann.fp8 and index in outputs:
                new = self.grouped_gemm(gemm, ann, left, right, offs, outputs[index].meta["val"].dtype)
                outputs[index].replace_all_uses_with(new)
                self.graph.erase_node(outputs[index])
            else:
                (unread if ann.fp8 else kept).append(ann)
        if not gemm.users:  # nothing left to compute: a gradient nobody reads has no GEMM (nor row)
            self.graph.erase_node(gemm)
            for site in self.ctx.sites:
                for ann in unread:
                    if site.name == ann.site and ann.role in site.gemms:
                        del site.gemms[ann.role]
            return
        why = (
            "nothing reads this gradient: transformers' fused backward computes it beside the one it keeps, in the "
            "model's precision"
        )
        unread = [
            replace(
                a,
                decision=replace(
                    a.decision,
                    precision=Precision.HIGH,
                    reason_kind=ReasonKind.PATTERN,
                    reason=why,
                    formats=None,
                    scaling=None,
                    granularity=None,
                ),
            )
            for a in unread
        ]
        gemm.meta[META_KEY] = (*kept, *unread)  # a gradient kept high is still this node's (it computes both)

    def rewrite(self, gemm: fx.Node) -> fx.Node:
        ann = annotation(gemm)
        d = ann.decision
        left, right, bias = matmul_operands(gemm)
        specs = [
            CastSpec(
                fmt,
                block,
                d.power_of_two,
                d.margin,
                d.delayed,
                d.stochastic_rounding and operand_role == "grad_output",
                (-1, -2)[i] if d.hadamard else None,
                _rounding(d),
            )
            for i, (fmt, block, operand_role) in enumerate(zip(d.formats, d.blocks, d.operand_roles))
        ]
        keys = [state_key(ann.site, ann.role, operand_role) for operand_role in d.operand_roles]
        a, qa = self.operand(left, specs[0], gemm, keys[0])
        b, qb = self.operand(right, specs[1], gemm, keys[1])
        args, kwargs = ScaledMmArgs(
            a,
            b,
            qa.scale_inv,
            qb.scale_inv,
            bias=bias,
            out_dtype=gemm.meta["val"].dtype,
            block_a=list(d.blocks[0]),
            block_b=list(d.blocks[1]),
            fast_accum=d.fast_accum,
        ).call_args()
        with self.graph.inserting_before(gemm):
            new = self.add(ScaledMmArgs.op(), args, kwargs, tag_from=gemm)
        copy_meta(gemm, new)  # the FP8 GEMM takes the replaced one's place
        annotate(new, replace(ann, state_keys=(qa.state_key, qb.state_key)))
        gemm.replace_all_uses_with(new)
        self.graph.erase_node(gemm)
        if self.ctx.taps.shadow is not None:  # shadow check: the same product in high precision, now and then
            with self.graph.inserting_after(new):
                key = ShadowChecks.key(ann.site, ann.role)
                observed = [left, right] if bias is None else [left, right, bias]
                check = self.add(fp8fx_ops.tap.default, (new, observed, self.ctx.taps.shadow, key), tag_from=new)
            new.replace_all_uses_with(check, delete_user_cb=lambda user: user is not check)
        return new


def _applies(target, args: tuple, kwargs: dict, fake_mode) -> bool:
    """Whether `target(*args)` runs on the nodes' fake values (a view can fail on some strides)."""
    try:
        with fake_mode:
            target(*node_values(args), **node_values(kwargs))
    except (RuntimeError, ValueError):
        return False
    return True


def insert_casts(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    fp8_gemms = [n for n in gm.graph.nodes if any(a.fp8 for a in node_annotations(n))]
    if not fp8_gemms:
        return PassResult(gm, modified=False)
    inserter = _Inserter(gm.graph, ctx)
    for gemm in fp8_gemms:  # graph order: forward GEMMs make the casts backward reuses
        if group_offsets(gemm) is not None:
            inserter.rewrite_grouped(gemm)
        else:
            inserter.rewrite(gemm)
    inserter.step_states()
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return PassResult(gm, modified=True)
