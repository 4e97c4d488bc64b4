"""What every pass shares: the context and result types, the meta key, node helpers."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode

from fp8fx.passes.options import BackendOptions

aten = torch.ops.aten
prims = torch.ops.prims

# Ops that only re-view or copy a tensor: quantizing before them equals quantizing after them
# for a per-tensor scale, so casts are made once on the root and the chain is replayed on FP8.
LAYOUT_OPS = {
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.clone.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
}
# Ops that are skipped when looking for a root and not replayed: identities, and dtype casts
# (the FP8 cast replaces them, and casting the fp32 master value directly rounds only once).
TRANSPARENT_OPS = {aten.detach.default, aten.alias.default}
DTYPE_CASTS = {aten._to_copy.default, prims.convert_element_type.default}

# PyTorch's node-meta keys that say where a node comes from. A node that takes another's place (a
# GEMM rewritten, fused or grouped) inherits them all, to stay the same op to AOTAutograd, the
# partitioners and the report:
#   seq_nr, autograd_backward: its autograd op, and that it runs in backward (find_matmuls and
#     lower_patch_convs pair a forward op with its backward by seq_nr);
#   partitioner_tag: forward or backward, which the partitioners read;
#   nn_module_stack, fwd_nn_module_stack, source_fn_stack, stack_trace: the model's module and line
#     (policies resolve by module, the report cites the line).
# `val` is not copied: each node has its own fake value (add_node computes it). Nor is fp8fx's own
# key (fp8fx.passes.annotation.META_KEY): a GEMM's annotation changes as it moves, through `annotate`.
PROVENANCE_KEYS = (
    "seq_nr",
    "autograd_backward",
    "partitioner_tag",
    "nn_module_stack",
    "fwd_nn_module_stack",
    "source_fn_stack",
    "stack_trace",
)
# What a node added to serve another (a cast, view or scale of a GEMM's) takes of it: its partition
# side, module and line, not its autograd op (with the GEMM's seq_nr it would pass for the GEMM).
HELPER_KEYS = ("partitioner_tag", "stack_trace", "nn_module_stack", "fwd_nn_module_stack")


@dataclass
class PassResult:
    graph_module: fx.GraphModule
    modified: bool


@dataclass(frozen=True)
class Taps:
    """Where the taps a pass inserts report to (`fp8fx.ops.taps` handler ids); None: none of that kind."""

    monitor: int | None = None  # fp8fx.runtime.monitor.Monitor: every cast's input and scale
    shadow: int | None = None  # fp8fx.runtime.shadow.ShadowChecks: FP8 GEMM results against high precision
    numerics: Any = None  # fp8fx.runtime.numerics.NumericsCollector: every GEMM's operands, for analysis
    graph_index: int = 0  # the graph being rewritten: probes are reported per graph, site and role


@dataclass(frozen=True)
class DelayedInputs:
    """Delayed scaling's graph input: the handle `fp8fx::delayed_scales` and `delayed_scale_steps`
    find the states by (`fp8fx.ops.delayed`), and the process group (name) each amax is reduced
    over (None: one process)."""

    handle: fx.Node
    amax_group: str | None = None


@dataclass(kw_only=True)
class PassContext:
    """What the passes of one graph are given, and what they hand on to each other."""

    # Given: the backend's options (policy, code generation, what backward reads; passed whole);
    # the GEMMs shadow checks switched to high precision ((site, role) -> reason); which graph
    # inputs hold parameters (positions among the placeholders other than tangents; None: an input
    # whose value requires grad is one, see find_matmuls.parameter_derived); where taps report.
    options: BackendOptions
    overrides: dict = field(default_factory=dict)
    param_inputs: frozenset[int] | None = None
    taps: Taps = Taps()
    # Delayed scaling's handle input; without it (ONNX export) the casts are made with dynamic scales
    # and only the states' keys are recorded.
    delayed: DelayedInputs | None = None
    # An inference graph (compiled without autograd: evaluation): delayed scaling reads its states
    # and updates them only when the policy calibrates.
    inference: bool = False
    # Handed on: the sites find_matmuls found, the GEMM nodes lower_patch_convs made (node -> the
    # op kind it was lowered from), the GEMMs prefer_bf16 measured slower in FP8 than in BF16
    # ((site, role) -> fp8fx.codegen.dispatch.Timing), and the delayed states insert_casts used
    # (key -> history length).
    sites: list = field(default_factory=list)
    lowered: dict = field(default_factory=dict)
    bf16_faster: dict = field(default_factory=dict)
    delayed_states: dict[str, int] = field(default_factory=dict)


def _is_dtype_cast(node: fx.Node) -> bool:
    if node.target not in DTYPE_CASTS:
        return False
    src, out = node.args[0], node.meta.get("val")
    if not isinstance(src, fx.Node) or not isinstance(out, torch.Tensor):
        return False
    # A copy that also moves the tensor to another device is not a plain dtype cast.
    return src.meta["val"].device == out.device and out.dtype.is_floating_point


def strip_layout(node: fx.Node, dtype_casts: bool = True) -> tuple[fx.Node, list[fx.Node]]:
    """Follow layout ops, identities and (unless `dtype_casts` is False) dtype casts back to the
    producing node.

    Returns (root, chain): `chain` lists the layout ops to replay on a tensor derived from the root,
    innermost first."""
    chain: list[fx.Node] = []
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target in LAYOUT_OPS:
            chain.append(node)
        elif node.target not in TRANSPARENT_OPS and not (dtype_casts and _is_dtype_cast(node)):
            break
        node = node.args[0]
    return node, chain[::-1]


def views_key(root: fx.Node, chain: list[fx.Node]) -> tuple:
    """`root` and the views `chain` takes of it, comparable across nodes: operands with equal keys
    are one tensor read alike."""
    return root, tuple((v.target, repr(v.args[1:]), repr(v.kwargs)) for v in chain)


def op_args(node: fx.Node) -> dict[str, Any]:
    """A call's arguments by their names in the operator's schema, positional and keyword alike."""
    named = {arg.name: value for arg, value in zip(node.target._schema.arguments, node.args)}
    return {**named, **node.kwargs}


def fake_mode_of(graph: fx.Graph):
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        raise RuntimeError("fp8fx: graph placeholders carry no fake tensors (meta['val']); cannot rewrite")
    return mode


def reads_state(node: fx.Node) -> bool:
    """Whether `node` is a delayed-scaling state's scale (or its inverse) as a graph reads it: an
    element of `fp8fx::delayed_scales`' values (`insert_casts`)."""
    return node.target is operator.getitem and node.args[0].target is torch.ops.fp8fx.delayed_scales.default


