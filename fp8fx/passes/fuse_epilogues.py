"""fuse_epilogues: absorb the elementwise chain after each FP8 GEMM into one `fp8fx::fp8_gemm` node.

Walking forward from each `fp8fx::scaled_mm`, through reshapes that keep the last dimension
(elementwise ops commute with them), the pass takes, in the kernel's order: a bias add, an
activation (relu, gelu, gelu tanh, silu), a product with another tensor (`silu(gate) * up`
fuses as such, with the activation on either side), a residual add, and dtype casts. A value in the
middle of the chain that something else still needs (backward, typically) is stored as the
kernel's `aux` output; a second such value ends the chain there. A tensorwise `fp8fx::amax` of the
chain's result (the next layer's dynamic scale) is computed by the epilogue too.

Every 2-D FP8 GEMM becomes an `fp8_gemm` node, with or without epilogue, and its record says what
was fused, why the chain stopped, and which kernel runs it on a GPU and why (`fp8fx.codegen.dispatch`,
by the measurements of that GPU, `fp8fx.ops.gemm_bench.device_tables`, measuring what they lack).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace

import torch
from torch import fx

from fp8fx.codegen.dispatch import KernelChoice, choose_kernel, epilogue_to_inductor
from fp8fx.codegen.variants import GemmVariant
from fp8fx.core.epilogue import PLAIN, Epilogue, activation_of
from fp8fx.core.formats import Fp8Format
from fp8fx.ops import gemm_bench
from fp8fx.ops.args import Fp8GemmArgs, ScaledMmArgs, gemm_args
from fp8fx.passes.annotation import Fusion, annotate, annotation, update_fusion
from fp8fx.passes.graph_utils import (
    DTYPE_CASTS,
    PassContext,
    PassResult,
    add_node,
    copy_meta,
    fake_mode_of,
    is_backward,
    k_contiguous,
    op_args,
    reads_state,
    strip_layout,
)

aten = torch.ops.aten
fp8fx_ops = torch.ops.fp8fx

RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
STAGE_AFTER = {"bias": "pre_activation", "activation": "activation", "mul": "product", "residual": "sum"}


@dataclass
class _Chain:
    """The longest fusable chain found from one GEMM; truncated from the end until it fits."""

    steps: list = field(default_factory=list)  # (kind, node, extra) in order
    stop: str = "nothing after the GEMM to fuse"


@dataclass(frozen=True)
class Refusal:
    """Why a plan or placement of a fused GEMM was refused: falsy, as Inductor's pattern matcher's
    `FailedMatch`. `to_inductor`: the epilogue is left to Inductor (`epilogue_to_inductor`), which
    ends the search with a bare GEMM; any other refusal tries a shorter chain."""

    reason: str
    to_inductor: bool = False

    def __bool__(self) -> bool:
        return False


def _could_not_join(gemm: fx.Node, final: fx.Node) -> Refusal:
    """The refusal of a chain ending at `final` that no test of its own explains."""
    if final is gemm:
        return Refusal("the GEMM's N is dynamic: the fused kernel's 2-D views need it as a number")
    return Refusal(
        f"{final.name} ({final.target}) could not join: it needs a second value kept for "
        "other users, or an input computed after the GEMM result is needed"
    )


def _shape(node) -> tuple:
    return tuple(node.meta["val"].shape)


def _size_hint(size) -> int | None:
    """A size as a number: a dynamic one's hint (the size it had when traced), None without one."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return hint if isinstance(hint, int) else None


def _same_shape(node: fx.Node, shape: tuple) -> bool:
    """Shape equality that adds no guard on symbolic sizes (compared as expressions)."""
    return [str(d) for d in _shape(node)] == [str(d) for d in shape]


