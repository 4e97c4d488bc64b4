"""Weights whose products never reached a compiled graph (eager code Dynamo skips, a loop it does
not trace) are named in the report instead of silently running in high precision."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8fx


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.inner = nn.Linear(d, d)
        self.side = nn.Linear(d, d)

    @torch.compiler.disable
    def eager_side(self, x):  # runs outside any graph, as a loop over data-dependent experts would
        return self.side(x)

    def forward(self, x):
        return self.inner(x) + self.eager_side(x)


class Stack(nn.Module):
    def __init__(self, blocks=3, d=64):
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


EAGER = [f"layers.{i}.side.weight" for i in range(3)]


def test_report_names_weights_no_graph_took():
    torch.manual_seed(0)
    model = Stack()
    compiled = torch.compile(model, backend=fp8fx.backend(inner="eager"))
    compiled(torch.randn(4, 8, 64, requires_grad=True)).sum().backward()
    report = fp8fx.report(compiled)
    assert report.uncaptured_weights == EAGER  # biases and the norm's 1-D weight are not matrices
    assert report.summary()["uncaptured_weights"] == EAGER
    assert report.to_dict()["summary"]["uncaptured_weights"] == EAGER
    assert [u.module for u in report.uncaptured] == ["layers.0.side", "layers.1.side", "layers.2.side"]
    assert "layers.*.side (Linear) x3: 1 weight parameter each never read by a compiled graph" in "\n".join(report.summary_lines())
    assert all(op.fqn.endswith("inner") for op in report.ops)


def test_analyze_names_them_in_every_folded_block():
    torch.manual_seed(0)
    report = fp8fx.analyze(Stack(), (torch.randn(4, 8, 64),), train=True)
    assert report.folded == {"layers": 3}
    assert sorted(report.uncaptured_weights) == EAGER


def test_a_fully_captured_model_has_none():
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    compiled = torch.compile(model, backend=fp8fx.backend(inner="eager"))
    compiled(torch.randn(8, 64)).sum().backward()
    report = fp8fx.report(compiled)
    assert report.uncaptured_weights == [] and not any("not captured" in line for line in report.summary_lines())


def _tiny_mixtral(impl: str):
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32, use_cache=False, experts_implementation=impl,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def test_eager_experts_are_reported_with_the_fix_and_fail_coverage():
    from fp8fx.reporting.html import render_html
    from fp8fx.reporting.uncaptured import EAGER_EXPERTS, EAGER_EXPERTS_FIX, Uncaptured

    compiled = torch.compile(_tiny_mixtral("eager"), backend=fp8fx.backend(inner="eager"))
    compiled(torch.randint(0, 64, (1, 8))).logits.float().sum().backward()
    report = fp8fx.report(compiled)
    experts = "model.layers.0.mlp.experts"
    # The embedding also runs outside every graph here, but a lookup is no GEMM: not reported.
    assert report.uncaptured == [
        Uncaptured(experts, "MixtralExperts", (f"{experts}.gate_up_proj", f"{experts}.down_proj"), EAGER_EXPERTS, EAGER_EXPERTS_FIX)
    ]
    assert report.summary()["uncaptured_modules"][0]["fix"] == EAGER_EXPERTS_FIX
    lines = report.summary_lines()
    assert lines[0].endswith("(not counting the GEMMs of 1 module(s) no graph captured)")
    assert f'not captured: {experts} (MixtralExperts): 2 weight parameters never read by a compiled graph: {EAGER_EXPERTS}; {EAGER_EXPERTS_FIX}' in lines
    assert (len(report.fp8_ops), len(report.ops)) == (15, 20) and not any(".experts" in op.fqn for op in report.ops)
    assert f"Not captured: {experts} (MixtralExperts)" in render_html(report.to_dict())
    with pytest.raises(fp8fx.CoverageError, match=rf"the GEMMs of {experts} ran outside every compiled graph"):
        fp8fx.assert_coverage(report, 0.5)


def test_grouped_mm_experts_are_captured_in_fp8():
    compiled = torch.compile(_tiny_mixtral("grouped_mm"), backend=fp8fx.backend(inner="eager"))
    compiled(torch.randint(0, 64, (1, 8))).logits.float().sum().backward()
    report = fp8fx.report(compiled)
    assert report.uncaptured == []
    experts = [op for op in report.ops if op.fqn == "model.layers.0.mlp.experts"]
    assert len(experts) == 6 and all(op.op == "grouped_mm" and op.precision == "fp8" for op in experts)
    fp8fx.assert_coverage(report, 0.5)


class TiedLM(nn.Module):
    def __init__(self, vocab=64, d=32, eager_head=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.body = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.eager_head = eager_head

    @torch.compiler.disable
    def lookup(self, ids):
        return self.embed(ids)

    def forward(self, ids):
        h = self.body(self.lookup(ids))
        return self.eager(h) if self.eager_head else self.head(h)

    @torch.compiler.disable
    def eager(self, h):
        return self.head(h)


@pytest.mark.parametrize("eager_head", [False, True])
def test_a_weight_tied_to_an_embedding_counts_under_its_matmul(eager_head):
    # The lookup always runs eagerly: the tied weight is reported only when the head's product did too.
    compiled = torch.compile(TiedLM(eager_head=eager_head), backend=fp8fx.backend(inner="eager"))
    compiled(torch.randint(0, 64, (2, 8))).sum().backward()
    found = [(u.module, u.kind, u.weights) for u in fp8fx.report(compiled).uncaptured]
    assert found == ([("head", "Linear", ("head.weight",))] if eager_head else [])


def test_a_compiled_submodule_reports_its_own_weights_only():
    model = Stack()
    compiled = torch.compile(model.layers[1], backend=fp8fx.backend(inner="eager"))
    x = torch.randn(4, 8, 64)
    model.layers[2](compiled(model.layers[0](x))).sum().backward()  # layers 0 and 2 run uncompiled
    assert fp8fx.report(compiled).uncaptured_weights == ["side.weight"]