def is_backward(node: fx.Node) -> bool:
    """Whether a joint graph's `node` computes backward (AOTAutograd's tags)."""
    return node.meta.get("partitioner_tag") == "is_backward" or bool(node.meta.get("autograd_backward"))


def node_values(arg: Any) -> Any:
    """`arg` with every node replaced by its fake value (`meta["val"]`), through lists, tuples and dicts."""
    if isinstance(arg, fx.Node):
        return arg.meta["val"]
    if isinstance(arg, (list, tuple)):
        return type(arg)(node_values(a) for a in arg)
    if isinstance(arg, dict):
        return {k: node_values(v) for k, v in arg.items()}
    return arg


def copy_meta(src: fx.Node, dst: fx.Node, keys: tuple[str, ...] = PROVENANCE_KEYS) -> None:
    """Give `dst` the entries of `src`'s meta under `keys` that `src` has."""
    dst.meta.update({key: src.meta[key] for key in keys if key in src.meta})


def add_node(graph: fx.Graph, fake_mode, target, args: tuple, kwargs: dict | None = None, *, tag_from: fx.Node) -> fx.Node:
    """Insert `target(*args)` at the graph's current insertion point with a valid `meta["val"]`.

    The node takes the partitioner tag (forward / backward), source and module of `tag_from`,
    the node it serves (`HELPER_KEYS`)."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    with fake_mode:
        node.meta["val"] = target(*node_values(args), **node_values(kwargs))
    copy_meta(tag_from, node, HELPER_KEYS)
    return node


def k_contiguous(val: torch.Tensor, side: int) -> bool:
    """Whether a 2-D GEMM operand is laid out as the tensor cores read it: K-contiguous (the left
    operand, side 0, row-major; the right one column-major). A symbolic stride counts as not,
    unless it is provably 1 (and adds no guard)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true((val.stride(-1) if side == 0 else val.stride(-2)) == 1)