def _size_arg(node: fx.Node, chain: list[fx.Node]) -> list | None:
    """`node`'s shape as a view's size argument: its ints, or the size argument of a reshape in the
    chain with the same shape (whose symbolic sizes are graph nodes), or -1 for one symbolic size."""
    shape = _shape(node)
    if all(isinstance(d, int) for d in shape):
        return list(shape)
    for step in chain:
        if step.target in RESHAPES and _same_shape(step, shape):
            return list(step.args[1])
    symbolic = [i for i, d in enumerate(shape) if not isinstance(d, int)]
    return [-1 if i == symbolic[0] else d for i, d in enumerate(shape)] if len(symbolic) == 1 else None


def _activation_name(node: fx.Node) -> str | None:
    """The activation (`fp8fx.core.epilogue.ACTIVATIONS`) the node computes, if any."""
    return activation_of(node.target, node.kwargs) if node.op == "call_function" else None


def _used_by_backward(node: fx.Node) -> bool:
    """Whether a backward node reads `node` (directly or through reshapes)."""
    for user in node.users:
        if is_backward(user):
            return True
        if user.target in RESHAPES and _used_by_backward(user):
            return True
    return False


def _reshape_like(node: fx.Node):
    """How a fused GEMM's 2-D result takes the N-D shape of the chain value `node` it replaces: a
    view where `node` was one (a linear's own output, a view of its GEMM's), else `_unsafe_view`
    (no alias, as matmul's own reshape), since `node` was a fresh tensor (an add's or activation's
    result) and returned as a view it would differ from eager (FSDP2 warns on a returned view, and
    an in-place op on one would skip its pre-backward hook)."""
    return aten.view.default if node.target in (aten.view.default, aten.reshape.default) else aten._unsafe_view.default


def _other_operand(node: fx.Node, current: fx.Node):
    args = [a for a in node.args if a is not current]
    return args[0] if len(args) == 1 and isinstance(args[0], fx.Node) else None


def _walk(gemm: fx.Node) -> _Chain:
    """Follow the chain of single elementwise consumers from `gemm` (no graph changes)."""
    chain = _Chain()
    current, seen = gemm, set()
    n = _shape(gemm)[-1]
    while True:
        users = list(current.users)
        step = None
        for u in users:
            if u.op != "call_function":
                continue
            if u.target in RESHAPES and _shape(u)[-1] == n:
                step = ("reshape", u, None)
            elif u.target in DTYPE_CASTS and u.meta["val"].dtype in (torch.float32, torch.bfloat16, torch.float16):
                step = ("cast", u, None)
            elif _activation_name(u) and "activation" not in seen and "mul" not in seen and "residual" not in seen:
                step = ("activation", u, _activation_name(u))
            elif u.target == aten.add.Tensor and len(u.args) == 2 and u.kwargs.get("alpha", 1) == 1:
                other = _other_operand(u, current)
                if other is None or other.meta["val"].dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    continue
                if _shape(other) == (n,) and not seen & {"bias", "activation", "mul", "residual"}:
                    step = ("bias", u, other)
                elif _shape(other) == _shape(current) and "residual" not in seen:
                    step = ("residual", u, other)
            elif u.target == aten.mul.Tensor and len(u.args) == 2 and not seen & {"mul", "residual"}:
                other = _other_operand(u, current)
                if other is not None and _shape(other) == _shape(current) and other.meta["val"].dtype.is_floating_point:
                    step = ("mul", u, other)
            if step is not None:
                break
        if step is None:
            kinds = sorted({str(u.target) for u in users if u.op == "call_function"})
            if chain.steps or users:
                chain.stop = f"stops before {', '.join(kinds) or 'the graph output'}" if users else "result unused"
            return chain
        kind, node, _ = step
        chain.steps.append(step)
        if kind not in ("reshape", "cast"):
            seen.add(kind)
        current = node


