"""GEMM and operand roles by operand identity: the weight is the forward operand computed from
parameters, on whichever side of the product it is written."""

from __future__ import annotations

import copy

import torch
from helpers import compile_captured, sqnr
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from fp8fx import GemmPrecisions, Policy, Rule, Settings
from fp8fx.passes.assign_precision import decide
from fp8fx.passes.find_matmuls import find_matmuls
from fp8fx.passes.graph_utils import PassContext
from fp8fx.passes.options import BackendOptions

E, N, K, T = 2, 48, 32, 16


class WeightLeftBmm(nn.Module):
    """`torch.bmm(W, x)`, as MoE experts written weight-first compute; `gain` makes x an
    activation that needs a gradient (so the site has a grad_input GEMM)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, N, K) / 6)
        self.gain = nn.Parameter(torch.ones(K, 1))

    def forward(self, x):
        return torch.bmm(self.w, x * self.gain)


class WeightRight(nn.Module):  # x @ W.t()
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(N, K) / 6)
        self.gain = nn.Parameter(torch.ones(K))

    def forward(self, x):
        return torch.matmul(x * self.gain, self.w.t())


class WeightLeft(WeightRight):  # the same product written (W @ x.t()).t()
    def forward(self, x):
        return torch.matmul(self.w, (x * self.gain).t()).t()


def _train_step(make, policy, x):
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    cap = compile_captured(model, policy)
    g = torch.randn(x.shape[0], *((N, T) if x.dim() == 3 else (N,)), generator=torch.Generator().manual_seed(1))
    out = cap.compiled(x)
    (out * g).sum().backward()
    (reference(x) * g).sum().backward()
    return cap, model, reference, out


def test_weight_on_the_left_of_a_bmm_gets_the_weight_roles():
    policy = Policy(rules=(Rule(match="*", op=("bmm",), precision="fp8", granularity="blockwise"),))
    x = torch.randn(E, K, T, generator=torch.Generator().manual_seed(2))
    cap, model, reference, out = _train_step(WeightLeftBmm, policy, x)
    rows = {op.role: op for op in cap.report.ops}
    assert set(rows) == {"output", "grad_input", "grad_weight"}
    assert all(op.precision == "fp8" for op in rows.values()), [op.reason for op in rows.values()]
    # The weight gradient is an E x N x K product, the input gradient E x K x T.
    assert (rows["grad_weight"].batch, rows["grad_weight"].m, rows["grad_weight"].n) == (E, N, K)
    assert (rows["grad_input"].batch, rows["grad_input"].m, rows["grad_input"].n) == (E, K, T)
    assert rows["output"].operands == ("weight", "input") and rows["output"].formats == ("e4m3", "e4m3")
    assert rows["grad_input"].operands == ("weight", "grad_output") and rows["grad_input"].formats == ("e4m3", "e5m2")
    assert rows["grad_weight"].operands == ("grad_output", "input") and rows["grad_weight"].formats == ("e5m2", "e4m3")
    assert rows["output"].blocks == ((128, 128), (128, 1))  # the weight's 128 x 128 blocks on the left
    assert rows["grad_weight"].blocks == ((1, 128), (128, 1))
    assert 20 <= sqnr(model.w.grad, reference.w.grad) <= 40
    assert 20 <= sqnr(out, reference(x)) <= 40
    with torch.no_grad():  # the inference graph labels its operands the same way
        cap.compiled(x)
    (inference,) = [op for op in cap.report.ops if op.graph_kind == "inference"]
    assert inference.operands == ("weight", "input")


def test_weight_left_or_right_gives_the_same_rows_and_policy_overrides():
    policy = Policy(defaults=Settings(gemms=GemmPrecisions(grad_weight="high")))
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(2))
    rows = {}
    for make in (WeightRight, WeightLeft):
        cap, model, reference, _ = _train_step(make, policy, x)
        ops = cap.report.ops
        rows[make] = {op.role: (sorted(op.operands), op.flops, op.precision) for op in ops}
        (high,) = [op for op in ops if op.precision == "high"]
        assert high.role == "grad_weight" and {(high.m, high.n), (high.n, high.m)} == {(N, K), (K, N)}
        assert cap.scaled_mm_nodes() == 2
        # Only the weight gradient skips FP8: it matches eager's, the input's gradient does not.
        assert sqnr(model.w.grad, reference.w.grad) > 80
        assert 15 <= sqnr(model.gain.grad, reference.gain.grad) <= 40
    assert rows[WeightRight] == rows[WeightLeft]
    assert rows[WeightLeft]["grad_weight"][0] == ["grad_output", "input"]


def test_parameter_inputs_decide_the_weight_in_any_graph():
    """An embedding lookup stays an activation; experts picked from a stack by routing indices
    stay weights; which inputs are parameters comes from the context when it says."""

    def fn(table, ids, proj, experts, expert_ids):
        h = torch.nn.functional.embedding(ids, table) @ proj.t()  # [S, K]
        return torch.bmm(experts[expert_ids], h.unsqueeze(-1))  # weight-first, MoE-style

    args = (torch.randn(64, K), torch.randint(0, 64, (T,)), torch.randn(K, K), torch.randn(E, N, K), torch.randint(0, E, (T,)))
    gm = make_fx(fn)(*args)

    def roles(param_inputs):
        ctx = PassContext(options=BackendOptions(policy=Policy()), param_inputs=param_inputs)
        find_matmuls(gm, ctx)
        return {site.op: decide(site, site.forward, ctx).operand_roles for site in ctx.sites}

    assert roles(frozenset({0, 2, 3})) == {"mm": ("input", "weight"), "bmm": ("weight", "input")}
    # Frozen experts not listed: nothing tells the bmm's weight apart, so the right operand is taken.
    assert roles(frozenset({0, 2})) == {"mm": ("input", "weight"), "bmm": ("input", "weight")}
