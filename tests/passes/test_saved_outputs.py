"""FP8 GEMM outputs that backward reads are kept in BF16 between forward and backward (and the
elementwise ops after them recomputed from that copy): the bytes autograd keeps, the graphs'
saved values, and the gradients against keeping them as computed."""

from __future__ import annotations

import pytest
import torch
from helpers import GRAD_SQNR_DB, GatedBlock, kept_for_backward, sqnr

import fp8fx
from fp8fx.compiler.lowering import LOWERED_FROM

ops = torch.ops.fp8fx


def saved_by_dtype(model, x) -> dict[torch.dtype, int]:
    """Bytes of the distinct non-parameter storages autograd keeps for backward, by dtype."""
    kept, out = kept_for_backward(model.parameters(), lambda: model(x))
    out.square().sum().backward()
    totals: dict[torch.dtype, int] = {}
    for nbytes, dtype in kept.values():
        totals[dtype] = totals.get(dtype, 0) + nbytes
    return totals


def run(saved: str, inner: str = "eager", weight_fp8: str = "keep"):
    torch.manual_seed(0)
    model = GatedBlock(d=64, hidden=128)
    x = torch.randn(4, 32, 64, requires_grad=True)
    backend = fp8fx.backend(inner=inner, keep_graphs=True, saved_outputs=saved, weight_fp8=weight_fp8)
    compiled = torch.compile(model, backend=backend)
    compiled(x).square().sum().backward()  # compile
    model.zero_grad()
    x.grad = None
    totals = saved_by_dtype(compiled, x)
    grads = [x.grad, *(p.grad for p in model.parameters())]
    model.zero_grad()
    x.grad = None
    model(x).square().sum().backward()  # fp32 reference
    return backend, totals, [(g, r) for g, r in zip(grads, [x.grad, *(p.grad for p in model.parameters())])]


@pytest.fixture(scope="module")
def runs():
    """`runs(saved, inner, weight_fp8="keep")`: `run(...)`'s result, computed once per arguments in
    this module (test_gemm_outputs_backward_reads_are_saved_in_bf16 and
    test_weight_fp8_recompute_saves_no_fp8_weight_and_changes_no_gradient both ran
    `run("bf16", inner)`). Each call returns a fresh dict of totals and list of gradient pairs;
    the tests read the backend's kept graphs and the tensors, and change none."""
    results: dict[tuple[str, str, str], tuple] = {}

    def get(saved: str, inner: str = "eager", weight_fp8: str = "keep"):
        key = (saved, inner, weight_fp8)
        if key not in results:
            results[key] = run(saved, inner, weight_fp8)
        backend, totals, grads = results[key]
        return backend, dict(totals), list(grads)

    yield get
    results.clear()


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_gemm_outputs_backward_reads_are_saved_in_bf16(inner, runs):
    _, high, high_grads = runs("high", inner)
    backend, bf16, grads = runs("bf16", inner)
    # GatedBlock keeps for backward fc's output (before GELU) and gate's and up's (SiLU x
    # product), all fp32 GEMM outputs: 128 KiB as computed, half of it in BF16, no fp32 left
    # but scalars (scales).
    assert high.get(torch.bfloat16, 0) == 0 and high[torch.float32] >= 4 * 32 * (128 + 64 + 64) * 4
    assert bf16.get(torch.float32, 0) < 1024
    assert bf16[torch.bfloat16] * 2 <= high[torch.float32]
    if inner == "eager":
        forward = next(gm for kind, gm in backend.kept_graphs if kind == "forward")
        assert sum(n.target == ops.saved_copy.default for n in forward.graph.nodes) >= 3
    # BF16's 8 significant bits against the FP8 gradients they meet (E5M2: 3): the gradients'
    # distance to fp32 does not change beyond the FP8 rounding noise (measured within 0.1 dB).
    for (ours, ref), (theirs, _) in zip(grads, high_grads):
        assert sqnr(ours, ref) > GRAD_SQNR_DB
        assert sqnr(ours, ref) > sqnr(theirs, ref) - 0.5


def test_saved_outputs_option_is_checked():
    with pytest.raises(ValueError, match=r"saved_outputs must be one of bf16, high, got 'fp8'"):
        fp8fx.backend(saved_outputs="fp8")


