"""find_matmuls: annotate every matrix product of an ATen graph as a `MatmulSite`.

Fused attention kernels (SDPA) hold matrix products too; they become sites of op kind `sdpa`,
so the report accounts for their FLOPs even though they stay in high precision. Grouped GEMMs
(mixture-of-experts layers: `aten._grouped_mm`, and transformers' grouped-mm custom op and its
backward, which computes both gradients in one call) are sites of op kind `grouped_mm` with the
number of groups their offsets give. So do the matrix
products fp8fx cannot rewrite (`fp8fx.core.patterns.OPAQUE`, custom ops that look like one: see `is_opaque`):
their sites are `opaque` and stay high, with the FLOPs their shapes tell where they tell any.

Works on the joint forward+backward graph of training and on inference graphs alike. Forward
GEMMs (the patterns of `fp8fx.core.patterns`, attention, opaque ops) open a site named by module FQN; backward GEMMs are
linked to their forward site through `seq_nr` (autograd's sequence number, shared by a forward op
and the backward ops it produces) and given their role by operand identity. The forward operand
computed from parameters alone (`parameter_derived`) is the site's weight, on either side
(`x @ W.t()`, `torch.bmm(W, x)`); when both or neither are (attention's `q @ k.T`, a product of
two parameters), the right one is taken for the weight, as positions would. A backward GEMM that
consumes the weight computes grad_input (the gradient of the other operand), one that consumes
the other operand computes grad_weight. `aten.addbmm` (bias plus the sum of a batch of products)
is a site whose forward GEMM stays high and whose backward GEMMs are plain bmms.

Convolutions are sites of op kind `conv`, kept high: `aten.convolution` is the forward GEMM, and
the one `aten.convolution_backward` linked to it by `seq_nr` holds a `grad_input` and a
`grad_weight` GEMM when its output mask asks for them. Their dimensions are the implicit-GEMM view
of the convolution (see `_conv_dims`), so FLOPs count as for any GEMM.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._ops import OpOverload

from fp8fx.core.patterns import BY_TARGET, GROUPED, OPAQUE, GemmPattern
from fp8fx.passes.graph_utils import PassContext, PassResult, op_args, strip_layout

aten = torch.ops.aten

# Custom ops whose products are known: the ATen op each one computes like (its arguments in the
# same places), and ops computing both gradients of such a forward op at once, from (input,
# weight, offsets, grad_output). transformers runs its MoE experts through them when
# torch._grouped_mm cannot run (compiled with weights other than bf16, transformers.integrations.moe).
_CUSTOM_LIKE = {"transformers::grouped_mm_fallback": aten._grouped_mm.default}
_CUSTOM_BACKWARD = {"transformers::grouped_mm_fallback_backward"}
BACKWARD_OFFSETS = 2  # the offsets' position among a fused backward's arguments
_NOT_CUSTOM = ("aten", "prims", "fp8fx")  # namespaces of ops fp8fx knows (or made)
# Convolutions: the forward op and the one computing its gradients (grad_input, grad_weight and
# grad_bias as its output_mask asks) with its arguments shifted by one (grad_output comes first).
CONV_OPS = {aten.convolution.default: 0, aten.convolution_backward.default: 1}


def is_attention(node: fx.Node) -> bool:
    """A fused attention kernel (SDPA's flash / efficient / cudnn / CPU variants, and backward)."""
    packet = getattr(node.target, "overloadpacket", None)
    return node.op == "call_function" and packet is not None and packet.__name__.startswith("_scaled_dot_product")


def is_conv(node: fx.Node) -> bool:
    """A convolution or its backward (see `CONV_OPS`)."""
    return node.op == "call_function" and node.target in CONV_OPS


@dataclass(frozen=True)
class ConvParams:
    """The arguments of a convolution (or its backward) that tell its GEMM and its form."""

    input: torch.Tensor
    weight: torch.Tensor
    stride: tuple
    padding: tuple
    dilation: tuple
    transposed: bool
    groups: int
    output: torch.Tensor | None  # the forward result; None for a backward op

    @property
    def kernel(self) -> tuple:
        return tuple(self.weight.shape[2:])

    @property
    def in_channels(self) -> int:
        return self.weight.shape[0] if self.transposed else self.weight.shape[1] * self.groups


def conv_params(node: fx.Node) -> ConvParams:
    shift = CONV_OPS[node.target]
    # (input, weight, bias or bias_sizes, stride, padding, dilation, transposed, output_padding, groups)
    inp, weight, _, stride, padding, dilation, transposed, _, groups = node.args[shift : shift + 9]
    return ConvParams(
        _tensor(inp),
        _tensor(weight),
        tuple(stride),
        tuple(padding),
        tuple(dilation),
        bool(transposed),
        groups,
        None if shift else _tensor(node),
    )


def _conv_dims(node: fx.Node, p: ConvParams) -> tuple:
    """(M, N, K, groups) of a convolution as an implicit GEMM per group: M = batch * output
    positions, N = output channels / groups, K = input channels / groups * kernel taps, so its
    FLOPs are 2 * batch * C_out * output positions * C_in / groups * kernel taps. A transposed
    convolution sums over its input positions instead (it is the gradient of a convolution)."""
    grad_output = _tensor(node.args[0]) if CONV_OPS[node.target] else p.output
    positions = p.input if p.transposed else grad_output  # the side whose positions the sum runs over
    w = p.weight.shape
    n, k = (w[1], w[0] // p.groups) if p.transposed else (w[0] // p.groups, w[1])
    return positions.shape[0] * math.prod(positions.shape[2:]), n, k * math.prod(p.kernel), p.groups


def _conv_gemms(node: fx.Node) -> dict[str, Gemm]:
    """The forward GEMM of a convolution, or the gradients a convolution_backward computes: the
    forward's GEMM transposed (grad_input: M x N @ N x K, grad_weight: K x M @ M x N)."""
    m, n, k, groups = _conv_dims(node, conv_params(node))
    if node.target is aten.convolution.default:
        return {"output": Gemm(node, "output", m, n, k, groups)}
    mask = node.args[10]
    gemms = {"grad_input": Gemm(node, "grad_input", m, k, n, groups), "grad_weight": Gemm(node, "grad_weight", k, n, m, groups)}
    return {role: gemm for i, (role, gemm) in enumerate(gemms.items()) if mask[i]}


def _is_attention_backward(node: fx.Node) -> bool:
    return node.target.overloadpacket.__name__.endswith("_backward")


def _tensor(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _matrix_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor arguments of rank >= 2, in order (tensor lists are not looked into)."""
    return [a for a in (*node.args, *node.kwargs.values()) if (t := _tensor(a)) is not None and t.dim() >= 2]


def _outputs(node: fx.Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    return [v for v in (val if isinstance(val, (list, tuple)) else [val]) if isinstance(v, torch.Tensor)]


def custom_op_name(node: fx.Node) -> str | None:
    """`namespace::name` of a call to an operator outside ATen, prims and fp8fx."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload) or target.namespace in _NOT_CUSTOM:
        return None
    return target.name()


def fused_backward(node: fx.Node) -> bool:
    """A custom op that computes grad_input and grad_weight in one call (see `_CUSTOM_BACKWARD`)."""
    return custom_op_name(node) in _CUSTOM_BACKWARD


def grouped(node: fx.Node) -> bool:
    """A grouped GEMM, whose FLOPs assume its data-dependent offsets cover every row."""
    return _CUSTOM_LIKE.get(custom_op_name(node), node.target) in GROUPED or fused_backward(node)


def pattern_of(node: fx.Node) -> GemmPattern | None:
    """The GEMM pattern a node computes (a custom op of `_CUSTOM_LIKE` as its ATen op)."""
    if node.op != "call_function":
        return None
    return BY_TARGET.get(_CUSTOM_LIKE.get(custom_op_name(node), node.target))


def group_offsets(node: fx.Node) -> fx.Node | None:
    """The group offsets of a grouped GEMM node (a fused backward's too); None for other nodes."""
    if fused_backward(node):
        return node.args[BACKWARD_OFFSETS]
    pattern = pattern_of(node)
    if pattern is None or pattern.offsets is None:
        return None
    return op_args(node).get("offs")


def describe_call(node: fx.Node) -> str:
    """`aten._grouped_mm(bfloat16[16, 32], ...) -> bfloat16[16, 64]`, or `custom op ns::name(...) -> ...`."""

    def shape(t: torch.Tensor) -> str:
        return f"{str(t.dtype).removeprefix('torch.')}[{', '.join(str(d) for d in t.shape)}]"

    name = custom_op_name(node)
    op = f"custom op {name}" if name else f"aten.{node.target.overloadpacket.__name__}"
    args = ", ".join(shape(t) for a in (*node.args, *node.kwargs.values()) if (t := _tensor(a)) is not None)
    return f"{op}({args}) -> {', '.join(shape(t) for t in _outputs(node))}"


def is_opaque(node: fx.Node) -> bool:
    """A matrix product fp8fx cannot rewrite: an op of `OPAQUE`, or a custom operator (not in
    aten, prims or fp8fx) that takes at least two tensors of rank >= 2 and returns a floating-point
    tensor of rank >= 2 that not all of them broadcast to. That last condition leaves out ops shaped
    like elementwise ones (fused norms, activations, residual adds), which shapes cannot tell apart
    from a product of square matrices or a self-attention whose q, k, v and output share a shape:
    those are not reported."""
    if node.op != "call_function":
        return False
    if node.target in OPAQUE:
        return True
    if custom_op_name(node) is None or pattern_of(node) is not None or fused_backward(node):
        return False
    matrices = [_tensor(a) for a in _matrix_args(node)]
    out = next((o for o in _outputs(node) if o.dtype.is_floating_point and o.dim() >= 2), None)
    if len(matrices) < 2 or out is None:
        return False
    return any(_broadcast_shape(m.shape, out.shape) != tuple(out.shape) for m in matrices)


def _broadcast_shape(a: torch.Size, b: torch.Size) -> tuple | None:
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


def is_matrix_product(node: fx.Node) -> bool:
    """A node that becomes a site: a GEMM pattern, fused attention, an opaque product or a convolution."""
    return node.op == "call_function" and (
        pattern_of(node) is not None or fused_backward(node) or is_attention(node) or is_opaque(node) or is_conv(node)
    )


def matmul_operands(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    """(left, right, added term) of a matmul node; for an opaque op, its first two operands."""
    pattern = pattern_of(node)
    if pattern is not None:
        return node.args[pattern.left], node.args[pattern.right], node.args[pattern.added] if pattern.added is not None else None
    if node.target in OPAQUE:
        i = OPAQUE[node.target]
        return node.args[i], node.args[i + 1], None
    if custom_op_name(node) is not None:
        left, right = _matrix_args(node)[:2]
        return left, right, None
    return node.args[0], node.args[1], None


@dataclass
class Gemm:
    """One GEMM of a site: its node, role and dimensions (left M x K, right K x N, `batch` of them;
    None when the op's shapes do not tell them)."""

    node: fx.Node
    role: str  # output | grad_input | grad_weight
    m: int | torch.SymInt | None
    n: int | torch.SymInt | None
    k: int | torch.SymInt | None
    batch: int | torch.SymInt | None = 1
    count: int = 1  # GEMMs of these dimensions the op performs (fused attention: 2 forward, 4 backward)
    groups: int | torch.SymInt | None = None  # a grouped GEMM's number of groups

    @property
    def backward(self) -> bool:
        return self.role != "output"

    @property
    def flops_known(self) -> bool:
        return all(isinstance(d, int) for d in (self.m, self.n, self.k, self.batch))

    @property
    def flops_hinted(self) -> bool:
        """Whether a dimension is symbolic (a dynamic-shape compile) and `flops` counts its hint: the
        size of the example the graph was compiled for."""
        dims = (self.m, self.n, self.k, self.batch)
        return not self.flops_known and all(dim_hint(d) is not None for d in dims)

    @property
    def flops(self) -> int:
        """2 * M * N * K * batch, from the compile's shape hints where a dimension is symbolic; 0
        when a dimension is unknown or has no hint (data-dependent)."""
        dims = [dim_hint(d) for d in (self.m, self.n, self.k, self.batch)]
        if any(d is None for d in dims):
            return 0
        m, n, k, batch = dims
        return 2 * m * n * k * batch * self.count


def dim_hint(d) -> int | None:
    """A dimension's value, or a symbolic one's hint (None without: unknown or data-dependent)."""
    if isinstance(d, int):
        return d
    if isinstance(d, torch.SymInt) and d.node.has_hint():
        return int(d.node.hint)
    return None


@dataclass
class MatmulSite:
    """A matrix product of the model and its (up to three) GEMMs."""

    name: str
    fqn: str
    op: str  # a pattern kind (fp8fx.core.patterns), "sdpa", "conv", or an opaque op's name ("_grouped_mm", "ns::name")
    gemms: dict[str, Gemm] = field(default_factory=dict)
    source: str = ""  # "file:line" of the user's code
    opaque: bool = False  # a matrix product fp8fx cannot rewrite (see is_opaque)
    weight_operand: int = 1  # the forward operand (0: left, 1: right) that is the weight (see _weight_operand)

    @property
    def forward(self) -> Gemm | None:
        return self.gemms.get("output")

    @property
    def names(self) -> tuple[str, ...]:
        """What policy rules match against: the site name and its module FQN."""
        return (self.name, self.fqn) if self.fqn != self.name else (self.name,)


def module_fqn(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # Dynamo writes "L['self'].layers[0].mlp", "L['fn']._modules['0']" or, for a model passed
    # through a wrapper's *args, "L['args'][0].lm_head": make it a plain FQN.
    path = re.sub(r"^L\['[^']*'\](\[\d+\])?", "", path)
    path = path.replace("._modules['", ".").replace("['", ".").replace("']", "").replace("[", ".").replace("]", "")
    # A forward wrapped in a closure (torchtitan's parallelize, hooks that replace `forward`) is
    # reached through the bound method it holds: "attn.forward.__closure__.0.cell_contents.__self__"
    # is "attn" again.
    path = re.sub(r"\.\w+(\.__closure__\.\d+\.cell_contents)+\.__self__(?=\.|$)", "", "." + path)
    return path.strip(".")


def _source_line(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
    if not lines:
        return ""
    # 'File "/x/model.py", line 12, in forward'
    parts = lines[-1].split('"')
    if len(parts) < 3:
        return ""
    line = parts[2].split(",")[1].strip().removeprefix("line ").strip()
    return f"{parts[1]}:{line}"


def _dims(node: fx.Node) -> tuple:
    left, right, _ = matmul_operands(node)
    a, b = left.meta["val"], right.meta["val"]
    batch = a.shape[0] if a.dim() == 3 else 1
    return a.shape[-2], b.shape[-1], a.shape[-1], batch


def _opaque_dims(node: fx.Node) -> tuple:
    """(M, N, K, batch) of an opaque op from its left operand and its output (see `OPAQUE`)."""
    target = _CUSTOM_LIKE.get(custom_op_name(node), node.target)
    if target not in OPAQUE:
        return None, None, None, None
    left, right, _ = matmul_operands(node)
    a, b, out = _tensor(left), _tensor(right), _outputs(node)[0]
    k = a.shape[-1] if a.dim() else 1
    shape = tuple(out.shape)
    m, n = (shape + (1, 1))[:2] if len(shape) < 2 else shape[-2:]
    batch = 1 if target in GROUPED and a.dim() == b.dim() == 2 else math.prod(shape[:-2])
    return m, n, k, batch


def _custom_backward_gemms(node: fx.Node) -> dict[str, Gemm]:
    """Both GEMMs of an op in `_CUSTOM_BACKWARD`: grad_input (S x N @ N x K) and grad_weight
    (K x S @ S x N, split into groups along S)."""
    inp, grad_out = _tensor(node.args[0]), _tensor(node.args[3])
    s, k, n = inp.shape[0], inp.shape[1], grad_out.shape[-1]
    groups = _tensor(node.args[BACKWARD_OFFSETS]).shape[0]
    return {
        "grad_input": Gemm(node, "grad_input", s, k, n, groups=groups),
        "grad_weight": Gemm(node, "grad_weight", k, n, s, groups=groups),
    }


def _gemm(node: fx.Node, role: str) -> Gemm:
    if is_opaque(node):
        return Gemm(node, role, *_opaque_dims(node))
    if is_conv(node):
        return _conv_gemms(node)[role]
    if is_attention(node):  # q, k: [batch, heads, seq, head_dim]; backward takes grad_out first
        q, k = (node.args[1], node.args[2]) if _is_attention_backward(node) else (node.args[0], node.args[1])
        q, k = q.meta["val"], k.meta["val"]
        count = 4 if _is_attention_backward(node) else 2
        return Gemm(node, role, q.shape[-2], k.shape[-2], q.shape[-1], q.shape[:-2].numel(), count)
    m, n, k, batch = _dims(node)
    offs = group_offsets(node)
    return Gemm(node, role, m, n, k, batch, groups=_tensor(offs).shape[0] if offs is not None else None)


def find_matmuls(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """List every matrix product of the graph as a site with its GEMMs in `ctx.sites`."""
    forward: list[fx.Node] = []
    backward_by_seq: dict[int, list[fx.Node]] = defaultdict(list)
    unlinked: list[fx.Node] = []
    backward_nodes = _depends_on_tangents(gm.graph)
    weights = parameter_derived(gm.graph, ctx.param_inputs)
    for node in gm.graph.nodes:
        if not is_matrix_product(node):
            continue
        if is_conv(node) and not _conv_gemms(node):  # a convolution_backward computing grad_bias alone
            continue
        if node.meta.get("autograd_backward") or node in backward_nodes or (is_attention(node) and _is_attention_backward(node)):
            seq = node.meta.get("seq_nr")
            (backward_by_seq[seq] if seq is not None else unlinked).append(node)
        else:
            forward.append(node)

    # Site names: the module FQN when the module holds one matmul, else "fqn:op#i".
    per_module: dict[str, list[fx.Node]] = defaultdict(list)
    for node in forward:
        per_module[module_fqn(node)].append(node)

    sites: list[MatmulSite] = []
    for fqn, nodes in per_module.items():
        op_counts: dict[str, int] = defaultdict(int)
        for node in nodes:
            op = _op_kind(node, ctx.lowered)
            if len(nodes) == 1 and fqn:
                name = fqn
            else:
                name = f"{fqn or '<top>'}:{op}#{op_counts[op]}"
            op_counts[op] += 1
            site = MatmulSite(name, fqn, op, source=_source_line(node), opaque=is_opaque(node))
            site.weight_operand = _weight_operand(node, weights)
            site.gemms["output"] = _gemm(node, "output")
            seq = node.meta.get("seq_nr")
            for bw in backward_by_seq.pop(seq, []) if seq is not None else []:
                if fused_backward(bw) and not {"grad_input", "grad_weight"} & set(site.gemms):
                    site.gemms.update(_custom_backward_gemms(bw))
                    continue
                if is_conv(bw) or site.op == "conv":  # a convolution's gradients: one convolution_backward
                    if (
                        bw.target is aten.convolution_backward.default
                        and site.op == "conv"
                        and not {"grad_input", "grad_weight"} & set(site.gemms)
                    ):
                        site.gemms.update(_conv_gemms(bw))
                    else:
                        unlinked.append(bw)
                    continue
                role = _backward_role(node, bw, site)
                if role is None:
                    unlinked.append(bw)
                else:
                    site.gemms[role] = _gemm(bw, role)
            sites.append(site)

    # Backward GEMMs without a forward partner (custom autograd functions, ...): sites of their own.
    for nodes in backward_by_seq.values():
        unlinked.extend(nodes)
    for i, bw in enumerate(unlinked):
        fqn = module_fqn(bw)
        op = _op_kind(bw, ctx.lowered)
        site = MatmulSite(f"{fqn or '<top>'}:backward_{op}#{i}", fqn, op, source=_source_line(bw), opaque=is_opaque(bw))
        if fused_backward(bw):
            site.gemms.update(_custom_backward_gemms(bw))
        elif is_conv(bw):
            site.gemms.update(_conv_gemms(bw))
        else:
            site.gemms["grad_input"] = _gemm(bw, "grad_input")
        sites.append(site)

    ctx.sites = sites
    return PassResult(gm, modified=False)


def _op_kind(node: fx.Node, lowered: dict[fx.Node, str]) -> str:
    if is_attention(node):
        return "sdpa"
    if is_conv(node):
        return "conv"
    if node in lowered:  # a patch convolution as a GEMM (see lower_patch_convs)
        return lowered[node]
    if pattern_of(node) is not None:
        return pattern_of(node).kind
    if fused_backward(node):
        return BY_TARGET[GROUPED[0]].kind
    return custom_op_name(node) or node.target.overloadpacket.__name__


def _depends_on_tangents(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from the incoming gradients: the backward part of a joint graph. (Backward
    nodes of custom autograd Functions carry no `autograd_backward` meta, so look at data flow.)"""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and str(node.target).startswith("tangents")) or any(
            i in found for i in node.all_input_nodes
        ):
            found.add(node)
    return found


def _weight_operand(node: fx.Node, weights: set[fx.Node]) -> int:
    """0 when only the left operand of a forward matmul is computed from parameters, else 1."""
    if is_attention(node) or is_conv(node):
        return 1
    left, right, _ = matmul_operands(node)
    return 0 if left in weights and right not in weights else 1


# Ops that pick whole matrices out of a stack of them by index (an MoE layer's expert weights,
# `W[expert_ids]`): their result is the stack's matrices whatever computed the indices.
_MATRIX_PICKS = {aten.index.Tensor, aten.index_select.default}
_SCALARS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


def _picks_matrices(node: fx.Node) -> bool:
    source = _tensor(node.args[0])
    if source is None or source.dim() < 3:
        return False
    if node.target is aten.index.Tensor:
        return len(node.args[1]) == 1 and node.args[1][0] is not None
    return node.target is aten.index_select.default and node.args[1] in (0, -source.dim())


def parameter_stack_pick(x: fx.Node) -> bool:
    """Whether `x` is whole matrices picked by index from a stack of them (an MoE layer's expert
    weights, `W[expert_ids]`), up to layout ops."""
    root = strip_layout(x)[0]
    return isinstance(root, fx.Node) and root.op == "call_function" and root.target in _MATRIX_PICKS and _picks_matrices(root)


def parameter_derived(graph: fx.Graph, param_inputs: frozenset[int] | None = None) -> set[fx.Node]:
    """The nodes computed from parameters alone: parameter inputs, constants (`get_attr`: an
    exported module's parameters and buffers) and what ops make of them with no other tensor (a
    view, a transpose, a dtype copy, a weight assembled from several by `cat` or weight norm), and
    whole matrices picked from such a stack (`_MATRIX_PICKS`). An input is a parameter when its
    position among the inputs other than tangents is in `param_inputs`; without them, when its
    value requires grad (a frozen parameter is then data, and an input that requires grad a
    parameter: it makes everything computed from it ambiguous, so roles fall back to positions)."""
    derived: set[fx.Node] = set()
    data: set[fx.Node] = set()
    position = 0
    for node in graph.nodes:
        if node.op == "placeholder":
            if str(node.target).startswith("tangents"):
                data.add(node)
                continue
            if param_inputs is not None:
                param = position in param_inputs
            else:
                param = bool(getattr(node.meta.get("tensor_meta"), "requires_grad", False))
            (derived if param else data).add(node)
            position += 1
        elif node.op == "get_attr":
            derived.add(node)
        elif node.op == "call_function":
            tensors = [i for i in node.all_input_nodes if not isinstance(i.meta.get("val"), _SCALARS)]
            inputs = [node.args[0]] if _picks_matrices(node) else tensors
            if any(i in data for i in inputs):
                data.add(node)
            elif any(i in derived for i in inputs):
                derived.add(node)
    return derived


def _backward_role(fwd: fx.Node, bw: fx.Node, site: MatmulSite) -> str | None:
    if is_attention(fwd):  # one backward kernel computes dq, dk and dv
        return "grad_input" if is_attention(bw) and "grad_input" not in site.gemms else None
    operands = matmul_operands(fwd)[:2]
    weight_root = strip_layout(operands[site.weight_operand])[0]
    input_root = strip_layout(operands[1 - site.weight_operand])[0]
    bw_roots = {strip_layout(x)[0] for x in matmul_operands(bw)[:2]}
    candidates = []
    if weight_root in bw_roots:  # weight x gradient: the gradient of the other operand
        candidates.append("grad_input")
    if input_root in bw_roots:
        candidates.append("grad_weight")
    for role in candidates:  # x @ x: both roles fit; take the first one still free
        if role not in site.gemms:
            return role
    return None