class _Fuser:
    def __init__(self, gm: fx.GraphModule, kernels: str, inductor: bool, measure_gemms: float):
        self.graph = gm.graph
        self.fake_mode = fake_mode_of(self.graph)
        self.kernels = kernels
        self.inductor = inductor  # Inductor compiles the graph: it may run the epilogue better
        self.measure_gemms = measure_gemms
        self.tables = {}  # device -> its measurements (None off CUDA)
        self.order = {}
        self._renumber()

    def tables_of(self, device: torch.device):
        if device not in self.tables:
            self.tables[device] = gemm_bench.device_tables(device, self.measure_gemms)
        return self.tables[device]

    def _renumber(self):
        self.order = {node: i for i, node in enumerate(self.graph.nodes)}

    def add(self, target, args, tag_from, kwargs=None):
        return add_node(self.graph, self.fake_mode, target, args, kwargs, tag_from=tag_from)

    def plan(self, gemm: fx.Node, steps: list):
        """(epilogue, inputs, final node, aux node, amax users, absorbed nodes) for `steps`, or a `Refusal`."""
        bias = ScaledMmArgs.of(gemm).bias
        ep = Epilogue(bias=bias is not None)
        inputs = dict(bias=bias, other=None, residual=None)
        has_bias_step = any(kind == "bias" for kind, _, _ in steps)
        stage_of = {gemm: "pre_bias" if has_bias_step else "pre_activation"}  # the value each node holds
        final, absorbed = gemm, []
        for kind, node, extra in steps:
            if kind == "bias":
                ep, inputs["bias"] = replace(ep, bias=True), extra
            elif kind == "activation":
                ep = replace(ep, activation=extra)
            elif kind == "mul":
                act = _activation_name(extra)
                if act and len(extra.users) == 1 and _shape(extra.args[0]) == _shape(extra):
                    ep, inputs["other"] = replace(ep, mul="gated", mul_activation=act), extra.args[0]
                    absorbed.append(extra)  # silu(gate) * up: the activation runs on the loaded tensor
                else:
                    ep, inputs["other"] = replace(ep, mul="by_other"), extra
            elif kind == "residual":
                ep, inputs["residual"] = replace(ep, residual=True), extra
            stage_of[node] = STAGE_AFTER.get(kind, stage_of[final])
            absorbed.append(node)
            final = node
        # Values inside the chain that other nodes still use: at most one, stored as aux.
        needed = [n for n in stage_of if n is not final and any(u not in absorbed for u in n.users)]
        if len(needed) > 1 or (needed and stage_of[needed[0]] == "pre_bias"):
            return _could_not_join(gemm, final)
        aux_node = needed[0] if needed else None
        if aux_node is not None:
            # In training graphs an aux output costs saved memory unless it replaces what backward
            # would save anyway: min-cut cannot recompute through the fused op, so when backward
            # also reads the result it saves both (unfused: one, the activation recomputed), and
            # aux outputs of backward GEMMs also raised the saved bytes (docs/results.md,
            # "Benchmarks (CPU)", bench/saved_memory.py). Those chains end before the aux value instead.
            if is_backward(gemm) or _used_by_backward(final):
                return _could_not_join(gemm, final)
            # Nothing but widening casts after the aux value: the kernel would write the value twice,
            # narrow and wide (bf16 logits and their fp32 copy: 6 bytes an element), and the wide
            # copy outlives it (the lm_head's fp32 logits, saved for the loss's backward, twice the
            # bytes of the BF16 logits at the step's peak; docs/results.md, "Peak memory of a BF16
            # step as a GPU runs it"). Unfused, the consumer's kernel widens the value as it reads it.
            after = steps[[node for _, node, _ in steps].index(aux_node) + 1 :] if aux_node is not gemm else steps
            if all(kind in ("reshape", "cast") for kind, _, _ in after):
                last = steps[-1][1]
                return Refusal(f"{last.name} ({last.target}) left to its consumer: it only widens a value kept for other users")
            ep = replace(ep, aux=stage_of[aux_node])
        if self.inductor and final.meta["val"].dtype.itemsize > gemm.meta["val"].dtype.itemsize:
            # Inductor widens the result as its consumer's kernel reads it, so a GEMM writing the
            # wide copy saves no pass, skips the model's rounding, and what backward keeps of it is
            # kept wide (the lm_head's logits widened for the loss: saved in fp32, twice BF16's bytes).
            return Refusal(
                f"{final.name} ({final.target}) left to its consumer: it widens the result, which Inductor does as it reads it"
            )
        amax_users = [u for u in final.users if u.target == fp8fx_ops.amax.default and list(op_args(u)["block"]) == []]
        if amax_users:
            ep = replace(ep, out_amax=True)
        # The result's only use is a tensorwise FP8 cast with a scale known before the GEMM
        # (delayed scaling: read from state) and its amax: the kernel writes FP8 directly.
        casts = [
            u
            for u in final.users
            if u.target == fp8fx_ops.cast.default and list(op_args(u)["block"]) == [] and reads_state(op_args(u)["scale"])
        ]
        inputs["fp8_cast"] = casts[0] if len(casts) == 1 and set(final.users) == {*casts, *amax_users} else None
        return ep, inputs, final, aux_node, amax_users, absorbed

    def fuse(self, gemm: fx.Node) -> None:
        chain = _walk(gemm)
        full, rejected = len(chain.steps), None
        for length in range(full, -1, -1):
            steps = chain.steps[:length]
            if steps and steps[-1][0] in ("reshape", "cast") and length != full:
                continue
            planned = self.plan(gemm, steps)
            fused = self.place(gemm, *planned) if planned else planned
            if not fused and fused.to_inductor:
                self.place_bare(gemm, stop=f"left to Inductor: {fused.reason}")
                return
            if not fused:
                rejected = rejected or fused.reason
                continue
            update_fusion(fused, stop=rejected or chain.stop)
            return
        update_fusion(gemm, stop=rejected)  # not even the bare GEMM could be placed: it stays a scaled_mm

    def place(self, gemm, ep: Epilogue, inputs, final, aux_node, amax_users, absorbed) -> fx.Node | Refusal:
        """The fused node replacing `gemm` and its epilogue, or a `Refusal` when it cannot be placed."""
        g = ScaledMmArgs.of(gemm)
        m, n = _shape(gemm)
        consumers = [u for u in final.users] + ([u for u in aux_node.users if u not in absorbed] if aux_node is not None else [])
        at = min(consumers, key=self.order.__getitem__) if consumers else final.next
        # Inputs must exist before the fused node; 2-D views of n-D operands are made here.
        for key in ("other", "residual"):
            t = inputs[key]
            if t is None:
                continue
            if self.order[t] >= self.order[at]:
                return _could_not_join(gemm, final)
            if not t.meta["val"].is_contiguous():
                return _could_not_join(gemm, final)
        if inputs["bias"] is not None and self.order[inputs["bias"]] >= self.order[at]:
            return _could_not_join(gemm, final)
        if not isinstance(n, int):
            return _could_not_join(gemm, final)  # a dynamic N: the 2-D views below need it as a number
        # The n-D shapes the fused result is viewed back to, as graph arguments (symbolic sizes
        # must come from nodes of the graph, never be baked in as raw SymInts).
        sizes = {node: _size_arg(node, absorbed) for node in (final, aux_node) if node is not None}
        if any(size is None for size in sizes.values()):
            return _could_not_join(gemm, final)
        fp8_cast = inputs["fp8_cast"]
        out_val = (fp8_cast or final).meta["val"]
        aux_dtype = aux_node.meta["val"].dtype if aux_node is not None else final.meta["val"].dtype
        out_scale = op_args(fp8_cast)["scale"] if fp8_cast is not None else None
        a, b = g.a.meta["val"], g.b.meta["val"]
        variant = GemmVariant(a.dtype, b.dtype, tuple(g.block_a), tuple(g.block_b), ep, out_val.dtype, aux_dtype, g.fast_accum)
        k = a.shape[-1]
        shape = tuple(d if isinstance(d, int) else None for d in (m, n, k))
        hint = tuple(_size_hint(d) for d in (m, n, k))
        tables = self.tables_of(out_val.device)
        if self.inductor and not _nvfp4(gemm):
            why = epilogue_to_inductor(self.kernels, variant, shape, tables, hint)
            if why:
                return Refusal(why, to_inductor=True)
        choice = KernelChoice(*NVFP4_KERNEL) if _nvfp4(gemm) else choose_kernel(self.kernels, variant, shape, tables, hint)
        with self.graph.inserting_before(at):
            flat = {}
            for key in ("other", "residual"):
                t = inputs[key]
                flat[key] = t if t is None or _same_shape(t, (m, n)) else self.add(aten.view.default, (t, [-1, n]), tag_from=gemm)
            fused_args = Fp8GemmArgs(
                g.a,
                g.b,
                g.scale_inv_a,
                g.scale_inv_b,
                bias=inputs["bias"],
                other=flat["other"],
                residual=flat["residual"],
                out_scale=out_scale,
                out_dtype=out_val.dtype,
                aux_dtype=aux_dtype,
                block_a=list(g.block_a),
                block_b=list(g.block_b),
                epilogue=ep.spec(),
                gpu_kernel=choice.kernel,
                fast_accum=g.fast_accum,
            )
            args, kwargs = fused_args.call_args()
            fused = self.add(Fp8GemmArgs.op(), args, tag_from=gemm, kwargs=kwargs)
            outs = [self.add(operator.getitem, (fused, i), tag_from=gemm) for i in range(3)]
            out = (
                outs[0] if _same_shape(final, (m, n)) else self.add(_reshape_like(final), (outs[0], sizes[final]), tag_from=gemm)
            )
            aux = None
            if aux_node is not None:
                aux = (
                    outs[1]
                    if _same_shape(aux_node, (m, n))
                    else self.add(_reshape_like(aux_node), (outs[1], sizes[aux_node]), tag_from=gemm)
                )
        copy_meta(gemm, fused)  # the fused GEMM takes the scaled_mm's place
        fusion = Fusion(choice.kernel, choice.reason, epilogue=ep, absorbed=tuple(n.name for n in absorbed), variant=variant)
        annotate(fused, replace(annotation(gemm), fusion=fusion, measured=choice.timing))
        for u in amax_users:
            u.replace_all_uses_with(outs[2])
        (fp8_cast or final).replace_all_uses_with(out)
        if aux is not None:
            for u in list(aux_node.users):
                if u not in absorbed:
                    u.replace_input_with(aux_node, aux)
        # Consumers first (the cast and amaxes read the chain's last node): a node left behind
        # dead would still look like a consumer to the next GEMM's chain.
        for node in reversed([*absorbed, *([fp8_cast] if fp8_cast is not None else []), *amax_users]):
            if not node.users:
                self.graph.erase_node(node)
        if not gemm.users:
            self.graph.erase_node(gemm)
        self._renumber()
        return fused

    def place_bare(self, gemm: fx.Node, stop: str) -> None:
        """`gemm` alone as an `fp8_gemm` node, its epilogue, amax and FP8 cast left in the graph; a
        bias the GEMM carries becomes an add after it (of the output's dtype: else it stays in)."""
        bias = ScaledMmArgs.of(gemm).bias
        split_bias = bias is not None and bias.meta["val"].dtype == gemm.meta["val"].dtype
        inputs = dict(bias=None if split_bias else bias, other=None, residual=None, fp8_cast=None)
        fused = self.place(gemm, replace(PLAIN, bias=not split_bias and bias is not None), inputs, gemm, None, [], [])
        if not fused:
            update_fusion(gemm, stop=stop)
            return
        if split_bias:
            out = next(u for u in fused.users if u.args[1] == 0)
            with self.graph.inserting_after(out):
                biased = self.add(aten.add.Tensor, (out, bias), tag_from=fused)
            out.replace_all_uses_with(biased, delete_user_cb=lambda user: user is not biased)
            self._renumber()
        update_fusion(fused, stop=stop)


