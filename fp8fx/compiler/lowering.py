"""What Inductor compiles in place of fp8fx's elementwise ops (and its emulated and cuBLAS GEMMs).

The FP8 passes keep every amax -> scale -> cast step an explicit `fp8fx::` node, and the report
reads the decisions off them. Under Inductor, the joint graph's amaxes, scales and casts become
ATen ops before it is partitioned (`lower_casts`), so min-cut weighs them as it weighs torchao's:
it saves an FP8 copy where that is the cheapest tensor to keep, and casts again in backward where
the high-precision tensor is kept anyway (a rowwise weight gradient's operand, cast along the
tokens, is then never saved). The scale inverses and the BF16 copies of saved outputs stay
`fp8fx::` nodes through partitioning (a saved copy must look worth saving, not a conversion to
recompute). Once a graph is partitioned, Inductor gets them (and an inference graph its casts)
as the ATen ops they compute too, so it fuses them like its own: an amax
into the kernel that reads its tensor, a scale into a few scalar ops of the kernels that read it,
a cast into one pass that reads the high-precision tensor once. Only the GEMMs (and what must call
back into Python: delayed-scaling state, taps, grouped and NVFP4 ops) stay opaque.

Where a GEMM would run the exact CPU emulation (CPU tensors, not a generated kernel under Triton's
interpreter), it too becomes ATen ops: the upcast of its FP8 operands, an fp32 `mm`, the scaling
and the epilogue, so the emulation fuses as torchao's does. A GEMM the graph gives to cuBLAS on a
GPU becomes `aten._scaled_mm` and its epilogue ATen ops, where `_scaled_mm` takes its shapes and
scales as they are: Inductor's code calls cuBLAS without a Python call per GEMM, as it does
torchao's, and fuses the epilogue. A generated-kernel GEMM stays one `fp8fx::` op, on a GPU and
under the interpreter that runs the generated kernels on CPU tensors: the interpreter tests run
the graph a GPU runs.

The decompositions compute what the reference ops compute, value for value: Inductor rounds
`x * scale` to fp32 and then to FP8 as eager does, and takes the scale in fp64 as the reference.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, fx
from torch.utils.checkpoint import CheckpointPolicy

from fp8fx.codegen.dispatch import scaled_mm_kind
from fp8fx.codegen.versions import interpreter_active
from fp8fx.core import scaling
from fp8fx.core.formats import FP8_DTYPES, fp8_format_of
from fp8fx.ops import cuda, reference
from fp8fx.ops.args import Fp8GemmArgs, ScaledMmArgs, gemm_args
from fp8fx.passes.annotation import annotation, fp8_gemm_nodes
from fp8fx.passes.graph_utils import add_node, decompose_nodes, fake_mode_of, k_contiguous, views_key

fp8fx_ops = torch.ops.fp8fx
aten = torch.ops.aten


def _amax(x: Tensor, block: list[int]) -> Tensor:
    if not block:  # one reduction of |x|, which Inductor can fuse into x's producer or consumers
        return x.abs().amax().to(torch.float32)
    return scaling.block_amax(x, tuple(block))


def _state_amax(x: Tensor, block: list[int]) -> Tensor:
    """A delayed cast's amax, which only its state update reads: the amaxes of x's rows (in memory
    order), whose max `fp8fx::delayed_scale_steps` takes (the same value: a max is exact). Inductor fuses
    a reduction per row into a producer that reduces rows (a norm, its backward) as into the cast's
    kernel; one whole-tensor reduction has another shape, and read the tensor again after such a producer."""
    order = None if x.is_contiguous() else _memory_order(x)
    return (x if order is None else x.permute(order)).abs().amax(dim=-1).to(torch.float32)


def _is_state_amax(node: fx.Node) -> bool:
    """Whether `node` is a tensorwise `fp8fx::amax` of a tensor of 2 or more dims whose only readers
    are delayed-scaling state updates (not an all-reduce, which needs one shape on every rank)."""
    step = fp8fx_ops.delayed_scale_steps.default
    x = node.args[0].meta["val"]
    return (
        node.target is fp8fx_ops.amax.default
        and not list(node.args[1])
        and x.dim() >= 2
        and bool(node.users)
        and all(u.target is step for u in node.users)
    )


def _lower(graph: fx.Graph, decompositions: dict, kept_whole: dict, meta: dict) -> int:
    """`decompose_nodes` of `decompositions`, a delayed cast's amax as `_state_amax` (`_is_state_amax`)."""
    amax = fp8fx_ops.amax.default
    replaced = decompose_nodes(graph, {amax: _state_amax}, also=kept_whole, meta=meta, where=_is_state_amax)
    return replaced + decompose_nodes(graph, decompositions, also=kept_whole, meta=meta)


