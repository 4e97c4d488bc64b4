"""fp8fx::tap and its handler registry (fp8fx.ops.taps): what a tap passes on and to whom, weak
references, and the one op the monitor, shadow checks and numerics probes share."""

from __future__ import annotations

import gc

import pytest
import torch

import fp8fx
from fp8fx.ops import taps

TAP = torch.ops.fp8fx.tap.default


class Recorder:
    def __init__(self):
        self.calls = []

    def tap(self, key, passthrough, observed):
        self.calls.append((key, passthrough.clone(), [t.clone() for t in observed]))


def test_a_tap_calls_its_handler_and_returns_a_copy():
    recorder = Recorder()
    number = taps.register(recorder)
    x, y = torch.randn(3, 4), torch.randn(4)
    out = TAP(x, [y], number, "k")
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    ((key, passed, observed),) = recorder.calls
    assert key == "k" and torch.equal(passed, x) and len(observed) == 1 and torch.equal(observed[0], y)
    taps.unregister(number)
    TAP(x, [y], number, "k")
    assert len(recorder.calls) == 1 and taps.lookup(number) is None


def test_handlers_are_held_weakly_and_numbers_never_reused():
    numbers = [taps.register(Recorder()) for _ in range(3)]
    gc.collect()
    assert len(set(numbers)) == 3 and all(taps.lookup(n) is None for n in numbers)
    assert torch.equal(TAP(torch.ones(2), [], numbers[0], "gone"), torch.ones(2))  # a dropped handler: nothing called
    with pytest.raises(TypeError, match="no tap"):
        taps.register(object())


def test_fake_tap_has_the_passthrough_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = TAP(torch.empty(5, 7, dtype=torch.bfloat16), [torch.empty(2)], 1, "k")
    assert out.shape == (5, 7) and out.dtype == torch.bfloat16


def test_monitor_shadow_and_probes_are_taps_of_their_own_handlers():
    torch.manual_seed(0)
    layer = fp8fx.prepare(torch.nn.Linear(32, 16))
    policy = fp8fx.Policy(shadow=fp8fx.core.policy.Shadow(every=1))
    backend = fp8fx.backend(policy=policy, inner="eager", keep_graphs=True, monitor_every=1)
    torch.compile(layer, backend=backend)(torch.randn(8, 32)).sum().backward()
    handlers = [n.args[2] for _, gm in backend.kept_graphs for n in gm.graph.nodes if n.target == TAP]
    assert set(handlers) == {backend.monitor.tap_handler, backend.shadow.tap_handler}
    assert (
        taps.lookup(backend.monitor.tap_handler) is backend.monitor and taps.lookup(backend.shadow.tap_handler) is backend.shadow
    )
    assert backend.shadow.checks and backend.monitor.samples
    assert not any(hasattr(torch.ops.fp8fx, name) for name in ("observe", "shadow_check", "numerics_probe"))