def _count_memory_passes(graph: fx.Graph) -> None:
    """Per FP8 GEMM: memory passes (a kernel's read or write of an operand-sized tensor) that FP8
    adds to a BF16 GEMM, and the elementwise passes its epilogue saves, as the ops run one by one
    (`inner="eager"`). Added: each operand cast this GEMM is the first to use costs an amax read
    (unless a producer epilogue made the amax), a cast read and a write; an operand that is not
    K-contiguous costs a transposing copy (a read and a write). Under Inductor the casts' share is
    counted again from the kernels it makes (`fp8fx.compiler.memory_passes`)."""
    charged: set[fx.Node] = set()
    gemms = [n for n in graph.nodes if n.target in (fp8fx_ops.fp8_gemm.default, fp8fx_ops.scaled_mm.default)]
    # Forward GEMMs first: a fused node may sit late in the joint graph, but it runs in forward.
    for node in sorted(gemms, key=lambda n: annotation(n).role != "output"):
        added = copies = 0
        for i, operand in enumerate(gemm_args(node).operands):
            cast, _ = strip_layout(operand)
            if cast.target in (fp8fx_ops.cast.default, fp8fx_ops.cast_nvfp4.default) and cast not in charged:
                charged.add(cast)
                added += 2  # the cast reads the tensor and writes its FP8 copy
                amax = _amax_of(cast)
                added += amax is None or amax.target == fp8fx_ops.amax.default
            val = operand.meta["val"]
            copies += 2 * (not k_contiguous(val, i))  # a copy: a read and a write
        ep = annotation(node).fusion.epilogue if annotation(node).fusion else None
        saved = ep.ops() + ep.out_amax if ep is not None else 0
        update_fusion(node, memory_passes=(added + copies, saved), transposed_copies=copies)


