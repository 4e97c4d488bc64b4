"""verify: the rewritten graph is well formed and agrees with the decisions."""

from __future__ import annotations

import torch
from torch import fx

from fp8fx.core import grouped
from fp8fx.core.formats import fp8_format_of
from fp8fx.core.scaling import scale_shape
from fp8fx.passes.annotation import annotation, annotations, fp8_gemm_nodes
from fp8fx.passes.graph_utils import PassContext, PassResult, op_args


class VerifyError(RuntimeError):
    pass


def _returns_nothing(node: fx.Node) -> bool:
    """An op whose schema returns nothing (runtime asserts such as aten._assert_async): it has no
    value to record. Every op fp8fx inserts returns tensors, so its nodes are always checked."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and not schema.returns


def verify(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    gm.graph.lint()
    scaled = fp8_gemm_nodes(gm.graph)
    n_fp8 = sum(a.fp8 for a in annotations(gm.graph))
    if len(scaled) != n_fp8:
        raise VerifyError(f"{len(scaled)} FP8 GEMM nodes in the graph but {n_fp8} FP8 decisions")
    unannotated = [n.name for n in scaled if annotation(n) is None or not annotation(n).fp8]
    if unannotated:
        raise VerifyError(f"FP8 GEMM nodes without an FP8 annotation: {', '.join(unannotated)}")
    n_sites = sum(len(site.gemms) for site in ctx.sites)
    if len(annotations(gm.graph)) != n_sites:
        raise VerifyError(f"{len(annotations(gm.graph))} annotated GEMMs in the graph but find_matmuls found {n_sites}")
    for node in gm.graph.nodes:
        if "val" not in node.meta and node.op != "output" and not _returns_nothing(node):
            raise VerifyError(f"node without meta['val']: {node.format_node()}")
    for node in scaled:
        args = op_args(node)
        offs = args.get("offs")  # a grouped GEMM: scales per group (fp8fx.core.grouped)
        form = grouped.form_of(args["a"].meta["val"].dim(), args["b"].meta["val"].dim()) if offs is not None else None
        for side, (x, s, block) in enumerate(
            ((args["a"], args["scale_inv_a"], args["block_a"]), (args["b"], args["scale_inv_b"], args["block_b"]))
        ):
            try:
                fp8_format_of(x.meta["val"].dtype)
            except ValueError as e:
                raise VerifyError(f"{node.format_node()}: {e}") from None
            shape = x.meta["val"].shape
            if offs is None:
                expected = scale_shape(shape, tuple(block))
            else:
                expected = grouped.scale_shape(tuple(shape), offs.meta["val"].shape[0], grouped.operand_scales(form, side, block))
            if s.meta["val"].dtype != torch.float32 or tuple(s.meta["val"].shape) != tuple(expected):
                raise VerifyError(f"{node.format_node()}: scale_inv {s.name} is not fp32 of shape {tuple(expected)}")
    return PassResult(gm, modified=False)
