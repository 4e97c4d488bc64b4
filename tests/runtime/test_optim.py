"""Fp8AdamW (MS-AMP's O2 optimizer): torch's AdamW update with FP8 / FP16 moments."""

import pytest
import torch
from helpers import sqnr

from fp8fx.runtime.optim import Fp8AdamW


def regression(seed: int, shape: tuple[int, int]):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, shape[1], generator=g)
    target = x @ torch.randn(shape[1], shape[0], generator=g) + 0.1 * torch.randn(256, shape[0], generator=g)
    return x, target


def train(optimizer_cls, seed: int, shape: tuple[int, int], steps: int, **kwargs) -> tuple[torch.Tensor, list[float]]:
    x, target = regression(seed, shape)
    weight = torch.nn.Parameter(torch.zeros(shape))
    opt = optimizer_cls([weight], **kwargs)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(x @ weight.t(), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return weight.detach(), losses


CASES = [(seed, shape, lr) for seed, shape in enumerate([(16, 32), (64, 48), (8, 128)]) for lr in (1e-3, 1e-2)]


@pytest.mark.parametrize("seed, shape, lr", CASES)
def test_trains_like_torch_adamw(seed, shape, lr):
    kwargs = {"lr": lr, "weight_decay": 0.01}
    ours, our_losses = train(Fp8AdamW, seed, shape, 200, **kwargs)
    theirs, their_losses = train(torch.optim.AdamW, seed, shape, 200, **kwargs)
    # E4M3's 3 mantissa bits in the first moment move the trajectory (about 20 dB from AdamW's
    # after 200 steps, against ~40 dB for a 1% change of lr); the loss gets as low
    assert sqnr(ours, theirs) > 15.0
    assert our_losses[-1] < 0.8 * our_losses[0]
    assert our_losses[-1] <= 1.05 * their_losses[-1]


def test_first_step_is_adamw_exactly_and_states_take_three_bytes():
    ours, _ = train(Fp8AdamW, 0, (16, 32), 1, lr=1e-2)
    theirs, _ = train(torch.optim.AdamW, 0, (16, 32), 1, lr=1e-2)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-9)
    weight = torch.nn.Parameter(torch.randn(16, 32))
    opt = Fp8AdamW([weight])
    weight.grad = torch.randn(16, 32)
    opt.step()
    state = opt.state[weight]
    assert state["exp_avg"].dtype == torch.float8_e4m3fn and state["exp_avg_sq"].dtype == torch.float16
    assert sum(state[k].numel() * state[k].element_size() for k in ("exp_avg", "exp_avg_sq")) == 3 * weight.numel()
    # the moments come back within their formats' resolution
    m = state["exp_avg"].float() / state["exp_avg_scale"]
    assert sqnr(m, 0.1 * weight.grad) > 28.0


def test_resumes_from_its_state_dict():
    a = torch.nn.Parameter(torch.randn(8, 16))
    b = torch.nn.Parameter(a.detach().clone())
    opt_a, opt_b = Fp8AdamW([a], lr=1e-2), Fp8AdamW([b], lr=1e-2)
    grads = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    for i, grad in enumerate(grads):
        if i == 3:  # b restarts from a checkpoint of its own optimizer
            opt_b = Fp8AdamW([b], lr=1e-2)
            opt_b.load_state_dict(saved)
        for p, opt in ((a, opt_a), (b, opt_b)):
            p.grad = grad.clone()
            opt.step()
        saved = opt_b.state_dict()
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"lr": -1.0}, "lr must be a finite number >= 0.0, got -1.0"), ({"lr": float("nan")}, "lr must be a finite number"),
     ({"betas": (0.9, 1.0)}, "betas must be two numbers in [0, 1), got (0.9, 1.0)"), ({"eps": -1e-8}, "eps must be")],
)  # fmt: skip
def test_bad_hyperparameters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=r"^Fp8AdamW: " + __import__("re").escape(message)):
        Fp8AdamW([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_without_quantization_the_update_is_adamw(monkeypatch):
    """The moments' quantizers are the only difference from torch's AdamW (bias correction, decoupled
    weight decay and eps as torch has them, over many steps)."""
    import fp8fx.runtime.optim

    keep = lambda x: (x.clone(), torch.tensor(1.0))  # noqa: E731
    monkeypatch.setattr(fp8fx.runtime.optim, "_quantize_fp8", keep)
    monkeypatch.setattr(fp8fx.runtime.optim, "_quantize_fp16", keep)
    ours, _ = train(Fp8AdamW, 0, (16, 32), 200, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)
    theirs, _ = train(torch.optim.AdamW, 0, (16, 32), 200, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)
    assert sqnr(ours, theirs) > 100.0