def _amax_of(cast: fx.Node) -> fx.Node | None:
    """The amax node the cast's scale was computed from (None for a scale read from state)."""
    scale = op_args(cast)["scale"]
    if isinstance(scale, fx.Node) and scale.target == fp8fx_ops.amax_to_scale.default:
        return op_args(scale)["amax"]
    if isinstance(scale, fx.Node) and scale.target == operator.getitem and scale.args[0].target == fp8fx_ops.nvfp4_scale.default:
        return op_args(scale.args[0])["block_amax"]  # NVFP4: (scale, scale_inv) from the block amaxes
    return None


# NVFP4's FP4 operands run in their own generated kernel (Blackwell's FP4 MMA); a fused epilogue
# runs after it as torch ops.
NVFP4_KERNEL = ("nvfp4", "FP4 block-scaled tensor cores, Blackwell only; epilogue as torch ops")


def _nvfp4(gemm: fx.Node) -> bool:
    return Fp8Format.NVFP4 in (annotation(gemm).decision.formats or ())


def fuse_epilogues(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    gemms = [n for n in gm.graph.nodes if n.target == fp8fx_ops.scaled_mm.default and n.meta["val"].dim() == 2]
    for n in gm.graph.nodes:
        if n.target == fp8fx_ops.scaled_mm.default:
            batched = n.meta["val"].dim() != 2
            why = "batched GEMMs run unfused" if batched else "fuse_epilogues=False"
            stop = "batched GEMMs run unfused (torch's scaled-mm path)" if batched else None
            kernel, kernel_reason = NVFP4_KERNEL if _nvfp4(n) else ("scaled_mm", f"{why}: torch._scaled_mm")
            update_fusion(n, kernel=kernel, kernel_reason=kernel_reason, stop=stop)
    if not ctx.options.fuse_epilogues or not gemms:
        return PassResult(gm, modified=False)
    o = ctx.options
    fuser = _Fuser(gm, o.kernels, o.epilogues_to_inductor, o.measure_gemms)
    for gemm in gemms:
        fuser.fuse(gemm)
    gm.graph.eliminate_dead_code()
    _count_memory_passes(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, modified=True)
