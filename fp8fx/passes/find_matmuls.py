"""find_matmuls: annotate every matrix product of an ATen graph as a `MatmulSite`.

Fused attention kernels (SDPA) hold matrix products too; they become sites of op kind `sdpa`,
so the report accounts for their FLOPs even though they stay in high precision.

Works on the joint forward+backward graph of training and on inference graphs alike. Forward
GEMMs (`mm`, `addmm`, `bmm`, `baddbmm`) open a site named by module FQN; backward GEMMs are
linked to their forward site through `seq_nr` (autograd's sequence number, shared by a forward op
and the backward ops it produces) and given their role by operand identity: a backward GEMM that
consumes the forward's right operand (the weight) computes grad_input, one that consumes the left
operand (the input) computes grad_weight.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import fx

from fp8fx.passes.graph_utils import META_KEY, PassContext, PassResult, strip_layout

aten = torch.ops.aten

MATMUL_OPS = {
    aten.mm.default: "mm",
    aten.addmm.default: "addmm",
    aten.bmm.default: "bmm",
    aten.baddbmm.default: "baddbmm",
}


def is_attention(node: fx.Node) -> bool:
    """A fused attention kernel (SDPA's flash / efficient / cudnn / CPU variants, and backward)."""
    packet = getattr(node.target, "overloadpacket", None)
    return node.op == "call_function" and packet is not None and packet.__name__.startswith("_scaled_dot_product")


def _is_attention_backward(node: fx.Node) -> bool:
    return node.target.overloadpacket.__name__.endswith("_backward")


def matmul_operands(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    """(left, right, added term) of a matmul node."""
    if node.target in (aten.addmm.default, aten.baddbmm.default):
        return node.args[1], node.args[2], node.args[0]
    return node.args[0], node.args[1], None


@dataclass
class Gemm:
    """One GEMM of a site: its node, role and dimensions (left M x K, right K x N, `batch` of them)."""

    node: fx.Node
    role: str  # output | grad_input | grad_weight
    m: int | torch.SymInt
    n: int | torch.SymInt
    k: int | torch.SymInt
    batch: int | torch.SymInt = 1
    count: int = 1  # GEMMs of these dimensions the op performs (fused attention: 2 forward, 4 backward)

    @property
    def backward(self) -> bool:
        return self.role != "output"

    @property
    def flops(self) -> int:
        dims = (self.m, self.n, self.k, self.batch)
        if not all(isinstance(d, int) for d in dims):
            return 0  # symbolic: counted at run time by later issues
        return 2 * self.m * self.n * self.k * self.batch * self.count


@dataclass
class MatmulSite:
    """A matrix product of the model and its (up to three) GEMMs."""

    name: str
    fqn: str
    op: str
    gemms: dict[str, Gemm] = field(default_factory=dict)
    source: str = ""  # "file:line" of the user's code

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
    # Dynamo writes "L['self'].layers[0].mlp" or "L['fn']._modules['0']": make it a plain FQN.
    path = re.sub(r"^L\['[^']*'\]", "", path)
    path = path.replace("._modules['", ".").replace("['", ".").replace("']", "").replace("[", ".").replace("]", "")
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


def _gemm(node: fx.Node, role: str) -> Gemm:
    if is_attention(node):  # q, k: [batch, heads, seq, head_dim]; backward takes grad_out first
        q, k = (node.args[1], node.args[2]) if _is_attention_backward(node) else (node.args[0], node.args[1])
        q, k = q.meta["val"], k.meta["val"]
        count = 4 if _is_attention_backward(node) else 2
        return Gemm(node, role, q.shape[-2], k.shape[-2], q.shape[-1], q.shape[:-2].numel(), count)
    m, n, k, batch = _dims(node)
    return Gemm(node, role, m, n, k, batch)


def find_matmuls(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Annotate every matmul with `meta["fp8fx"] = (site, role)` and list the sites in `ctx.sites`."""
    forward: list[fx.Node] = []
    backward_by_seq: dict[int, list[fx.Node]] = defaultdict(list)
    unlinked: list[fx.Node] = []
    backward_nodes = _depends_on_tangents(gm.graph)
    for node in gm.graph.nodes:
        if node.op != "call_function" or (node.target not in MATMUL_OPS and not is_attention(node)):
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
            op = _op_kind(node)
            if len(nodes) == 1 and fqn:
                name = fqn
            else:
                name = f"{fqn or '<top>'}:{op}#{op_counts[op]}"
            op_counts[op] += 1
            site = MatmulSite(name, fqn, op, source=_source_line(node))
            site.gemms["output"] = _gemm(node, "output")
            seq = node.meta.get("seq_nr")
            for bw in backward_by_seq.pop(seq, []) if seq is not None else []:
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
        op = _op_kind(bw)
        site = MatmulSite(f"{fqn or '<top>'}:backward_{op}#{i}", fqn, op, source=_source_line(bw))
        site.gemms["grad_input"] = _gemm(bw, "grad_input")
        sites.append(site)

    for site in sites:
        for role, gemm in site.gemms.items():
            gemm.node.meta[META_KEY] = {"site": site.name, "role": role}
    ctx.sites = sites
    return PassResult(gm, modified=False)


def _op_kind(node: fx.Node) -> str:
    return "sdpa" if is_attention(node) else MATMUL_OPS[node.target]


def _depends_on_tangents(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from the incoming gradients: the backward part of a joint graph. (Backward
    nodes of custom autograd Functions carry no `autograd_backward` meta, so look at data flow.)"""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and str(node.target).startswith("tangents")) or any(i in found for i in node.all_input_nodes):
            found.add(node)
    return found


def _backward_role(fwd: fx.Node, bw: fx.Node, site: MatmulSite) -> str | None:
    if is_attention(fwd):  # one backward kernel computes dq, dk and dv
        return "grad_input" if is_attention(bw) and "grad_input" not in site.gemms else None
    left, right, _ = matmul_operands(fwd)
    left_root, right_root = strip_layout(left)[0], strip_layout(right)[0]
    bw_roots = {strip_layout(x)[0] for x in matmul_operands(bw)[:2]}
    candidates = []
    if right_root in bw_roots:
        candidates.append("grad_input")
    if left_root in bw_roots:
        candidates.append("grad_weight")
    for role in candidates:  # x @ x: both roles fit; take the first one still free
        if role not in site.gemms:
            return role
    return None
