"""Fp8AdamW (MS-AMP's O2 optimizer): torch's AdamW update with FP8 / FP16 moments."""

import io

import pytest
import torch
from helpers import sqnr

import fp8fx.runtime.optim
from fp8fx.core.formats import Fp8Format
from fp8fx.core.scaling import amax_to_scale, tensor_amax
from fp8fx.ops import reference
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
    saved = None
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
    optim = fp8fx.runtime.optim
    keep = lambda x, numels, moment: (x.clone(), torch.ones(len(numels)))
    monkeypatch.setattr(optim, "_quantize", keep)
    monkeypatch.setattr(optim, "_MOMENTS", tuple(m._replace(dtype=torch.float32) for m in optim._MOMENTS))
    ours, _ = train(Fp8AdamW, 0, (16, 32), 200, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)
    theirs, _ = train(torch.optim.AdamW, 0, (16, 32), 200, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)
    assert sqnr(ours, theirs) > 100.0


class _LoopAdamW(Fp8AdamW):
    """The per-parameter implementation Fp8AdamW had before its fused step (copied as it was): the
    reference the fused step must match bit for bit."""

    @staticmethod
    def _quantize_fp16(x):
        scale = amax_to_scale(tensor_amax(x), torch.finfo(torch.float16).max, margin=1)
        return (x * scale).clamp(-torch.finfo(torch.float16).max, torch.finfo(torch.float16).max).to(torch.float16), scale

    @staticmethod
    def _quantize_fp8(x):
        fmt = Fp8Format.E4M3
        scale = reference.amax_to_scale(reference.amax(x, []), fmt.max, 0, False)
        return reference.cast(x, scale, fmt.dtype, []), scale

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                grad = p.grad.float()
                if not state:
                    state["step"] = 0
                    m, v = torch.zeros_like(grad), torch.zeros_like(grad)
                else:
                    m = state["exp_avg"].float() / state["exp_avg_scale"]
                    v = state["exp_avg_sq"].float() / state["exp_avg_sq_scale"]
                state["step"] += 1
                step = state["step"]
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (v / (1 - beta2**step)).sqrt_().add_(group["eps"])
                update = (m / (1 - beta1**step)).div_(denom)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"])
                state["exp_avg"], state["exp_avg_scale"] = self._quantize_fp8(m)
                state["exp_avg_sq"], state["exp_avg_sq_scale"] = self._quantize_fp16(v)


# (shape, dtype, gradient magnitude, steps it has a gradient on): fp32 and bf16, a 0-d parameter, an
# all-zero gradient (amax 0: scale 1), gradients tiny enough to need the FP16 scale, one without a
# gradient on odd steps (its step count falls behind: a bucket of its own) and one never stepped
MIXED = [
    ((16, 32), torch.float32, 1.0, "all"), ((7,), torch.bfloat16, 1e-3, "all"), ((3, 5, 7), torch.float32, 1e-6, "even"),
    ((), torch.float32, 1.0, "all"), ((64, 48), torch.bfloat16, 10.0, "all"), ((9, 2), torch.float32, 0.0, "all"),
    ((5, 5), torch.bfloat16, 1.0, "never"), ((130,), torch.float32, 1e3, "all"),
]  # fmt: skip


def mixed_model(optimizer_cls, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape, dtype, _, _ in MIXED]
    groups = [  # different hyper-parameters; the second group without weight decay
        {"params": params[:5], "lr": 1e-2, "weight_decay": 0.1},
        {"params": params[5:], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.99), "eps": 1e-6},
    ]
    return params, optimizer_cls(groups)


def set_grads(params, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    for p, (shape, dtype, magnitude, when) in zip(params, MIXED):
        grad = (magnitude * torch.randn(shape, generator=g)).to(dtype)
        p.grad = grad if when == "all" or (when == "even" and step % 2 == 0) else None


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so that -0 differs from 0 and NaN equals itself)."""
    return t.detach().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(params_a, opt_a, params_b, opt_b):
    for a, b in zip(params_a, params_b):
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b))
        state_a, state_b = opt_a.state[a], opt_b.state[b]
        assert state_a.keys() == state_b.keys()
        for key in state_a:
            x, y = state_a[key], state_b[key]
            if torch.is_tensor(x):
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y)), key
            else:
                assert x == y, key


@pytest.mark.parametrize("path", ["cpu", "multi-tensor", "multi-tensor, chunks of 100"])
def test_fused_step_is_the_per_parameter_loop_bit_for_bit(monkeypatch, path):
    """On the CPU's path and on the GPU's (expanded scales, `_foreach_norm`), which runs on a CPU too."""
    if path != "cpu":
        monkeypatch.setattr(fp8fx.runtime.optim, "_LOOPING_DEVICES", ())
    if path.endswith("100"):  # buckets cut into chunks
        monkeypatch.setattr(fp8fx.runtime.optim, "_CHUNK_NUMEL", 100)
    ours, opt = mixed_model(Fp8AdamW)
    loop, opt_loop = mixed_model(_LoopAdamW)
    for step in range(8):
        set_grads(ours, step)
        set_grads(loop, step)
        opt.step()
        opt_loop.step()
        assert_same(ours, opt, loop, opt_loop)
    assert opt.state[ours[2]]["step"] == 4 and opt.state[ours[0]]["step"] == 8 and not opt.state[ours[6]]
    assert opt.state[ours[0]]["exp_avg"].dtype == torch.float8_e4m3fn
    assert opt.state[ours[1]]["exp_avg_sq"].dtype == torch.float16


def test_state_dict_round_trip_continues_as_if_uninterrupted():
    """Saved after 3 steps (through torch.save), loaded into a fresh optimizer over copies of the
    parameters, 3 more steps: bit-identical to 6 uninterrupted steps. bf16 parameters included:
    torch's load casts state to the parameter's dtype, which Fp8AdamW undoes."""
    params, opt = mixed_model(Fp8AdamW)
    for step in range(3):
        set_grads(params, step)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    _, opt_resumed = mixed_model(Fp8AdamW)
    opt_resumed = Fp8AdamW(
        [{**g, "params": resumed[:5]} for g in opt_resumed.param_groups[:1]]
        + [{**g, "params": resumed[5:]} for g in opt_resumed.param_groups[1:]]
    )
    opt_resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert_same(params, opt, resumed, opt_resumed)
    for step in range(3, 6):
        for ps, o in ((params, opt), (resumed, opt_resumed)):
            set_grads(ps, step)
            o.step()
        assert_same(params, opt, resumed, opt_resumed)


def test_sparse_gradients_are_refused():
    weight = torch.nn.Parameter(torch.zeros(4, 4))
    weight.grad = torch.zeros(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        Fp8AdamW([weight]).step()
