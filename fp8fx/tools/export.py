"""Export to standard ONNX FP8: QuantizeLinear / DequantizeLinear around the GEMMs the policy puts
in FP8, checked in onnxruntime before the file is written.

The same passes that compile a model (find_matmuls, assign_precision) run on the model's
`torch.export` graph. For each FP8 GEMM:

- the activation (left operand) gets a static per-tensor QuantizeLinear -> DequantizeLinear pair,
  its scale from the amax the exported graph produces on calibration batches, or from the
  model's delayed-scaling state when it has one for that operand;
- the weight (right operand, a parameter) is stored as an FP8 initializer in the K x N layout the
  GEMM reads, with its scales as the policy says: one (tensorwise), one per output channel
  (rowwise, `axis`), one per 128 x 128 block (blockwise: opset 21's `block_size` along K, the
  block scale repeated over the block's columns), or one per 32 elements along K (mx: the E8M0
  powers of two, stored in the GEMM's float type), followed by DequantizeLinear. ONNX's FLOAT8E8M0
  scales need DequantizeLinear-24, which onnxruntime (1.32) cannot run, and every export is
  checked in onnxruntime. MX activations are quantized per block as they are computed, which no
  ONNX op does: they get the static per-tensor pair below, as blockwise ones do.

Scales are stored in the GEMM's dtype (float32, float16 or bfloat16: QuantizeLinear takes its
input's type, DequantizeLinear returns its scale's), rounded up to it so that quantizing with them
never saturates. Opsets 19 and 20 get opset 19's QuantizeLinear / DequantizeLinear (no blockwise).

GEMMs kept high stay plain float ops; no custom-domain op is emitted; Relu and Clip are written
as Max/Min (onnxruntime's optimiser drops a Relu before an FP8 QuantizeLinear). Before the file is
written, onnx's full checker and strict shape inference run, onnxruntime executes it with its
default session options (all graph optimisations, as a deployment runs it) on the example inputs,
and its outputs must match fp8fx's CPU emulation of the same graph to float rounding; the SQNR
against the original model is reported.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, fx, nn

from fp8fx.compiler.state import state_for
from fp8fx.core.formats import Fp8Format
from fp8fx.core.patterns import BY_KIND
from fp8fx.core.policy import Policy
from fp8fx.core.recipes import Granularity
from fp8fx.ops import reference
from fp8fx.passes.annotation import annotation, state_key
from fp8fx.passes.assign_precision import assign_precision
from fp8fx.passes.find_matmuls import find_matmuls, matmul_operands
from fp8fx.passes.graph_utils import LAYOUT_OPS, PassContext, strip_layout
from fp8fx.passes.options import BackendOptions
from fp8fx.runtime.numerics import sqnr_db
from fp8fx.tools.analyze import error_summary

BLOCKED_OPSET = 21  # DequantizeLinear's block_size (blockwise scales)
MIN_OPSET = 19  # FLOAT8 types in QuantizeLinear / DequantizeLinear
DYNAMIC_DIMS = {"batch": 0, "seq": 1}
ONNX_DTYPES = {Fp8Format.E4M3: 17, Fp8Format.E5M2: 19}  # TensorProto.FLOAT8E4M3FN / FLOAT8E5M2
HALF_FLOOR_DB, HALF_MARGIN_DB = 40.0, 1.0  # float16 outputs: SQNR against the original model, see _check
# A deprecation torch.export's own code triggers (deep-copying a tree spec); nothing a caller can change.
TORCH_INTERNAL_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


class ExportError(Exception):
    """The model cannot be exported as asked; nothing was written."""


@dataclass
class SiteExport:
    site: str
    precision: str
    onnx_nodes: list[str] = field(default_factory=list)  # the ONNX nodes the site's GEMM became


@dataclass
class ExportResult:
    path: Path
    opset: int
    sites: list[SiteExport]
    quantize_nodes: int
    dequantize_nodes: int
    fp8_weights: int  # FP8 initializers holding weights
    verified: bool
    max_abs_diff_vs_emulation: float | None  # onnxruntime vs fp8fx's CPU emulation
    sqnr_vs_original_db: float | None  # onnxruntime vs the original (high-precision) model


# ----------------------------------------------------------------------------- ops in the graph
# fp8fx::export_qdq and fp8fx::export_dequantize (fp8fx.ops.export), as ONNX.


def _onnx_translations(opset: int) -> dict:
    import onnx
    from onnxscript import opset19, opset21

    op = opset21 if opset >= BLOCKED_OPSET else opset19  # the exporter converts up, never down

    def zero_point(fmt: str):
        return op.Constant(value=onnx.helper.make_tensor("zero_point", ONNX_DTYPES[Fp8Format(fmt)], [], [0.0]))

    def qdq(x, scale_inv, fmt: str):
        return op.DequantizeLinear(op.QuantizeLinear(x, scale_inv, zero_point(fmt)), scale_inv)

    def dequantize(w, scale_inv, axis: int, block_size: int):
        if block_size:
            return op.DequantizeLinear(w, scale_inv, axis=axis, block_size=block_size)
        return op.DequantizeLinear(w, scale_inv, axis=axis)

    return {torch.ops.fp8fx.export_qdq.default: qdq, torch.ops.fp8fx.export_dequantize.default: dequantize}


# ----------------------------------------------------------------------------- the rewrite


def _weight_view(gm: fx.GraphModule, right: fx.Node, site: str) -> Tensor:
    """The GEMM's right operand (K x N) computed from its parameter."""
    root, chain = strip_layout(right)
    if root.op != "get_attr":
        raise ExportError(
            f"site {site}: the right operand of an FP8 GEMM must be a parameter for export (found "
            f"{root.format_node()}); keep the site high with a policy rule"
        )
    value = gm
    for name in root.target.split("."):  # a parameter, buffer or constant (tied weights have several names)
        value = getattr(value, name)
    for view in chain:
        value = view.target(value, *view.args[1:], **view.kwargs)
    return value.detach().to(torch.float32)