def _scaled(x: Tensor, scale: Tensor, block: list[int]) -> Tensor:
    """`x * scale` in fp32, one scale per block. Blocks of 1 or of a whole dimension broadcast; other
    blocks look their scale up by index. (Inductor's CPU code for `repeat_interleave`, which
    `scaling.expand_blocks` uses eagerly, or for an expanded scale cut to a partial edge block,
    read the wrong values in that block: torch 2.11 and 2.13.)

    The product itself takes a BF16 or FP16 `x` to fp32 (an fp32 scale of at least one dimension
    promotes it): an explicit upcast of a value rounded to BF16 from fp32 is what Inductor's
    `pointless_convert` folds away, and the cast would then read, and Inductor keep, the unrounded
    fp32 tensor (a Llama MLP's fp32 gradients alive at the backward's peak on a GPU; docs/results.md,
    "On a GPU", fifth run).

    The scale is read through an `as_strided`, which makes Inductor store it (one value per row or
    block, written by the amax's kernel). Computed where it is read instead, its 20-odd scalar ops
    (a power-of-two scale's bit masks, the checks for a zero or non-finite amax) took the product
    past the op count at which Inductor's GPU rules store a value: the fp32 product `x * scale` of
    every rowwise cast of a recomputed tensor was written and read back, which left fp32 MLP-sized
    tensors alive at a BF16 Llama step's backward peak and added memory passes (docs/results.md,
    "Peak memory of a BF16 step as a GPU runs it")."""
    if x.dtype == torch.float64 or x.dim() == 0:
        x = x.to(torch.float32)
    scale = scale.as_strided(scale.shape, scale.stride())
    if not block:
        return x * scale.reshape([1] * x.dim())
    rows, cols = x.shape[-2:]
    b0, b1 = scaling.block_dims(x.shape, tuple(block))
    if b0 in (1, rows) and b1 in (1, cols):
        return x * scale
    row_block = torch.arange(rows, device=x.device) // b0
    col_block = torch.arange(cols, device=x.device) // b1
    return x * scale[..., row_block[:, None], col_block[None, :]]


def _cast(x: Tensor, scale: Tensor, dtype: torch.dtype, block: list[int]) -> Tensor:
    fmt = fp8_format_of(dtype)
    if not block and x.dim() > 1 and not x.is_contiguous():  # (a scale per block reads x's dims in order)
        order = _memory_order(x)
        if order is not None:
            return _cast(x.permute(order), scale, dtype, block).permute(_inverse(order))
    return _scaled(x, scale, block).clamp(-fmt.max, fmt.max).to(dtype)


def _memory_order(x: Tensor) -> list[int] | None:
    """The permutation of x's dimensions that is contiguous (x dense in another order, as an
    attention output is), or None. A cast computed in that order writes its FP8 tensor in x's
    memory order: Inductor lays an elementwise result out in the order it computes it, and a GEMM
    reading a transposed view of it would need a copy."""
    if not all(isinstance(s, int) for s in x.stride()):
        return None
    order = scaling.storage_order(x)
    return order if x.permute(order).is_contiguous() else None


def _inverse(order: list[int]) -> list[int]:
    return sorted(range(len(order)), key=order.__getitem__)


def _scale_inverse(scale: Tensor) -> Tensor:
    return scale.reciprocal()


