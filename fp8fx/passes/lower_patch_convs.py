"""lower_patch_convs: rewrite each convolution that is a matrix product into mm/addmm GEMMs.

A convolution whose kernel equals its stride, with no padding, dilation 1, one group, not
transposed and spatial sizes divisible by the kernel (a ViT patch embedding; 1-, 2- or 3-D)
multiplies disjoint patches by the weight: input [N, C, *S] -> patches [N * patches, C * taps]
-> `addmm(bias, patches, W.view(C_out, -1).permute(1, 0))` -> [N, C_out, *S / kernel]. Its
`convolution_backward` (linked by `seq_nr`) becomes grad_input = grad_out @ W (patches put back
in place), grad_weight = grad_out.t() @ patches and grad_bias = grad_out.sum(0), as its
output_mask asks. Only convolutions whose module's policy has op kind `conv_patch` in its ops
(or a rule with precision: fp8) are rewritten; find_matmuls reports their GEMMs as op kind
`conv_patch` (`meta["fp8fx"]["op"]`). Shapes must be static."""

from __future__ import annotations

import math

from torch import fx

from fp8fx.passes.find_matmuls import conv_params, module_fqn
from fp8fx.passes.graph_utils import PassContext, PassResult, add_node, aten, copy_meta, fake_mode_of

OP_KIND = "conv_patch"
# Beyond add_node's keys, each node takes the convolution's autograd op (find_matmuls pairs its
# forward and backward GEMMs by seq_nr), not its source_fn_stack: the nodes are views and mms, not
# the convolution call that names.
_CONV_KEYS = ("seq_nr", "autograd_backward")


def is_patch_conv(node: fx.Node) -> bool:
    """A convolution (or its backward) that is a matrix product of disjoint patches and the weight."""
    p = conv_params(node)
    if p.input is None or p.weight is None or p.transposed or p.groups != 1:
        return False
    spatial = p.input.shape[2:]
    if not all(isinstance(d, int) for d in (*p.input.shape, *p.weight.shape)):
        return False
    return (
        p.stride == p.kernel
        and not any(p.padding)
        and all(d == 1 for d in p.dilation)
        and all(s % k == 0 for s, k in zip(spatial, p.kernel))
    )


def _enabled(node: fx.Node, ctx: PassContext) -> bool:
    fqn = module_fqn(node)
    res = ctx.options.policy.resolve((fqn,), OP_KIND)
    return OP_KIND in res.settings.ops or res.forced_fp8


class _Builder:
    """Adds nodes before `at` that take the graph meta of `at` (and mark GEMMs as conv_patch)."""

    def __init__(self, graph: fx.Graph, at: fx.Node, lowered: dict[fx.Node, str]):
        self.graph, self.at, self.fake_mode, self.lowered = graph, at, fake_mode_of(graph), lowered

    def __call__(self, target, *args, gemm: bool = False) -> fx.Node:
        with self.graph.inserting_before(self.at):
            node = add_node(self.graph, self.fake_mode, target, args, tag_from=self.at)
        copy_meta(self.at, node, _CONV_KEYS)
        if gemm:
            self.lowered[node] = OP_KIND
        return node


