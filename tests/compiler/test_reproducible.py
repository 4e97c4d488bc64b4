"""Training steps rerun bit for bit: with inner="eager" as they are, and with inner="inductor"
under torch.use_deterministic_algorithms(True). Without it Inductor's CPU kernel for the embedding
gradient adds with atomics, in whatever order its threads get there (plain Inductor's too)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama

import fp8fx


@pytest.fixture
def deterministic_algorithms():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_training_steps_rerun_bit_for_bit(inner, deterministic_algorithms):
    torch.manual_seed(0)
    model = tiny_llama()
    tokens = torch.randint(0, 256, (4, 64))
    backend = fp8fx.backend(inner=inner)
    compiled = torch.compile(model, backend=backend)
    grads = []
    for _ in range(3):
        compiled(tokens).logits.square().mean().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        model.zero_grad()
    assert any(op.precision == "fp8" for op in fp8fx.report(backend).ops)
    for later in grads[1:]:
        assert [name for name in grads[0] if not torch.equal(grads[0][name], later[name])] == []