def _saved_copy(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x.to(dtype)


def _widen(q: Tensor, scale_inv: Tensor, dtype: torch.dtype, block: list[int]) -> Tensor:
    return _scaled(q.to(torch.float32), scale_inv, block).to(dtype)


def _to_fp32(x: Tensor) -> Tensor:
    return x.to(torch.float32)


def _emulated(a: Tensor, b: Tensor, gpu_kernel: str = "scaled_mm") -> bool:
    """Whether a GEMM on `a`, `b` runs the exact CPU emulation (see the module's docstring)."""
    return (
        a.device.type == "cpu"
        and a.dtype in FP8_DTYPES
        and b.dtype in FP8_DTYPES
        and not (gpu_kernel in ("triton", "nvfp4") and interpreter_active())
    )


def _on_cublas(a: Tensor, b: Tensor, block_a: list[int], block_b: list[int], gpu_kernel: str, devices: tuple[str, ...]) -> bool:
    """Whether the graph gives this GEMM to cuBLAS and `aten._scaled_mm` takes it as it is: on one of
    `devices` (the backend option `cublas_devices`: "cuda", and "cpu" where torch's CPU `_scaled_mm`
    runs the graph a GPU runs), 2-D, static M, N and K multiples of 16, tensorwise or rowwise scales,
    at most one E5M2 operand (any other the op pads, or runs on another kernel)."""
    if gpu_kernel != "scaled_mm" or a.device.type not in devices or a.dim() != 2 or b.dim() != 2:
        return False
    if a.dtype == b.dtype == torch.float8_e5m2 or a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        return False
    sizes = (*a.shape, b.shape[1])
    return all(isinstance(d, int) and d % 16 == 0 for d in sizes) and scaled_mm_kind(block_a, block_b) in (
        "tensorwise",
        "rowwise",
    )


def _on_cublas_gemm(g: ScaledMmArgs | Fp8GemmArgs, devices: tuple[str, ...]) -> bool:
    """Whether the graph gives this GEMM to cuBLAS (`_on_cublas`); `fp8fx::scaled_mm` always runs
    `torch._scaled_mm` on a GPU."""
    return _on_cublas(g.a, g.b, g.block_a, g.block_b, getattr(g, "gpu_kernel", "scaled_mm"), devices)


def _emulated_gemm(g: ScaledMmArgs | Fp8GemmArgs, devices: tuple[str, ...]) -> bool:
    """Whether a GEMM runs the exact CPU emulation: one the graph does not give to cuBLAS on `devices`."""
    return not _on_cublas_gemm(g, devices) and _emulated(g.a, g.b, getattr(g, "gpu_kernel", "scaled_mm"))


def _scaled_mm(*args, devices: tuple[str, ...], **kwargs):
    """`fp8fx::scaled_mm` (a GEMM without fused epilogue: batched, or `fuse_epilogues=False`): the
    exact CPU emulation, or on cuBLAS as its CUDA implementation runs it (traced, as `_cublas_fp8_gemm`)."""
    g = ScaledMmArgs.bind(args, kwargs)
    if _emulated_gemm(g, devices):
        return reference.emulated_mm(g.a, g.b, g.scale_inv_a, g.scale_inv_b, g.bias, g.out_dtype, g.block_a, g.block_b, _to_fp32)
    if not _on_cublas_gemm(g, devices):
        return NotImplemented
    return cuda.scaled_mm_cuda(*g.operands, g.scale_inv_a, g.scale_inv_b, g.bias, g.out_dtype, g.block_a, g.block_b, g.fast_accum)


def _cublas_fp8_gemm(g: Fp8GemmArgs, devices: tuple[str, ...]):
    """A cuBLAS FP8 GEMM as the ATen ops `fp8fx::fp8_gemm`'s CUDA implementation runs (traced: its
    `aten._scaled_mm` and epilogue), so that Inductor's code calls cuBLAS itself (no Python per
    call, as for torchao's GEMMs) and fuses the epilogue. Its padding and column-major copy are
    no-ops here: the sizes are multiples of 16 and the operands K-major (`lay_out_operands`)."""
    if not _on_cublas_gemm(g, devices):
        return NotImplemented
    return cuda.fp8_gemm_on_cuda(g)


def _fp8_gemm(*args, devices: tuple[str, ...], **kwargs):
    g = Fp8GemmArgs.bind(args, kwargs)
    if _emulated_gemm(g, devices):
        return reference.emulated_fp8_gemm(g, _to_fp32)
    return _cublas_fp8_gemm(g, devices)


def _runs_emulated(gemm: fx.Node, cublas_devices: tuple[str, ...]) -> bool:
    """Whether an `fp8fx::` GEMM node becomes the exact CPU emulation here (`_scaled_mm`, `_fp8_gemm`)."""
    if gemm.target not in (fp8fx_ops.scaled_mm.default, fp8fx_ops.fp8_gemm.default):
        return False
    g = gemm_args(gemm)
    return _emulated_gemm(g.replace(a=g.a.meta["val"], b=g.b.meta["val"]), cublas_devices)


LOWERED = {
    fp8fx_ops.amax.default: _amax,
    fp8fx_ops.amax_to_scale.default: reference.amax_to_scale,  # scalar tensor ops already
    fp8fx_ops.cast.default: _cast,
    fp8fx_ops.scale_inverse.default: _scale_inverse,
    fp8fx_ops.saved_copy.default: _saved_copy,
    fp8fx_ops.widen.default: _widen,
    fp8fx_ops.scaled_mm.default: _scaled_mm,  # (the GEMMs need `devices`: see `lowered`)
    fp8fx_ops.fp8_gemm.default: _fp8_gemm,
}


def lowered(cublas_devices: tuple[str, ...]) -> dict:
    """`LOWERED` for a backend whose `cublas_devices` option names these devices."""
    devices = tuple(cublas_devices)
    gemms = {
        op: functools.partial(LOWERED[op], devices=devices) for op in (fp8fx_ops.scaled_mm.default, fp8fx_ops.fp8_gemm.default)
    }
    return {**LOWERED, **gemms}


# Meta of the nodes a lowered amax, cast or saved copy becomes (the ops that read or write a whole
# tensor; scales are scalar work): (site, role) of the FP8 GEMM whose memory passes the kernels
# they run in count towards (fp8fx.compiler.memory_passes).
CHARGED_TO = "fp8fx_charged_to"
LOWERED_FROM = "fp8fx_lowered_from"  # meta of every node a lowered op becomes: the op's name
# The ops whose lowered nodes are a GEMM's own work: the CPU emulation's kernels (the operands'
# fp32 upcasts, the scaling) stand for the GEMM a GPU runs, and a cuBLAS GEMM's epilogue is the
# GEMM's output; neither is FP8's passes.
EMULATED_GEMMS = (fp8fx_ops.scaled_mm.default.name(), fp8fx_ops.fp8_gemm.default.name())
_ELEMENTWISE = (fp8fx_ops.amax.default, fp8fx_ops.cast.default, fp8fx_ops.saved_copy.default)


def _lowering_meta(graph: fx.Graph, targets=LOWERED) -> dict[fx.Node, dict]:
    """The meta each lowered node's decomposition gets: `LOWERED_FROM`; for an amax, cast or saved
    copy, `CHARGED_TO` the first (in graph order) FP8 GEMM its value reaches, or, for a saved copy,
    the GEMM whose output it copies."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    gemms = {n for n in fp8_gemm_nodes(graph) if annotation(n) is not None}
    charges: dict[fx.Node, dict] = {}
    for node in graph.nodes:
        if node.target not in _ELEMENTWISE:
            continue
        frontier, seen, found = [node], {node}, []
        for _ in range(8):  # casts reach their GEMMs through a few views and scale ops
            step = [m for n in frontier for m in (n.all_input_nodes if node.target is fp8fx_ops.saved_copy.default else n.users)]
            found += [m for m in step if m in gemms]
            frontier = [m for m in step if m not in seen and m not in gemms]
            seen.update(frontier)
        if found:
            ann = annotation(min(found, key=order.__getitem__))
            charges[node] = {CHARGED_TO: (ann.site, ann.role)}
    for node in graph.nodes:  # a delayed cast's amax feeds its state, not the cast's scale: charged as that cast
        if node.target is fp8fx_ops.amax.default and node not in charges:
            casts = [u for u in node.args[0].users if u.target is fp8fx_ops.cast.default and u in charges]
            if casts:
                charges[node] = dict(charges[casts[0]])
    for node in graph.nodes:
        if node.target in targets:  # (only the nodes lowered take it, and their checkpoint tag: weight_fp8="recompute")
            charges.setdefault(node, {})[LOWERED_FROM] = node.target.name()
            if "recompute" in node.meta:
                charges[node]["recompute"] = node.meta["recompute"]
    return {n: m for n, m in charges.items() if n.target in targets}


def lower_elementwise(gm: fx.GraphModule, kept_whole: dict, cublas_devices: tuple[str, ...]) -> int:
    """Replace `gm`'s fp8fx amax, scale, cast, scale-inverse and saved-copy nodes, and its emulated
    GEMMs, by the ATen ops they compute (a partitioned graph, before Inductor compiles it; what they
    compute is decomposed with `kept_whole` too: the entries the compile took out of Inductor's
    table, e.g. an epilogue's activation); returns how many. A GEMM given to cuBLAS on one of
    `cublas_devices` becomes `aten._scaled_mm`. The nodes an amax, cast or saved copy becomes carry
    the GEMM it is charged to (`CHARGED_TO`)."""
    replaced = _lower(gm.graph, lowered(cublas_devices), kept_whole, _lowering_meta(gm.graph))
    if replaced:
        gm.recompile()
    return replaced


# Lowered before partitioning (a joint graph under Inductor): the amax -> scale -> cast chain.
LOWERED_BEFORE_PARTITION = {
    op: LOWERED[op] for op in (fp8fx_ops.amax.default, fp8fx_ops.amax_to_scale.default, fp8fx_ops.cast.default)
}


def lower_casts(graph: fx.Graph, kept_whole: dict) -> int:
    """Replace a joint graph's amax, amax-to-scale and cast nodes by the ATen ops they compute, so
    that the partitioner can recompute a cast in backward (see the module's docstring); returns
    how many. Their nodes carry the GEMM they are charged to, as after `lower_elementwise`."""
    meta = _lowering_meta(graph, LOWERED_BEFORE_PARTITION)
    return _lower(graph, LOWERED_BEFORE_PARTITION, kept_whole, meta)


PARTITION_COPY = "fp8fx_partition_copy"  # meta of the copies `let_backward_cast_again` adds


def let_backward_cast_again(graph: fx.Graph) -> int:
    """In a joint graph, make each backward GEMM operand read from an activation's FP8 tensor (one
    a forward cast wrote) go through a transposed copy of it, one per tensor, which min-cut must
    recompute; returns how many. Min-cut never recomputes a value that backward reads with an op it
    cannot fuse (the GEMM), so it saved each such FP8 tensor (1 byte a value) even where backward
    keeps what it was cast from anyway (a gated MLP's product, from the gate and up outputs SiLU's
    backward keeps) and could cast it again for nothing, as torchao's casts are. Read through a copy,
    which it can fuse, the tensor is weighed like any other: saved, or cast again from what is kept.
    (A copy, not a clone: Inductor removes a clone that changes no layout before partitioning.)
    `drop_partition_copies` takes the copies out of the partitioned graphs."""
    fake_mode = fake_mode_of(graph)
    copies: dict[tuple, fx.Node] = {}
    for gemm in fp8_gemm_nodes(graph):
        ann = annotation(gemm)
        if ann is None or ann.role == "output" or not ann.fp8:
            continue
        for side, role in enumerate(ann.decision.operand_roles):
            operand = gemm_args(gemm).operands[side]
            base, chain = _view_chain(operand)
            val = operand.meta["val"]
            if (
                role != "input"
                or base.op != "call_function"
                or val.dtype not in FP8_DTYPES
                or val.dim() != 2
                or val.t().is_contiguous()
            ):
                continue
            key = views_key(base, chain)
            if key not in copies:
                with graph.inserting_before(gemm):
                    t = add_node(graph, fake_mode, aten.permute.default, (operand, [1, 0]), tag_from=gemm)
                    copy = add_node(
                        graph, fake_mode, aten.clone.default, (t,), {"memory_format": torch.contiguous_format}, tag_from=gemm
                    )
                    copies[key] = add_node(graph, fake_mode, aten.permute.default, (copy, [1, 0]), tag_from=gemm)
                copy.meta.update({PARTITION_COPY: True, "recompute": CheckpointPolicy.MUST_RECOMPUTE})
            gemm_args(gemm).with_operand(side, copies[key]).write(gemm)
    return len(copies)


def drop_partition_copies(gm: fx.GraphModule) -> None:
    """Make the GEMMs read the tensors `let_backward_cast_again`'s copies copy (saved by forward, or
    cast again in backward) as they did before; `lay_out_operands` then lays them out."""
    fake_mode = fake_mode_of(gm.graph)
    for copy in [n for n in gm.graph.nodes if n.meta.get(PARTITION_COPY)]:
        transposed = copy.args[0]  # permute(operand), or forward's value of it (a view min-cut saved)
        for read in list(copy.users):  # permute(copy): the operand, K-major
            if transposed.op == "call_function":
                operand = transposed.args[0]
            else:
                with gm.graph.inserting_before(read):
                    operand = add_node(gm.graph, fake_mode, aten.permute.default, (transposed, [1, 0]), tag_from=read)
            read.replace_all_uses_with(operand)
            gm.graph.erase_node(read)
        gm.graph.erase_node(copy)
        if transposed.op == "call_function" and not transposed.users:
            gm.graph.erase_node(transposed)


def operand_numels(gm: fx.GraphModule) -> list[int]:
    """Elements of each tensor the graph casts to FP8 (static shapes only): an fp8fx cast's input,
    or the FP8 value a cast lowered before partitioning wrote."""
    cast = fp8fx_ops.cast.default
    numels = [n.args[0].meta["val"].numel() for n in gm.graph.nodes if n.target is cast]
    numels += [
        n.meta["val"].numel()
        for n in gm.graph.nodes
        if n.meta.get(LOWERED_FROM) == cast.name() and getattr(n.meta.get("val"), "dtype", None) in FP8_DTYPES
    ]
    return [n for n in numels if isinstance(n, int)]


def lay_out_operands(gm: fx.GraphModule, cublas_devices: tuple[str, ...]) -> set[tuple[str, str]]:
    """Give each 2-D FP8 GEMM operand that is not K-contiguous a K-major copy in the graph, one per
    tensor and layout, before lowering. Inductor writes a copy of a tensor cast here from the cast's
    kernel (which reads the high-precision tensor once), and a copy of an FP8 tensor forward saved
    for backward, or stored for another GEMM (`_stored_view`), in a tiled transpose kernel, which
    the GEMMs reading that tensor share. The GPU launcher's own copy of a transposed FP8 tensor is
    a strided elementwise kernel, several times slower than either. Each copy is charged to the first GEMM that reads it
    (`CHARGED_TO`), so the kernel it runs in counts towards that GEMM's memory passes. Returns the
    (site, role) of the GEMMs whose launchers are left no copy to make (every 2-D GEMM)."""
    fake_mode = fake_mode_of(gm.graph)
    laid: dict[tuple, fx.Node] = {}
    gemms = set()
    to_lay = []
    sharing: dict[tuple, set[fx.Node]] = {}  # per copy, its GEMMs and the views they read it through
    for gemm in [
        n for n in fp8_gemm_nodes(gm.graph) if n.target is not fp8fx_ops.fp8_grouped_mm.default and annotation(n) is not None
    ]:
        ann, operands = annotation(gemm), gemm_args(gemm).operands
        if all(x.meta["val"].dim() == 2 for x in operands):
            gemms.add((ann.site, ann.role))
        emulated = _runs_emulated(gemm, cublas_devices)
        for side in (0, 1):
            val = operands[side].meta["val"]
            if val.dim() == 2 and not k_contiguous(val, side):
                # GEMMs reading one tensor alike (q, k, v's weight gradients) share its copy
                base, chain = _view_chain(operands[side])
                key = (*views_key(base, chain), side)
                to_lay.append((gemm, side, key, emulated))
                sharing.setdefault(key, set()).update((gemm, *chain))
    for gemm, side, key, emulated in to_lay:
        ann, operand = annotation(gemm), gemm_args(gemm).operands[side]
        if key not in laid:
            with gm.graph.inserting_before(gemm):
                # An emulated GEMM's ATen ops fuse with the cast and the copy: nothing stores them.
                source = operand if emulated else _stored_view(gm, fake_mode, operand, gemm, sharing[key])
                t = source if side == 0 else add_node(gm.graph, fake_mode, aten.permute.default, (source, [1, 0]), tag_from=gemm)
                copy = add_node(
                    gm.graph, fake_mode, aten.clone.default, (t,), {"memory_format": torch.contiguous_format}, tag_from=gemm
                )
                laid[key] = _copy_read(gm, fake_mode, copy, side, gemm, emulated)
            copy.meta[CHARGED_TO] = (ann.site, ann.role)
        gemm_args(gemm).with_operand(side, laid[key]).write(gemm)
    gm.recompile()
    return gemms


def _copy_read(gm: fx.GraphModule, fake_mode, copy: fx.Node, side: int, gemm: fx.Node, emulated: bool) -> fx.Node:
    """The GEMMs' operand read from its row-major `copy` (for `side` 1, the copy of its transpose,
    read transposed back): through `as_strided`, which makes Inductor store the copy once, where a
    clone or permute would leave each GEMM reading it to make a copy of its own. Not for an
    `emulated` GEMM, into whose kernels Inductor fuses the copy, nor for symbolic sizes."""
    rows, cols = copy.meta["val"].shape
    if emulated or not (isinstance(rows, int) and isinstance(cols, int)):
        return copy if side == 0 else add_node(gm.graph, fake_mode, aten.permute.default, (copy, [1, 0]), tag_from=gemm)
    layout = ([rows, cols], [cols, 1]) if side == 0 else ([cols, rows], [1, cols])
    return add_node(gm.graph, fake_mode, aten.as_strided.default, (copy, *layout), tag_from=gemm)


def _view_chain(operand: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """The tensor `operand` views (itself if it is no view), and the views in between, outermost first."""
    chain, base = [], operand
    while base.op == "call_function" and getattr(base.target, "is_view", False) and isinstance(base.args[0], fx.Node):
        chain.append(base)
        base = base.args[0]
    return base, chain


def _stored_view(gm: fx.GraphModule, fake_mode, operand: fx.Node, gemm: fx.Node, sharing: set[fx.Node]) -> fx.Node:
    """`operand`, read from its FP8 tensor in memory where that tensor is stored anyway: the
    tensor a chain of views of `operand` starts from, when something besides that chain reads it
    (the other GEMM of a gradient cast once for both), not only the GEMMs `sharing` the copy (and
    the views they read it through). Inductor would otherwise compute the copy
    from the cast's own inputs, reading the BF16 tensor again (2 bytes a value, and the scale
    arithmetic) where the stored FP8 tensor is 1. An `as_strided` of the tensor onto itself makes
    Inductor store it before the copy reads it, whatever order the GEMMs come in; the views are
    replayed on it (a `reshape` among them may copy). Not where that tensor is itself a layout copy
    of the cast (a head-major attention gradient made token-major): Inductor computes both layouts
    in one kernel there, from the cast's inputs, which reading the copy back would split in two."""
    base, chain = _view_chain(operand)
    val = base.meta["val"]
    layout = (list(val.shape), list(val.stride()), val.storage_offset())
    others = [u for n in (*chain, base) for u in n.users if u not in sharing]
    static = all(isinstance(d, int) for d in (*layout[0], *layout[1], layout[2]))  # (a symbolic size would need its graph node)
    copy = base.target in (aten.clone.default, aten.contiguous.default)
    if base.op != "call_function" or copy or val.dtype not in FP8_DTYPES or not others or not static:
        return operand
    view = add_node(gm.graph, fake_mode, aten.as_strided.default, (base, *layout), tag_from=gemm)
    for node in reversed(chain):  # innermost first
        view = add_node(gm.graph, fake_mode, node.target, (view, *node.args[1:]), dict(node.kwargs), tag_from=gemm)
    return view
