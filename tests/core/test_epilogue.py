"""The epilogue contract (`fp8fx.core.epilogue`): the spec string round-trip, parsed once per
string, and the one activation table's graph targets agreeing with its torch functions."""

from __future__ import annotations

import itertools

import pytest
import torch

from fp8fx.core.epilogue import ACTIVATIONS, AUX_STAGES, MUL_MODES, Epilogue, activation_of

aten = torch.ops.aten


def every_epilogue():
    names = list(ACTIVATIONS)
    for bias, act, mul, residual, aux, amax in itertools.product(
        (False, True), names, MUL_MODES, (False, True), AUX_STAGES, (False, True)
    ):
        for gate in names if mul == "gated" else ["none"]:
            yield Epilogue(bias, act, mul, gate, residual, aux, amax)


def test_spec_round_trips_and_is_parsed_once_per_string():
    epilogues = list(every_epilogue())
    specs = [e.spec() for e in epilogues]
    assert len(set(specs)) == len(epilogues)  # the spec tells every epilogue apart
    assert [Epilogue.parse(s) for s in specs] == epilogues
    assert Epilogue.parse("bias,act=gelu,aux=pre_activation") is Epilogue.parse("bias,act=gelu,aux=pre_activation")
    assert Epilogue.parse("") == Epilogue()


@pytest.mark.parametrize(
    "spec,message", [("bias,swish", "unknown part 'swish'"), ("act=tanh", "activation='tanh'"), ("aux=later", "aux='later'")]
)
def test_bad_specs_name_the_part(spec, message):
    with pytest.raises(ValueError, match=message):
        Epilogue.parse(spec)


def test_activation_codes_are_distinct_and_none_is_zero():
    codes = [a.code for a in ACTIVATIONS.values()]
    assert ACTIVATIONS["none"].code == 0 and sorted(codes) == list(range(len(codes)))
    ep = Epilogue(activation="silu", mul="gated", mul_activation="gelu_tanh", aux="product")
    c = ep.constexprs()
    assert (c["ACTIVATION"], c["MUL_ACTIVATION"]) == (ACTIVATIONS["silu"].code, ACTIVATIONS["gelu_tanh"].code)
    assert (c["MUL_MODE"], c["AUX_STAGE"]) == (MUL_MODES.index("gated"), AUX_STAGES.index("product"))


@pytest.mark.parametrize("name", [n for n in ACTIVATIONS if n != "none"])
def test_each_activation_graph_target_computes_the_table_function(name):
    """What fuse_epilogues matches in a graph computes what the kernels and the reference compute."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4
    act = ACTIVATIONS[name]
    assert act.aten
    for target, required in act.aten:
        kwargs = dict(required)
        assert activation_of(target, kwargs) == name
        torch.testing.assert_close(target(x, **kwargs), act.reference(x), rtol=0, atol=0)


def test_activation_of_uses_schema_defaults_and_rejects_others():
    assert activation_of(aten.gelu.default, {}) == "gelu"  # approximate defaults to "none"
    assert activation_of(aten.gelu.default, {"approximate": "tanh"}) == "gelu_tanh"
    assert activation_of(aten.tanh.default, {}) is None and activation_of(aten.add.Tensor, {}) is None
