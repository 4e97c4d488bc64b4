"""find_matmuls and assign_precision on the constructs models are made of, and the decisions a
policy or a shape produces - checked in the report and by counting nodes in the graph."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import compile_captured, sqnr
from torch import nn

from fp8fx import GemmPrecisions, Policy, Rule, Settings
from fp8fx.tools.demo import TinyTransformer


class LinearModel(nn.Module):  # nn.Linear on a 3-D input -> addmm with views around it
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 48)

    def forward(self, x):
        return self.fc(x)


class FunctionalLinear(nn.Module):  # F.linear without bias -> mm
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(48, 32) / 6)

    def forward(self, x):
        return F.linear(x, self.w)


class MatmulParam(nn.Module):  # torch.matmul of a 4-D activation with a weight -> mm
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 48) / 6)

    def forward(self, x):
        return torch.matmul(x.unsqueeze(1).expand(-1, 2, -1, -1), self.w)


class Conv1DLike(nn.Module):  # GPT-2's Conv1D: addmm(bias, x2d, w) with w stored [in, out]
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 48) / 6)
        self.bias = nn.Parameter(torch.zeros(48))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], 48)


class Attention(nn.Module):  # activation @ activation with 4-D `@` -> bmm
    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(32, 64)

    def forward(self, x):
        q, k = self.qk(x).view(x.shape[0], x.shape[1], 2, 2, 16).permute(2, 0, 3, 1, 4)
        return (q @ k.transpose(-2, -1)).sum(-1)


class Baddbmm(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        h = self.proj(x)
        return torch.baddbmm(torch.zeros(1, 1, 1), h, h.transpose(1, 2))


ENABLE_BATCHED = Policy(rules=(Rule(match="*", op=("bmm", "baddbmm"), precision="fp8"),))

CASES = {
    # name: (module, expected (site, op) list, policy)
    "linear": (LinearModel, [("fc", "addmm")], None),
    "functional": (FunctionalLinear, [("<top>:mm#0", "mm")], None),
    "matmul4d": (MatmulParam, [("<top>:mm#0", "mm")], None),
    "conv1d": (Conv1DLike, [("<top>:addmm#0", "addmm")], None),
    "attention": (Attention, [("qk", "addmm"), ("<top>:bmm#0", "bmm")], ENABLE_BATCHED),
    "baddbmm": (Baddbmm, [("proj", "addmm"), ("<top>:baddbmm#0", "baddbmm")], ENABLE_BATCHED),
}


@pytest.mark.parametrize("input_grad", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_sites_roles_and_numerics(case, input_grad):
    make, expected_sites, policy = CASES[case]
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    cap = compile_captured(model, policy)
    x = torch.randn(2, 16, 32, requires_grad=input_grad)
    x_ref = x.detach().clone().requires_grad_(input_grad)
    out, ref = cap.compiled(x), reference(x_ref)
    out.sum().backward()
    ref.sum().backward()

    report = cap.report
    assert sorted({(op.site, op.op) for op in report.ops}) == sorted(expected_sites)
    for site, op in expected_sites:
        roles = {r.role for r in report.find(site=site)}
        # Every right operand here needs grad; the left one does when it is x with grad or an activation.
        first = site == expected_sites[0][0]
        expect = {"output", "grad_weight"} | ({"grad_input"} if input_grad or not first else set())
        assert roles == expect, (site, roles)
    assert all(op.precision == "fp8" for op in report.ops), [op.reason for op in report.high_ops]
    assert cap.scaled_mm_nodes() == len(report.ops)
    assert sqnr(out, ref) >= 20
    for p, r in zip(model.parameters(), reference.parameters()):
        assert sqnr(p.grad, r.grad) >= 15
    if input_grad:
        assert sqnr(x.grad, x_ref.grad) >= 15


def test_operand_roles_and_hybrid_formats():
    cap = compile_captured(LinearModel())
    cap.compiled(torch.randn(2, 16, 32, requires_grad=True)).sum().backward()
    by_role = {op.role: op for op in cap.report.ops}
    assert by_role["output"].operands == ("input", "weight") and by_role["output"].formats == ("e4m3", "e4m3")
    assert by_role["grad_input"].operands == ("grad_output", "weight") and by_role["grad_input"].formats == ("e5m2", "e4m3")
    assert by_role["grad_weight"].operands == ("grad_output", "input") and by_role["grad_weight"].formats == ("e5m2", "e4m3")
    assert by_role["output"].source.endswith(".py:" + by_role["output"].source.rsplit(":", 1)[1])


def test_batched_matmuls_stay_high_by_default_and_say_why():
    cap = compile_captured(Attention())
    cap.compiled(torch.randn(2, 16, 32)).sum().backward()
    bmm = cap.report.find(site="<top>:bmm#0")
    assert len(bmm) == 3 and all(op.precision == "high" and op.reason_kind == "op_kind" for op in bmm)
    assert "defaults.ops" in bmm[0].reason


def _decisions(policy):
    torch.manual_seed(0)
    cap = compile_captured(TinyTransformer(layers=2, max_seq=16), policy)
    cap.compiled(torch.randint(0, 256, (2, 16))).sum().backward()
    return cap, {(op.site, op.role): op for op in cap.report.ops}


def test_policy_changes_exactly_the_decisions_it_names():
    _, default = _decisions(None)
    policy = Policy(defaults=Settings(gemms=GemmPrecisions(grad_weight="high")), rules=(Rule(match="lm_head", precision="high"),))
    cap, custom = _decisions(policy)
    assert default.keys() == custom.keys()
    changed = {key for key in default if default[key].precision != custom[key].precision}
    linear = {key for key, op in default.items() if op.op in ("mm", "addmm")}
    expected = {key for key in linear if key[0] == "lm_head" or key[1] == "grad_weight"}
    assert changed == expected and len(expected) == 8 + 3  # 8 block sites grad_weight, lm_head all three
    assert custom[("lm_head", "output")].reason == "rules[0].precision: high"
    assert custom[("blocks.0.up", "grad_weight")].reason == "defaults.gemms.grad_weight: high"
    assert cap.scaled_mm_nodes() == sum(op.precision == "fp8" for op in custom.values())


class OddHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(32, 64)
        self.squeeze = nn.Linear(64, 10)  # N=10
        self.classifier = nn.Linear(10, 7)  # the 10x7 head: K=10, N=7

    def forward(self, x):
        return self.classifier(F.relu(self.squeeze(F.relu(self.body(x)))))


def test_odd_shapes_stay_high_with_the_reason_and_the_model_trains():
    torch.manual_seed(0)
    model = OddHead()
    cap = compile_captured(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 32), torch.randint(0, 7, (32,))
    losses = []
    for _ in range(5):
        loss = F.cross_entropy(cap.compiled(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    report = cap.report
    assert {op.precision for op in report.find(site="body")} == {"fp8"}
    for site, dim in (("squeeze", "N=10"), ("classifier", "N=7")):
        ops = report.find(site=site)
        assert ops and all(op.precision == "high" and op.reason_kind == "shape" for op in ops)
        assert f"{dim} is not a multiple of 16" in ops[0].reason
    assert report.summary()["fallbacks_by_reason"] == {"shape": 6}  # squeeze and classifier, 3 GEMMs each
    assert cap.scaled_mm_nodes() == 2  # body: output + grad_weight (x needs no grad)


def test_float64_model_stays_high_with_dtype_reason():
    model = nn.Linear(32, 32).double()
    cap = compile_captured(model)
    cap.compiled(torch.randn(16, 32, dtype=torch.float64)).sum().backward()
    assert {op.reason_kind for op in cap.report.ops} == {"dtype"}
    assert cap.scaled_mm_nodes() == 0


class _MatmulInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad @ w, None


def test_backward_matmul_without_forward_site_is_reported_high():
    w = torch.randn(32, 32)
    cap = compile_captured(nn.Identity())
    fn = torch.compile(lambda x: _MatmulInBackward.apply(x, w), backend=cap.dynamo_backend)
    x = torch.randn(16, 32, requires_grad=True)
    fn(x).sum().backward()
    (op,) = cap.report.ops
    assert op.precision == "high" and op.reason_kind == "unlinked" and op.role == "grad_input"


def test_dynamic_batch_dimension():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    reference = copy.deepcopy(model)
    cap = compile_captured(model, dynamic=True)
    for batch in (5, 9):
        x = torch.randn(batch, 32)
        out = cap.compiled(x)
        out.sum().backward()
        assert sqnr(out, reference(x)) >= 20
    ops = cap.report.ops
    assert all(op.precision == "fp8" for op in ops)
    assert any(isinstance(op.m, str) for op in ops)  # M is symbolic


class SdpaAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(1)


@pytest.mark.parametrize("grad", [True, False])
def test_fused_attention_is_reported_high_with_its_flops(grad):
    cap = compile_captured(SdpaAttention())
    x = torch.randn(2, 16, 32)
    if grad:
        cap.compiled(x).sum().backward()
    else:
        with torch.no_grad():
            cap.compiled(x)
    report = cap.report
    attention = report.find(site="<top>:sdpa#0")
    assert attention and all(op.precision == "high" and op.reason_kind == "op_kind" for op in attention)
    assert "fused attention kernel" in attention[0].reason
    # One backward kernel computes dq, dk and dv: it is the site's grad_input, with 4 products.
    assert [op.role for op in attention] == (["output", "grad_input"] if grad else ["output"])
    assert attention[-1].flops == (4 if grad else 2) * 2 * 16 * 16 * 16 * 4
    # Two (B*H) x 16 x 16 x 16 products forward: q @ k^T and p @ v.
    assert sum(op.flops for op in attention if op.role == "output") == 2 * (2 * 2 * 16 * 16 * 16) * 2
    assert all(op.precision == "fp8" for op in report.find(site="qkv"))


class WrappedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("wraps", [1, 2])
def test_sites_keep_their_module_names_when_a_forward_is_wrapped_in_a_closure(wraps):
    """Frameworks replace `forward` with a closure over the bound method (torchtitan's
    parallelize); Dynamo then names modules through the closure, and a rule naming the module
    must still apply."""

    def wrap(fn):
        def forward(*args, **kwargs):
            return fn(*args, **kwargs)

        return forward

    model = nn.Sequential(WrappedBlock(), WrappedBlock())
    for _ in range(wraps):
        model[1].forward = wrap(model[1].forward)
    policy = Policy(rules=(Rule(match="1.down", precision="high"),))
    cap = compile_captured(model, policy)
    cap.compiled(torch.randn(4, 16, requires_grad=True)).sum().backward()
    sites = {op.site: op.precision for op in cap.report.ops}
    assert sites == {"0.up": "fp8", "0.down": "fp8", "1.up": "fp8", "1.down": "high"}