def _recomputed_at_first_use(graph) -> set:
    """The nodes `graph` (a backward graph) computes from saved values alone; asserts each comes
    right before the first node outside them that reads it."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    recomputed: set = set()
    for node in nodes:
        saved = [a.op == "placeholder" and "tangents" not in a.name or a in recomputed for a in node.all_input_nodes]
        if node.op == "call_function" and all(saved) and not node.is_impure():  # (a `full` has no inputs)
            recomputed.add(node)

    def readers(node) -> set:
        """The nodes outside the recomputation that read `node`, directly or through it."""
        found, todo = set(), list(node.users)
        while todo:
            user = todo.pop()
            (todo.extend(user.users) if user in recomputed else found.add(user))
        return found

    for node in recomputed:
        first = min(readers(node), key=position.__getitem__)
        between = [n for n in nodes[position[node] + 1 : position[first]] if n not in recomputed]
        assert not between, f"{node} is recomputed before {between}, which do not read it"
    return recomputed


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_backward_recomputes_each_value_just_before_its_first_use(inner, monkeypatch):
    """Values backward recomputes from saved ones (each layer's SiLU and products from their BF16
    copies, the weights' FP8 casts with weight_fp8="recompute") are computed right before the node
    that first reads them, not all at the start of backward, where every layer's recomputed values
    were alive at once. Inductor keeps fp8fx's opaque ops in graph order, so its graphs need it too."""
    from fp8fx.compiler import lowering

    checked = []
    if inner == "inductor":  # check the backward graph Inductor is given, before its fp8fx ops become ATen ops
        lower = lowering.lower_elementwise

        def checking(gm, *args):
            if any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes):
                checked.append(_recomputed_at_first_use(gm.graph))
            return lower(gm, *args)

        monkeypatch.setattr(lowering, "lower_elementwise", checking)
    torch.manual_seed(0)
    model = torch.nn.Sequential(GatedBlock(d=64, hidden=128), GatedBlock(d=64, hidden=128))
    backend = fp8fx.backend(inner=inner, keep_graphs=True, weight_fp8="recompute")
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(model, backend=backend)(torch.randn(4, 32, 64, requires_grad=True)).square().sum().backward()
    if inner == "eager":
        checked.append(_recomputed_at_first_use(next(gm for kind, gm in backend.kept_graphs if kind == "backward").graph))
    (recomputed,) = checked
    # (under Inductor the casts are ATen ops by then, lowered before partitioning: their FP8 writes)
    cast = torch.ops.fp8fx.cast.default
    casts = [n for n in recomputed if n.target == cast or (n.meta.get(LOWERED_FROM) == cast.name() and n.meta["val"].dtype == torch.float8_e4m3fn)]
    assert len(casts) == 8  # the weights of both blocks' 4 GEMMs, cast again just before their dgrad
    # Inductor's decomposition of silu's backward: sigmoid (torch 2.13), 1 / (1 + exp(-x)) (torch 2.11)
    silu = {torch.ops.aten.silu.default} if inner == "eager" else {torch.ops.aten.sigmoid.default, torch.ops.aten.reciprocal.default}
    assert sum(n.target in silu and LOWERED_FROM not in n.meta for n in recomputed) == 2  # one per layer (not a scale's reciprocal)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_weight_fp8_recompute_saves_no_fp8_weight_and_changes_no_gradient(inner, runs):
    """weight_fp8="recompute": backward casts each weight again instead of keeping forward's FP8
    copy; the same cast of the same weight, so the gradients are those of keeping it."""
    _, kept, kept_grads = runs("bf16", inner)
    _, recomputed, grads = runs("bf16", inner, weight_fp8="recompute")
    weights = 3 * 128 * 64 + 64 * 64  # fc, gate, up and down: one byte per element of each FP8 copy
    assert kept[torch.float8_e4m3fn] - recomputed.get(torch.float8_e4m3fn, 0) == weights
    for (a, _), (b, _) in zip(kept_grads, grads):
        assert torch.equal(a, b)


def test_weight_fp8_option_is_checked():
    with pytest.raises(ValueError, match=r"weight_fp8 must be one of auto, keep, recompute, got 'drop'"):
        fp8fx.backend(weight_fp8="drop")
    with pytest.raises(ValueError, match=r"weight_fp8='recompute' needs dynamic scaling"):
        fp8fx.backend(fp8fx.Policy.from_recipe("delayed"), weight_fp8="recompute")


@pytest.mark.parametrize("recipe, chosen", [("tensorwise", "recompute"), ("rowwise", "recompute"), ("delayed", "keep")])
def test_weight_fp8_auto_recomputes_under_dynamic_scaling_only(recipe, chosen):
    assert fp8fx.backend().weight_fp8 == "recompute"  # the default policy's dynamic scaling
    assert fp8fx.backend(fp8fx.Policy.from_recipe(recipe)).weight_fp8 == chosen


def test_weight_fp8_recompute_samples_each_weight_cast_once_per_step():
    """The runtime monitor's tap is not part of what backward recomputes: one sample per step."""
    torch.manual_seed(0)
    compiled = torch.compile(GatedBlock(), backend=fp8fx.backend(inner="eager", weight_fp8="recompute", monitor_every=1))
    for _ in range(3):
        compiled(torch.randn(4, 32, 64)).square().sum().backward()
    weights = {key: s for key, s in fp8fx.stats(compiled).summary().items() if key.endswith(".weight")}
    assert len(weights) == 4 and all(s["samples"] == 3 for s in weights.values())
