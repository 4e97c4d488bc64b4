"""Matrix products fp8fx cannot rewrite still get a report row: addbmm as a site with its three
GEMMs, and opaque ops (aten._scaled_grouped_mm, any custom matmul-shaped op) kept high with reason
kind `opaque`, counted in the FP8 FLOP share; grouped GEMMs (aten._grouped_mm, transformers'
grouped-mm custom op) are rows of op grouped_mm whether a policy runs them in FP8 or not."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import FP8_GEMM, SCALED_MM, compile_captured, count, sqnr
from torch import fx, nn

import fp8fx
from fp8fx import Policy, Rule
from fp8fx.passes import BackendOptions, PassContext
from fp8fx.passes.verify import VerifyError, verify


class AddBmm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 32, 48) / 6)
        self.bias = nn.Parameter(torch.randn(16, 48))

    def forward(self, x):
        return torch.addbmm(self.bias, x, self.w)


class Wrapped(nn.Module):  # gives the site a module name
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _train_step(model: nn.Module, policy: Policy | None = None):
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    cap = compile_captured(model, policy)
    x = torch.randn(4, 16, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, ref = cap.compiled(x), reference(x_ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    return cap, (out, ref), (x.grad, x_ref.grad), reference


def test_addbmm_is_one_site_with_output_grad_input_and_grad_weight():
    cap, *_ = _train_step(Wrapped(AddBmm()))
    rows = {op.role: op for op in cap.report.ops}
    assert set(rows) == {"output", "grad_input", "grad_weight"} and {op.site for op in rows.values()} == {"inner"}
    assert all(op.op == "addbmm" and op.precision == "high" for op in rows.values())
    assert rows["output"].reason_kind == "pattern" and "aten.addbmm sums its batch of products" in rows["output"].reason
    assert rows["grad_input"].reason_kind == rows["grad_weight"].reason_kind == "op_kind"
    assert "op bmm (addbmm's backward GEMMs) is not in defaults.ops" in rows["grad_input"].reason
    dims = {role: (op.m, op.n, op.k, op.batch, op.flops) for role, op in rows.items()}
    assert dims == {
        "output": (16, 48, 32, 4, 2 * 16 * 48 * 32 * 4),
        "grad_input": (16, 32, 48, 4, 2 * 16 * 48 * 32 * 4),
        "grad_weight": (32, 48, 16, 4, 2 * 16 * 48 * 32 * 4),
    }


def test_addbmm_backward_bmms_run_in_fp8_when_the_policy_enables_bmm():
    model = Wrapped(AddBmm())
    cap, (out, ref), (x_grad, x_ref_grad), reference = _train_step(model, Policy(rules=(Rule(match="*", op=("bmm",), precision="fp8"),)))
    rows = {op.role: op for op in cap.report.ops}
    assert rows["output"].precision == "high" and rows["grad_input"].precision == rows["grad_weight"].precision == "fp8"
    assert rows["grad_input"].operands == ("grad_output", "weight") and rows["grad_input"].formats == ("e5m2", "e4m3")
    assert rows["grad_weight"].operands == ("input", "grad_output")
    fp8_nodes = [count(g, SCALED_MM) + count(g, FP8_GEMM) for g in (*cap.forward, *cap.backward)]
    assert sum(fp8_nodes) == 2 and all(n == 0 for n in fp8_nodes[: len(cap.forward)])
    assert sqnr(out, ref) > 200  # forward unchanged
    assert sqnr(x_grad, x_ref_grad) >= 20
    assert sqnr(model.inner.w.grad, reference.inner.w.grad) >= 20


@torch.library.custom_op("opaque_test::matmul", mutates_args=())
def _custom_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@_custom_matmul.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


def _custom_matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    return _custom_matmul(grad, b.t().contiguous()), _custom_matmul(a.t().contiguous(), grad)


_custom_matmul.register_autograd(_custom_matmul_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


@torch.library.custom_op("opaque_test::scaled_add", mutates_args=())
def _scaled_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # elementwise: no matrix product
    return a + 0.5 * b


_scaled_add.register_fake(lambda a, b: torch.empty_like(a))
_scaled_add.register_autograd(lambda ctx, grad: (grad, 0.5 * grad))


class CustomOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 48) / 6)
        self.proj = nn.Linear(48, 48)

    def forward(self, x):
        h = _custom_matmul(x, self.w)
        return self.proj(_scaled_add(h, h))


def test_custom_matmul_op_gets_opaque_rows_and_elementwise_custom_op_none():
    model = CustomOps()
    reference = copy.deepcopy(model)
    cap = compile_captured(model)
    x = torch.randn(16, 32, requires_grad=True)
    out = cap.compiled(x)
    out.sum().backward()
    reference(x).sum().backward()
    report = cap.report
    custom = {op.role: op for op in report.ops if op.op == "opaque_test::matmul"}
    assert set(custom) == {"output", "grad_input", "grad_weight"}
    assert {op.site for op in report.ops} == {"<top>:opaque_test::matmul#0", "proj"}  # scaled_add is no GEMM
    out_row = custom["output"]
    assert out_row.precision == "high" and out_row.reason_kind == "opaque" and (out_row.m, out_row.flops) == ("?", 0)
    assert out_row.reason.startswith(
        "custom op opaque_test::matmul(float32[16, 32], float32[32, 48]) -> float32[16, 48]: fp8fx cannot rewrite inside it; "
    )
    assert out_row.reason.endswith("FLOPs unknown")
    summary = report.summary()
    assert summary["gemms_without_flops"] == 3 and summary["fallbacks_by_reason"] == {"opaque": 3}
    assert "3 GEMM(s) of dynamic or unknown dimensions" in report.table()
    assert sqnr(model.w.grad, reference.w.grad) >= 20
    # fp8fx analyze runs the same passes: the same rows.
    analysed = fp8fx.analyze(CustomOps(), (torch.randn(16, 32, requires_grad=True),), train=True)
    assert sorted((op.site, op.role, op.reason_kind) for op in analysed.ops) == sorted((op.site, op.role, op.reason_kind) for op in report.ops)


def test_verify_passes_nodes_without_value_only_when_their_op_returns_nothing():
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 4)
    check = graph.call_function(torch.ops.aten._assert_async.msg, (x, "x is non-zero"))  # returns nothing
    y = graph.call_function(torch.ops.aten.mm.default, (x, x))
    y.meta["val"] = torch.empty(4, 4)
    graph.output(y)
    gm = fx.GraphModule(nn.Module(), graph)
    ctx = PassContext(options=BackendOptions(policy=Policy()))
    verify(gm, ctx)
    assert "val" not in check.meta
    del y.meta["val"]
    with pytest.raises(VerifyError, match=r"node without meta\['val'\]: %mm"):
        verify(gm, ctx)


def _tiny_mixtral(layers: int = 1, **config):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32, use_cache=False, **config,
    )  # fmt: skip
    return MixtralForCausalLM(cfg)


def test_mixtral_expert_gemms_left_high_are_rows_in_the_flop_share():
    # fp32 weights: the experts run transformers' custom op (torch._grouped_mm takes bf16 only under
    # compile), matched as the grouped GEMM it is; a policy without grouped_mm keeps it high.
    model = _tiny_mixtral()
    backend = fp8fx.backend(policy=Policy(defaults=fp8fx.Settings(ops=("mm", "addmm"))), inner="eager")
    torch.compile(model, backend=backend)(torch.randint(0, 64, (1, 8))).logits.float().sum().backward()
    report = fp8fx.report(backend)
    experts = [op for op in report.ops if op.fqn == "model.layers.0.mlp.experts"]
    assert sorted((op.site.rsplit("#")[-1], op.role) for op in experts) == sorted(
        (i, role) for i in "01" for role in ("output", "grad_input", "grad_weight")
    )
    assert all(
        op.op == "grouped_mm" and op.groups == 4 and op.precision == "high" and op.reason_kind == "op_kind" for op in experts
    )
    # 8 tokens x top-2 = 16 routed rows: gate_up is 16 x 32 @ 32 x 128, down 16 x 64 @ 64 x 32, each once per role.
    assert sorted(op.flops for op in experts) == sorted([2 * 16 * 32 * 128] * 3 + [2 * 16 * 64 * 32] * 3)
    forward = [op for op in report.ops if not op.backward]
    share = sum(op.flops for op in forward if op.precision == "fp8") / sum(op.flops for op in forward)
    assert 0 < share < 1 and report.summary()["fp8_flop_share_forward"] == pytest.approx(share)
    total_share = sum(op.flops for op in report.fp8_ops) / sum(op.flops for op in report.ops)
    fp8fx.assert_coverage(report, total_share - 0.01)
    with pytest.raises(
        fp8fx.CoverageError, match=r"model\.layers\.0\.mlp\.experts:grouped_mm#0\.\w+ \(op_kind: op grouped_mm is not in"
    ):
        fp8fx.assert_coverage(report, total_share + 0.01)


def test_grouped_mm_rows_and_eager_experts_train():
    # bf16 weights: the experts call aten._grouped_mm; forward, dgrad (2-D x 3-D) and wgrad (2-D x 2-D), in FP8 by default.
    block = _tiny_mixtral().to(torch.bfloat16).model.layers[0].mlp
    backend = fp8fx.backend(inner="eager")
    torch.compile(block, backend=backend)(
        torch.randn(1, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    ).float().sum().backward()
    rows = [op for op in fp8fx.report(backend).ops if op.op == "grouped_mm"]
    assert sorted((op.site, op.role, op.flops) for op in rows) == sorted(
        [
            (f"experts:grouped_mm#{i}", role, flops)
            for i, flops in ((0, 2 * 16 * 32 * 128), (1, 2 * 16 * 64 * 32))
            for role in ("output", "grad_input", "grad_weight")
        ]
    )
    assert all(op.precision == "fp8" and op.groups == 4 and "grouped 2d-" in op.reason for op in rows)

    # The eager experts: one_hot's runtime assert (a node with no value) passes verify. Their
    # loop over the experts hit is data-dependent, so Dynamo runs it outside any graph.
    torch._dynamo.reset()
    block = _tiny_mixtral(experts_implementation="eager").model.layers[0].mlp
    reference = copy.deepcopy(block)
    backend = fp8fx.backend(inner="eager")
    x = torch.randn(1, 8, 32)
    out = torch.compile(block, backend=backend)(x)
    out.sum().backward()
    reference(x).sum().backward()
    assert sqnr(block.experts.down_proj.grad, reference.experts.down_proj.grad) > 100
    assert {(op.site, op.role) for op in fp8fx.report(backend).ops} == {("gate", "output"), ("gate", "grad_weight")}