def _patches(b: _Builder, x: fx.Node, kernel: tuple) -> fx.Node:
    """[N, C, *S] -> [N * prod(S / kernel), C * prod(kernel)]: one row per patch."""
    n, c, *spatial = x.meta["val"].shape
    d = len(kernel)
    split = [n, c, *(v for s, k in zip(spatial, kernel) for v in (s // k, k))]
    order = [0, *(2 + 2 * i for i in range(d)), 1, *(3 + 2 * i for i in range(d))]
    rows = n * math.prod(s // k for s, k in zip(spatial, kernel))
    return b(
        aten.reshape.default, b(aten.permute.default, b(aten.reshape.default, x, split), order), [rows, c * math.prod(kernel)]
    )


def _unpatch(b: _Builder, mat: fx.Node, shape: tuple, kernel: tuple) -> fx.Node:
    """The inverse of `_patches`: [N * patches, C * taps] -> [N, C, *S]."""
    n, c, *spatial = shape
    d = len(kernel)
    grid = [s // k for s, k in zip(spatial, kernel)]
    split = b(aten.reshape.default, mat, [n, *grid, c, *kernel])
    order = [0, d + 1, *(v for i in range(d) for v in (1 + i, d + 2 + i))]
    return b(aten.reshape.default, b(aten.permute.default, split, order), list(shape))


def _to_rows(b: _Builder, y: fx.Node) -> fx.Node:
    """[N, C_out, *P] -> [N * prod(P), C_out]."""
    n, c, *grid = y.meta["val"].shape
    d = len(grid)
    return b(aten.reshape.default, b(aten.permute.default, y, [0, *range(2, 2 + d), 1]), [n * math.prod(grid), c])


def _lower_forward(graph: fx.Graph, conv: fx.Node, lowered: dict[fx.Node, str]) -> None:
    x, w, bias = conv.args[:3]
    kernel = conv_params(conv).kernel
    b = _Builder(graph, conv, lowered)
    patches = _patches(b, x, kernel)
    w_t = b(aten.permute.default, b(aten.reshape.default, w, [w.meta["val"].shape[0], -1]), [1, 0])
    out = (
        b(aten.addmm.default, bias, patches, w_t, gemm=True) if bias is not None else b(aten.mm.default, patches, w_t, gemm=True)
    )
    n, c_out, *grid = conv.meta["val"].shape
    d = len(grid)
    y = b(aten.permute.default, b(aten.reshape.default, out, [n, *grid, c_out]), [0, d + 1, *range(1, d + 1)])
    conv.replace_all_uses_with(y)
    graph.erase_node(conv)


def _lower_backward(graph: fx.Graph, bw: fx.Node, lowered: dict[fx.Node, str]) -> None:
    grad_out, x, w = bw.args[:3]
    mask = bw.args[10]
    kernel = conv_params(bw).kernel
    b = _Builder(graph, bw, lowered)
    g = _to_rows(b, grad_out)
    w_shape = list(w.meta["val"].shape)
    results = [None, None, None]
    if mask[0]:
        w_mat = b(aten.reshape.default, w, [w_shape[0], -1])
        results[0] = _unpatch(b, b(aten.mm.default, g, w_mat, gemm=True), tuple(x.meta["val"].shape), kernel)
    if mask[1]:
        results[1] = b(
            aten.reshape.default,
            b(aten.mm.default, b(aten.permute.default, g, [1, 0]), _patches(b, x, kernel), gemm=True),
            w_shape,
        )
    if mask[2]:
        results[2] = b(aten.sum.dim_IntList, g, [0])
    for user in list(bw.users):
        if user.op != "call_function" or user.target.__name__ != "getitem" or results[user.args[1]] is None:
            raise RuntimeError(f"{bw.name}: convolution_backward result used as {user.format_node()}; cannot lower it")
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(bw)


def lower_patch_convs(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite the patch convolutions (see `is_patch_conv`) the policy enables, and their backward, into GEMMs."""
    graph = gm.graph
    convs = [
        n
        for n in graph.nodes
        if n.op == "call_function" and n.target is aten.convolution.default and is_patch_conv(n) and _enabled(n, ctx)
    ]
    seqs = {c.meta["seq_nr"] for c in convs if c.meta.get("seq_nr") is not None}
    backward = [
        n
        for n in graph.nodes
        if n.op == "call_function"
        and n.target is aten.convolution_backward.default
        and n.meta.get("seq_nr") in seqs
        and is_patch_conv(n)
    ]
    for node in convs:
        _lower_forward(graph, node, ctx.lowered)
    for node in backward:
        _lower_backward(graph, node, ctx.lowered)
    if not convs:
        return PassResult(gm, modified=False)
    graph.lint()
    gm.recompile()
    return PassResult(gm, modified=True)