def _rounded_up(scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    """`scale_inv` in `dtype`, rounded up: quantizing with it never saturates, and it is never 0."""
    rounded = scale_inv.to(dtype)
    return torch.where(rounded.float() < scale_inv, torch.nextafter(rounded, torch.tensor(torch.inf, dtype=dtype)), rounded)


def _quantized_weight(w: Tensor, decision, dtype: torch.dtype, opset: int, site: str) -> tuple[Tensor, Tensor, int, int]:
    """(FP8 K x N weight, scale_inv in `dtype`, axis, block_size) for DequantizeLinear."""
    fmt, block = decision.formats[1], list(decision.blocks[1])
    scale = reference.amax_to_scale(reference.amax(w, block), fmt.max, decision.margin, decision.power_of_two)
    scale_inv = _rounded_up(scale.reciprocal(), dtype)
    fp8 = reference.cast(w, scale_inv.float().reciprocal(), fmt.dtype, block).contiguous()
    if decision.granularity is Granularity.TENSORWISE:
        return fp8, scale_inv.reshape(()), 1, 0
    if decision.granularity is Granularity.ROWWISE:  # one scale per output channel (column of K x N)
        return fp8, scale_inv.reshape(-1).contiguous(), 1, 0
    if decision.granularity not in (Granularity.BLOCKWISE, Granularity.MX):
        raise ExportError(
            f"site {site}: {decision.granularity.value} weight scales have no ONNX export; keep the site high or use "
            "another granularity"
        )
    if opset < BLOCKED_OPSET:
        raise ExportError(
            f"site {site}: {decision.granularity.value} weight scales need opset {BLOCKED_OPSET} or newer "
            f"(DequantizeLinear block_size); got --opset {opset}"
        )
    if not torch.isfinite(scale_inv).all():
        raise ExportError(
            f"site {site}: a weight block's scale does not fit in {dtype} (largest |w| {w.abs().max().item():.3g}); "
            "keep the site high or export in float32"
        )
    # 128 x 128 blocks -> blocks of 128 along K, one scale per column (repeated over the block's
    # columns); MX's 32 x 1 blocks are that already.
    per_column = scale_inv.repeat_interleave(block[1], dim=1)[:, : w.shape[1]]
    return fp8, per_column.contiguous(), 0, block[0]


def _activation_scale_inv(
    model: nn.Module, site: str, fmt: Fp8Format, decision, amax: float | None, dtype: torch.dtype
) -> Tensor:
    owner = state_for(list(model.parameters())) if decision.delayed is not None else None
    state = owner.get(state_key(site, "output", "input")) if owner is not None else None
    if state is not None and int(state.steps) > 0:  # delayed scaling: the scale training ended with
        scale = state.scale.detach().float()
    elif amax is None:
        raise ExportError(f"site {site}: no calibration amax for its input (did calibration run through it?)")
    else:
        scale = reference.amax_to_scale(torch.tensor(amax), fmt.max, decision.margin, decision.power_of_two)
    return _rounded_up(scale.reciprocal(), dtype).reshape(())


class _AmaxRecorder(fx.Interpreter):
    """Runs the graph and keeps the largest magnitude each watched node produced."""

    def __init__(self, gm: fx.GraphModule, watched: set[fx.Node]):
        super().__init__(gm)
        self.watched = watched
        self.amax: dict[fx.Node, float] = {}

    def run_node(self, node: fx.Node):
        out = super().run_node(node)
        if node in self.watched:
            self.amax[node] = max(self.amax.get(node, 0.0), out.detach().abs().max().item())
        return out


def _rewrite(
    gm: fx.GraphModule, model: nn.Module, policy: Policy, calibration: list[tuple], opset: int
) -> tuple[list[SiteExport], dict[str, tuple[str, ...]]]:
    ctx = PassContext(options=BackendOptions(policy=policy))
    find_matmuls(gm, ctx)
    assign_precision(gm, ctx)
    sites, gemm_names, fp8 = [], {}, []
    for site in ctx.sites:
        gemm = site.gemms["output"]
        decision = annotation(gemm.node).decision
        sites.append(SiteExport(site.name, decision.precision.value))
        gemm_names[site.name] = _fx_names(gemm.node)
        if decision.fp8:
            if not BY_KIND[site.op].exportable:
                raise ExportError(
                    f"site {site.name}: FP8 {site.op} cannot be exported (ONNX QDQ export takes mm/addmm with a "
                    "weight); keep it high with a policy rule"
                )
            fp8.append((site.name, gemm.node, decision))
    recorder = _AmaxRecorder(gm, {matmul_operands(node)[0] for _, node, _ in fp8})
    with torch.no_grad():
        for batch in calibration:  # the activations' static scales
            recorder.run(*batch)
    for i, (name, node, decision) in enumerate(fp8):
        left, right, _ = matmul_operands(node)
        dtype = left.meta["val"].dtype  # the GEMM's: scales in it, DequantizeLinear returns it
        w8, w_scale_inv, axis, block_size = _quantized_weight(_weight_view(gm, right, name), decision, dtype, opset, name)
        x_scale_inv = _activation_scale_inv(model, name, decision.formats[0], decision, recorder.amax.get(left), dtype)
        buffers = {}
        for kind, value in (("weight", w8), ("weight_scale_inv", w_scale_inv), ("input_scale_inv", x_scale_inv)):
            buffers[kind] = f"fp8fx_{i}_{kind}"
            gm.register_buffer(buffers[kind], value)
        with gm.graph.inserting_before(node):
            x_scale = gm.graph.get_attr(buffers["input_scale_inv"])
            q = gm.graph.call_function(torch.ops.fp8fx.export_qdq.default, (left, x_scale, decision.formats[0].value))
            w = gm.graph.call_function(
                torch.ops.fp8fx.export_dequantize.default,
                (gm.graph.get_attr(buffers["weight"]), gm.graph.get_attr(buffers["weight_scale_inv"]), axis, block_size),
            )
        node.replace_input_with(left, q)
        node.replace_input_with(right, w)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return sites, gemm_names


# ----------------------------------------------------------------------------- export + verify


def _outputs(out) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    return [t for o in out for t in _outputs(o)] if isinstance(out, (list, tuple)) else []


def _dynamic_shapes(example_inputs: tuple, dynamic: tuple[str, ...]):
    if not dynamic:
        return None
    unknown = [d for d in dynamic if d not in DYNAMIC_DIMS]
    if unknown:
        raise ExportError(f"--dynamic: unknown dimension(s) {', '.join(unknown)}; expected {', '.join(DYNAMIC_DIMS)}")
    return tuple({DYNAMIC_DIMS[d]: torch.export.Dim.AUTO for d in dynamic if DYNAMIC_DIMS[d] < t.dim()} for t in example_inputs)


def export_onnx(
    model: nn.Module,
    example_inputs: tuple,
    path: str | Path,
    policy: Policy | None = None,
    calibration: list[tuple] | None = None,
    opset: int = BLOCKED_OPSET,
    dynamic: tuple[str, ...] = (),
    verify: bool = True,
) -> ExportResult:
    """Export `model`'s inference graph to `path` as ONNX with FP8 QDQ where `policy` says FP8.

    `calibration`: batches whose activation amaxes set the static input scales (default: the
    example inputs). `dynamic`: dimensions kept dynamic ("batch", "seq"). With `verify`,
    onnxruntime must reproduce fp8fx's emulation or nothing is written (ExportError); a bfloat16
    model needs verify=False (onnxruntime's CPU provider has no bfloat16 kernels). The model is
    captured in eval mode and left in the modes it had."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise ExportError(
            f"ONNX export needs onnx, onnxruntime and onnxscript ({e.name} is missing): pip install 'fp8fx[onnx]'"
        ) from e
    if opset < MIN_OPSET:
        raise ExportError(f"--opset {opset}: FP8 QuantizeLinear/DequantizeLinear need opset {MIN_OPSET} or newer")
    modes = {module: module.training for module in model.modules()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", TORCH_INTERNAL_WARNING, FutureWarning)
            return _export(
                model.eval(), tuple(example_inputs), Path(path), policy or Policy(), calibration, opset, dynamic, verify
            )
    finally:
        for module, training in modes.items():
            module.training = training


def _export(model, example_inputs, path, policy, calibration, opset, dynamic, verify) -> ExportResult:
    import onnx

    try:
        with torch.no_grad():
            program = torch.export.export(model, tuple(example_inputs), dynamic_shapes=_dynamic_shapes(example_inputs, dynamic))
        # Core ATen (linear -> mm/addmm, as fp8fx's passes expect) but attention kept whole: its
        # math decomposition does not keep the strides the captured graph assumes.
        table = {op: fn for op, fn in torch.export.default_decompositions().items() if "scaled_dot_product" not in str(op)}
        gm = program.run_decompositions(table).module()
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"torch.export could not capture the model: {error_summary(e)}") from e
    if verify and any(isinstance(v := n.meta.get("val"), Tensor) and v.dtype == torch.bfloat16 for n in gm.graph.nodes):
        raise ExportError(
            "the model computes in bfloat16, which onnxruntime's CPU provider cannot run (no bfloat16 MatMul, QuantizeLinear or "
            "DequantizeLinear), so the export cannot be verified: export model.half() or model.float(), or write it "
            "unverified with verify=False (--no-verify)"
        )
    sites, gemm_names = _rewrite(gm, model, policy, list(calibration or [example_inputs]), opset)
    with torch.no_grad():
        emulated = _outputs(gm(*example_inputs))
        original = _outputs(model(*example_inputs))
    nn.Module.train(gm, False)  # the graph is eval-mode already; the exported module's own eval() refuses
    try:
        onnx_program = torch.onnx.export(
            gm,
            example_inputs,
            dynamo=True,
            opset_version=opset,
            custom_translation_table=_onnx_translations(opset),
            dynamic_shapes=_dynamic_shapes(example_inputs, dynamic),
            verbose=False,
            optimize=True,
        )
    except Exception as e:
        raise ExportError(f"ONNX translation failed: {error_summary(e)}") from e
    _clamps_as_max_min(onnx_program.model.graph)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".onnx", dir=path.parent)
    os.close(fd)
    try:
        onnx_program.save(tmp)
        proto = onnx.load(tmp)
        result = _check(proto, tmp, example_inputs, emulated, original, verify)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for site in sites:
        site.onnx_nodes = _onnx_nodes(proto, gemm_names[site.site])
    nodes = [n.op_type for n in proto.graph.node]
    return ExportResult(
        path,
        opset,
        sites,
        quantize_nodes=nodes.count("QuantizeLinear"),
        dequantize_nodes=nodes.count("DequantizeLinear"),
        fp8_weights=sum(init.data_type in ONNX_DTYPES.values() and len(init.dims) > 0 for init in proto.graph.initializer),
        verified=verify,
        max_abs_diff_vs_emulation=result[0],
        sqnr_vs_original_db=result[1],
    )


def _clamps_as_max_min(graph) -> None:
    """Every Relu and Clip becomes Max/Min with the same bounds (equal but for the sign of zero).

    onnxruntime's ReluQuantFusion (seen in 1.20 to 1.32) deletes a Relu feeding a QuantizeLinear
    unless the zero point is an int8 other than -128 or a uint8 other than 0: with an FP8 one,
    whose range is symmetric, negatives then pass. ClipQuantFusion throws on an FP8 zero point, so
    no session can be created. QDQPropagationTransformer first moves a QuantizeLinear up through
    Reshape, Transpose, Squeeze, Unsqueeze, Slice and MaxPool, so an activation a few layout ops
    before one is hit too. Neither rewrite matches Max or Min."""
    from onnxscript import ir

    for act in list(graph):
        if act.op_type not in ("Relu", "Clip") or act.domain not in ("", "ai.onnx"):
            continue
        x = act.inputs[0]
        if act.op_type == "Relu":
            zero = ir.Value(name=f"{act.name}_zero", const_value=ir.tensor(0.0, dtype=x.dtype))
            graph.register_initializer(zero)
            bounds = [("Max", zero)]
        else:
            lower, upper = (list(act.inputs[1:]) + [None, None])[:2]
            bounds = [(op_type, bound) for op_type, bound in (("Max", lower), ("Min", upper)) if bound is not None]
        if not bounds:  # torch never clamps without a bound
            continue
        for op_type, bound in bounds[:-1]:  # both bounds: a Max, then the node itself as the Min
            first = ir.node(op_type, [x, bound])
            graph.insert_before(act, first)
            x = first.outputs[0]
        act.op_type, last = bounds[-1]
        act.resize_inputs(2)
        act.replace_input_with(0, x)
        act.replace_input_with(1, last)


def _check(
    proto, file: str, example_inputs: tuple, emulated: list[Tensor], original: list[Tensor], verify: bool
) -> tuple[float | None, float | None]:
    import onnx

    custom = {n.domain for n in proto.graph.node if n.domain not in ("", "ai.onnx")}
    if custom:
        raise ExportError(f"the exported graph uses custom operator domains {sorted(custom)}")
    if not verify:
        return None, None
    try:
        onnx.checker.check_model(file, full_check=True)
        onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    except Exception as e:
        raise ExportError(f"the ONNX model failed onnx's checks: {error_summary(e)}") from e
    import onnxruntime as ort

    options = ort.SessionOptions()  # default graph optimisations, as a deployment runs them
    options.log_severity_level = 3  # errors only: its warnings would go straight to stderr
    try:
        session = ort.InferenceSession(file, options, providers=["CPUExecutionProvider"])
        feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), example_inputs)}
        produced = [torch.from_numpy(o) for o in session.run(None, feeds)]
    except Exception as e:
        raise ExportError(f"onnxruntime {ort.__version__} could not run the exported model: {error_summary(e)}") from e
    if len(produced) != len(emulated):
        raise ExportError(f"onnxruntime returned {len(produced)} outputs, the model {len(emulated)}")
    diff = 0.0
    for got, want, high in zip(produced, emulated, original):
        if got.shape != want.shape:
            raise ExportError(f"onnxruntime output shape {tuple(got.shape)} differs from the model's {tuple(want.shape)}")
        output_diff = (got.float() - want.float()).abs().max().item()
        diff = max(diff, output_diff)
        if want.dtype == torch.float16:
            # onnxruntime's float16 kernels round otherwise than torch's, and the FP8 quantization after
            # each GEMM turns such a difference into a whole FP8 step now and then: the output is held to
            # the emulation's SQNR against the original model instead (40 dB when the emulation is exact).
            needed, reached = min(sqnr_db(high, want), HALF_FLOOR_DB) - HALF_MARGIN_DB, sqnr_db(high, got)
            if not reached >= needed:
                raise ExportError(
                    f"onnxruntime's float16 output has an SQNR of {reached:.1f} dB against the original model, "
                    f"{needed:.1f} dB needed (fp8fx's emulation: {sqnr_db(high, want):.1f} dB): the ONNX model does "
                    "not compute what fp8fx does"
                )
            continue
        tolerance = 1e-4 * want.abs().max().item() + 1e-6  # float rounding: summation order differs
        if output_diff > tolerance:
            raise ExportError(
                f"onnxruntime's output differs from fp8fx's emulation by {output_diff:.3g} (tolerance "
                f"{tolerance:.3g}): the ONNX model does not compute what fp8fx does"
            )
    sqnr = min(sqnr_db(o, p) for o, p in zip(original, produced))
    return diff, sqnr


def _fx_names(gemm: fx.Node) -> tuple[str, ...]:
    """The GEMM's FX node name, then the layout ops around it that ONNX's optimizer may fold into
    the MatMul it becomes, which then carries one of their names (a 3-D product's reshapes): the
    chain of sole readers after it, and the inputs only it reads."""
    names, node = [gemm.name], gemm
    while len(node.users) == 1 and (user := next(iter(node.users))).target in LAYOUT_OPS:
        names.append(user.name)
        node = user
    names += [arg.name for arg in gemm.all_input_nodes if arg.target in LAYOUT_OPS and len(arg.users) == 1]
    return tuple(names)


def _onnx_nodes(proto, fx_names: tuple[str, ...]) -> list[str]:
    """The ONNX nodes a GEMM became (the exporter records the FX node on each), with the
    DequantizeLinear / QuantizeLinear nodes feeding it. `fx_names` are the GEMM's FX node, then
    the layout ops around it: a MatMul labelled with one of those is the GEMM's, folded."""

    def labelled(node, name: str) -> bool:
        return any(p.key == "pkg.torch.onnx.fx_node" and p.value.startswith(f"%{name} :") for p in node.metadata_props)

    producer = {out: node for node in proto.graph.node for out in node.output}
    found = [n for n in proto.graph.node if labelled(n, fx_names[0])]
    if not found:
        found = [n for n in proto.graph.node if n.op_type in ("MatMul", "Gemm") and any(labelled(n, x) for x in fx_names[1:])]
    queue = list(found)
    while queue:
        for name in queue.pop().input:
            node = producer.get(name)
            if node is not None and node.op_type in ("DequantizeLinear", "QuantizeLinear") and node not in found:
                found.append(node)
                queue.append(node)
    return [n.name for n in found]