def _call_signature(node: fx.Node) -> tuple | None:
    """What a decomposition's trace depends on: the op, its constant arguments, and which input
    (by position) with what static shape, strides and dtype each tensor argument is. None where a
    size is symbolic or an argument is not a plain value."""

    def sig(a):
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in (*val.shape, *val.stride())):
                raise TypeError
            return ("input", inputs.index(a), tuple(val.shape), val.stride(), val.dtype, val.device.type)
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, *map(sig, a))
        if isinstance(a, dict):
            return ("dict", *((k, sig(v)) for k, v in sorted(a.items())))
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device)):
            return (type(a).__name__, a)
        raise TypeError

    inputs = node.all_input_nodes
    try:
        return (node.target, sig(node.args), sig(node.kwargs))
    except TypeError:
        return None


def decompose_nodes(graph: fx.Graph, decompositions: dict, also: dict | None = None, meta: dict | None = None, where=None) -> int:
    """Replace each call of an op in `decompositions` by its decomposition, in place (what it
    decomposes to is traced with Inductor's table too, and with `also`: the entries a compile took
    out of that table). `meta` maps a node to entries every node of its decomposition gets.

    Returns how many nodes were replaced; a node whose decomposition declines (returns
    NotImplemented for its shapes) stays. The subgraphs are traced on the nodes' fake values, so
    every new node carries `meta["val"]`. `where(node)`, if given, picks the nodes to replace."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.func import functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target in decompositions and (where is None or where(n))]
    if not nodes:
        return 0
    fake_mode = fake_mode_of(graph)
    table = {**select_decomp_table(), **(also or {}), **decompositions}
    # Tracing is most of the time a compile spends here; calls that differ only in which nodes they
    # read (a model's layers) share one trace, copied with fresh fake values.
    traces: dict[tuple, fx.GraphModule | None] = {}
    replaced = 0
    for node in nodes:
        tensor_args = node.all_input_nodes
        key = _call_signature(node)
        if key is None or key not in traces:

            def fn(*tensors, _node=node, _inputs=tensor_args, _decompose=table[node.target]):
                values = dict(zip(_inputs, tensors))
                return _decompose(*fx.node.map_arg(_node.args, values.get), **fx.node.map_arg(_node.kwargs, values.get))

            with fake_mode:
                declined = table[node.target](*node_values(node.args), **node_values(node.kwargs)) is NotImplemented
                # The decomposition itself is traced (not the op, which functionalization would
                # pass through whole), functionalized: it may update its own temporaries in place.
                trace = (
                    None
                    if declined
                    else make_fx(functionalize(fn, remove="mutations"), decomposition_table=table)(
                        *[a.meta["val"] for a in tensor_args]
                    )
                )
            if key is not None:
                traces[key] = trace
            reused = False
        else:
            trace, reused = traces[key], True
        if trace is None:
            continue
        placeholders = [n for n in trace.graph.nodes if n.op == "placeholder"]
        before = set(graph.nodes)
        with graph.inserting_before(node):
            out = graph.graph_copy(trace.graph, dict(zip(placeholders, tensor_args)), return_output_node=False)
        added = [n for n in graph.nodes if n not in before]
        for new in added:  # the partitioners read the forward / backward tag
            if reused and new.op == "call_function":  # each node its own fake value, as if traced here
                with fake_mode:
                    new.meta["val"] = new.target(*node_values(new.args), **node_values(new.kwargs))
            # An op lowered for Inductor needs only its side (the partitioners read it) and line
            # (Inductor's provenance tracking cites it): modules were resolved before lowering.
            copy_meta(node, new, ("partitioner_tag", "stack_trace"))
            new.meta.update((meta or {}).get(node, {}))
        if isinstance(out, (tuple, list)):  # a multi-output op: its getitems become the outputs themselves
            for user in [u for u in node.users if u.target is operator.getitem]:
                user.replace_all_uses_with(out[user.args[1]])
                graph.erase_node(user)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        # What the decomposition computes that nothing reads (a GEMM's empty aux and amax outputs):
        # Inductor would lower each one.
        for new in reversed(added):
            if new.op == "call_function" and not new.users and not new.is_impure():
                graph.erase_node(new)
        replaced += 1
    return replaced
