"""Delayed scaling: TransformerEngine's formula over scripted amax sequences, state updated inside
the compiled graph, saved with the model and resumed exactly."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import compile_captured
from torch import nn

import fp8fx
from fp8fx import Policy, ops
from fp8fx.tools.demo import TinyTransformer

SEQUENCE = [2.0, 8.0, 0.0, 1.0, 300.0, 1.0, 0.0, float("inf"), 1.0, 1.0, float("nan"), 0.5, 0.5, 0.5, 0.5, 4.0]


def te_delayed_scaling(amaxes, history_len, algo, margin, interval, fp8_max=448.0):
    """TE's DelayedScaling, written from its documentation: this step's amax goes to slot 0 of the
    history; amax = max(history) or history[0]; sf = fp8_max / amax / 2**margin, keeping the old
    scale where amax is 0 or non-finite; the history then rolls by one and slot 0 is cleared.
    A non-finite amax keeps the scale and is not recorded (TE's history reduction skips it; one
    NaN must not freeze the scale for the history's length). fp8fx recomputes the scale only every
    `interval` steps. Divisions are done in fp64 and rounded once to fp32, as fp8fx does (TE
    divides in fp32: the two can differ by one fp32 ulp)."""
    history, scale, scales = [0.0] * history_len, 1.0, []
    for step, a in enumerate(amaxes):
        history[0] = a if math.isfinite(a) else 0.0
        chosen = history[0] if algo == "most_recent" else max(history)
        if step % interval == 0 and math.isfinite(a) and chosen > 0:
            scale = float(torch.tensor(fp8_max / chosen / 2**margin, dtype=torch.float64).float())
        scales.append(scale)
        history = [0.0] + (history[2:] + history[:1] if history_len > 1 else [])
        history = history[:history_len]
    return scales


@pytest.mark.parametrize(
    "history_len,algo,margin,interval",
    list(itertools.product([1, 4, 1024], ["max", "most_recent"], [0, 2], [1, 3])),
)
def test_state_update_follows_te_formula(history_len, algo, margin, interval):
    h, s = torch.zeros(history_len), torch.ones(())
    n, f = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    got = []
    for a in SEQUENCE:
        h, s, n, f = ops.delayed_scale_update(h, s, n, f, torch.tensor(a), 448.0, margin, False, algo == "most_recent", interval)
        got.append(s.item())
    assert got == te_delayed_scaling(SEQUENCE, history_len, algo, margin, interval)
    assert n.item() == len(SEQUENCE) and f.item() == 2  # the inf and the NaN step


def test_compiled_linear_casts_with_the_previous_scale_and_updates_in_graph():
    torch.manual_seed(0)
    model = fp8fx.prepare(nn.Linear(32, 16, bias=False))
    # Under no_grad: a calibration run, which updates the state as training does.
    cap = compile_captured(model, Policy.from_recipe("delayed", amax_history_len=4, calibrate=True))
    expected = te_delayed_scaling(SEQUENCE, 4, "max", 0, 1)
    w = model.weight.detach()
    for step, a in enumerate(SEQUENCE):
        x = torch.full((16, 32), a)
        with torch.no_grad():
            out = cap.compiled(x)
        state = model.fp8fx_state.get("<top>:mm#0.output.input")
        assert state is not None, list(model.fp8fx_state.states)
        assert state.scale.item() == expected[step]
        if step and math.isfinite(a):  # this step's cast used the scale left by the previous step
            prev = expected[step - 1]
            x8 = (x * prev).clamp(-448, 448).to(torch.float8_e4m3fn).float() / prev
            w_scale = ops.amax_to_scale(ops.amax(w, []), 448.0, 0, False)  # the weight's scale is settled by now
            if step > 1:
                ref = x8 @ (w * w_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float().t() / w_scale
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    (op,) = fp8fx.report(cap.backend).ops
    assert op.amax_history_len == 4 and op.amax_compute_algo == "max" and op.scaling == "delayed"
    assert op.scale[0] == expected[-1] and op.scale_inv[0] == pytest.approx(1 / expected[-1])
    assert op.non_finite == (2, 0)


def _batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    data = (torch.randint(0, 200, (8, 1), generator=gen) + torch.arange(17) * 3) % 256
    return data[:, :-1], data[:, 1:]


def _train(model, opt, compiled, steps):
    losses = []
    for step in steps:
        x, y = _batches(step)
        loss = F.cross_entropy(compiled(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["delayed", "megatron"])
def test_resume_from_checkpoint_reproduces_steps_exactly(recipe, tmp_path):
    policy = Policy.from_recipe(recipe, amax_history_len=8) if recipe == "delayed" else Policy.from_recipe(recipe)

    def fresh():
        torch.manual_seed(0)
        model = fp8fx.prepare(TinyTransformer(dim=64, heads=4, layers=2, max_seq=16))
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3)

    model, opt = fresh()
    compiled = torch.compile(model, backend=fp8fx.backend(policy, inner="eager"))
    _train(model, opt, compiled, range(10))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    assert any(k.startswith("fp8fx_state.") for k in model.state_dict())
    straight = _train(model, opt, compiled, range(10, 20))

    torch._dynamo.reset()
    model2, opt2 = fresh()
    ckpt = torch.load(tmp_path / "ckpt.pt")
    model2.load_state_dict(ckpt["model"])  # before the first compile: the state waits for its buffers
    opt2.load_state_dict(ckpt["opt"])
    compiled2 = torch.compile(model2, backend=fp8fx.backend(policy, inner="eager"))
    resumed = _train(model2, opt2, compiled2, range(10, 20))
    assert resumed == straight
    assert all(math.isfinite(v) for v in straight)
    state1, state2 = model.state_dict(), model2.state_dict()
    assert all(torch.equal(state1[k], state2[k]) for k in state1 if k.startswith("fp8fx_state."))


def test_delayed_scaling_without_prepare_is_a_clear_error():
    compiled = torch.compile(nn.Linear(16, 16), backend=fp8fx.backend(Policy.from_recipe("delayed"), inner="eager"))
    with pytest.raises(Exception, match=r"call fp8fx.prepare\(model\) before torch.compile"):
        compiled(torch.randn(4, 16))


def test_checkpoint_with_another_history_length_is_a_clear_error():
    model = fp8fx.prepare(nn.Linear(16, 16))
    torch.compile(model, backend=fp8fx.backend(Policy.from_recipe("delayed", amax_history_len=4), inner="eager"))(
        torch.randn(4, 16)
    )
    ckpt = model.state_dict()
    torch._dynamo.reset()
    other = fp8fx.prepare(nn.Linear(16, 16))
    other.load_state_dict(ckpt)
    compiled = torch.compile(other, backend=fp8fx.backend(Policy.from_recipe("delayed", amax_history_len=8), inner="eager"))
    with pytest.raises(Exception, match="amax_history_len changed"):
        compiled(torch.randn(4, 16))


def test_prepare_leaves_sequential_models_working_and_state_dict_loadable():
    model = fp8fx.prepare(nn.Sequential(nn.Linear(16, 16), nn.ReLU()))
    assert fp8fx.prepare(model) is model  # idempotent
    model(torch.randn(2, 16))
    model.load_state_dict(model.state_dict())  # strict: the hooks add and consume fp8fx_state.*


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_state_survives_recompiles_and_works_under_inductor(inner):
    torch.manual_seed(0)
    model = fp8fx.prepare(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))
    backend = fp8fx.backend(Policy.from_recipe("delayed", amax_history_len=4), inner=inner)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    for batch in (8, 8, 16):  # the third call recompiles for a new shape
        compiled(torch.randn(batch, 32)).sum().backward()
    assert len(backend.graphs) == 2
    states = model.fp8fx_state.states
    # Both graphs read and update the same states: three steps recorded, none lost to the recompile.
    assert len(states) == 6 and all(s.steps.item() == 3 for s in states.values())
    assert all(torch.isfinite(s.scale) and s.scale > 1 for s in states.values())


def test_one_nan_step_does_not_freeze_the_scale_for_the_history():
    """After a NaN amax, the next clean step's scale comes from the clean history (the NaN step
    itself keeps its scale and is counted)."""
    h, s = torch.zeros(1024), torch.ones(())
    n, f = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    scales = []
    for a in (2.0, float("nan"), 4.0, 1.0):
        h, s, n, f = ops.delayed_scale_update(h, s, n, f, torch.tensor(a), 448.0, 0, False, False, 1)
        scales.append(s.item())
        assert torch.isfinite(h).all()
    assert scales == [224.0, 224.0, 112.0, 112.0] and f.item() == 1


def _delayed_training(inner: str):
    """Three steps of a small MLP under delayed scaling: the states, the gradients, the graphs."""
    torch.manual_seed(0)
    model = fp8fx.prepare(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))  # ReLU: exact in both
    backend = fp8fx.backend(Policy.from_recipe("delayed", amax_history_len=4), inner=inner, keep_graphs=True)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        compiled(torch.randn(8, 32, generator=gen) * 4).square().mean().backward()
    states = {name: s.tensors() for name, s in model.fp8fx_state.states.items()}
    return states, [p.grad for p in model.parameters()], [gm for _, gm in backend.kept_graphs]


def test_inductor_updates_the_states_in_place_as_eager_does():
    """One in-place `delayed_scale_steps` per graph (forward's casts, backward's) stepping each
    cast's state once, no `copy_` back into the graph's inputs, and Inductor's compiled graphs
    leave the states bit for bit where the eager graphs do."""
    states, grads, graphs = _delayed_training("eager")
    nodes = [n for gm in graphs for n in gm.graph.nodes]
    steps = [n for n in nodes if n.target == torch.ops.fp8fx.delayed_scale_steps.default]
    assert len(steps) == len(graphs) == 2
    keys = [key for n in steps for key in n.args[1].split("\n")]
    assert len(keys) == len(set(keys)) == len(states) == 6
    nodes = [n.target for n in nodes]
    assert torch.ops.aten.copy_.default not in nodes
    inductor_states, inductor_grads, _ = _delayed_training("inductor")
    assert inductor_states.keys() == states.keys()
    for name, tensors in states.items():
        for a, b in zip(tensors, inductor_states[name]):
            assert torch.equal(a, b), name
    for a, b in zip(grads, inductor_grads):  # Inductor's fused kernels round differently
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_one_trace_per_graph_and_one_handle_input(inner):
    """Delayed scaling compiles a graph with a single aot_autograd trace (no planning trace: the
    states are found by key through one handle input), creates its states at compile time, and
    reads each state once, before any state is updated."""
    from torch._dynamo.utils import counters

    counters.clear()
    model = fp8fx.prepare(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))
    backend = fp8fx.backend(Policy.from_recipe("delayed"), inner=inner, keep_graphs=True)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    x = torch.randn(8, 32)
    out = compiled(x)
    assert counters["aot_autograd"]["total"] == 1
    assert len(model.fp8fx_state.states) == 6  # before backward has run: made when the graph was compiled
    out.sum().backward()
    assert counters["aot_autograd"]["total"] == 1
    if inner == "eager":
        (_, forward), (_, backward) = backend.kept_graphs
        inputs = [n for n in forward.graph.nodes if n.op == "placeholder"]
        assert len(inputs) == 6 and inputs[-1].meta["val"].dtype == torch.int64  # 2 weights, 2 biases, x, handle
        read, step = torch.ops.fp8fx.delayed_scales.default, torch.ops.fp8fx.delayed_scale_steps.default
        reads = [n for n in forward.graph.nodes if n.target == read]
        assert len(reads) == 1 and reads[0].args[0] is inputs[-1] and len(reads[0].args[1].split("\n")) == 4  # x, w0, x1, w1
        assert next(n for n in forward.graph.nodes if n.op != "placeholder") is reads[0]
        # Backward reads its gradients' states itself (the handle is saved), before it steps them.
        order = [n for n in backward.graph.nodes if n.target in (read, step)]
        assert [n.target for n in order] == [read, step] and len(order[0].args[1].split("\n")) == 2


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _Checkpointed(nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        self.blocks, self.checkpointed = nn.ModuleList([_Block(), _Block()]), checkpointed

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x


def _checkpointed_training(checkpointed: bool):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = fp8fx.prepare(_Checkpointed(checkpointed))
    compiled = torch.compile(model, backend=fp8fx.backend(Policy.from_recipe("delayed", amax_history_len=4), inner="eager"))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        model.zero_grad()
        compiled(torch.randn(8, 32, generator=gen) * 3).square().mean().backward()
    states = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("fp8fx_state.")}
    return [p.grad.clone() for p in model.parameters()], states


def test_activation_checkpointing_steps_each_state_once_per_step():
    """torch's activation checkpointing recomputes forward in backward; the state updates are not
    recomputed: the states and gradients are those of the same model without checkpointing."""
    grads, states = _checkpointed_training(checkpointed=False)
    ac_grads, ac_states = _checkpointed_training(checkpointed=True)
    assert len(states) == 4 * 12 and states.keys() == ac_states.keys()
    assert all(v.item() == 3 for k, v in ac_states.items() if k.endswith(".steps"))
    assert all(torch.equal(states[k], ac_states[k]) for k in states)
    assert all(torch.equal(a, b) for a, b in zip(grads, ac_grads))


def test_state_ops_name_what_they_cannot_find():
    """A handle whose instance is gone, and a key the instance does not hold: one clear error each."""
    from fp8fx.compiler.state import StateInstance
    from fp8fx.ops import delayed

    with pytest.raises(RuntimeError, match="handle 1000000000 names no live model instance"):
        torch.ops.fp8fx.delayed_scales(torch.tensor([10**9]), "a.output.input", torch.device("cpu"))
    model = fp8fx.prepare(nn.Linear(4, 4))
    model.fp8fx_state.ensure("blocks.0.a.output.input", 4, torch.device("cpu"))
    instance = StateInstance(model.fp8fx_state, {"a.output.input": "blocks.0.a.output.input"})
    handle = delayed.register(instance)
    assert [v.item() for v in torch.ops.fp8fx.delayed_scales(handle, "a.output.input", torch.device("cpu"))] == [1.0, 1.0]
    with pytest.raises(RuntimeError, match="no delayed-scaling state 'b.output.input'"):
        torch.ops.fp8fx.delayed_scales(handle, "a.output.input\nb.output.input", torch.device("cpu"))


@pytest.mark.parametrize("calibrate", [False, True])
@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_evaluation_reads_the_scales_and_updates_them_only_when_calibrating(inner, calibrate):
    """A graph compiled without autograd (eval mode under no_grad) casts with the delayed scales
    and leaves the state as training left it, as TransformerEngine updates only with grad
    enabled; `calibrate: true` makes it record amaxes and update (a calibration run)."""
    torch.manual_seed(0)
    model = fp8fx.prepare(nn.Linear(32, 16))
    policy = Policy.from_recipe("delayed", amax_history_len=4, calibrate=calibrate)
    compiled = torch.compile(model, backend=fp8fx.backend(policy, inner=inner))
    compiled(torch.randn(8, 32)).sum().backward()
    state = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("fp8fx_state.")}
    trained_scale = fp8fx.report(compiled).find(role="output")[0].scale
    model.eval()
    with torch.no_grad():
        out = compiled(100 * torch.randn(8, 32))
    assert torch.isfinite(out).all()
    changed = {k for k, v in model.state_dict().items() if k in state and not torch.equal(v, state[k])}
    scale = fp8fx.report(compiled).find(role="output")[0].scale
    if calibrate:  # the input's history, scale and step count; the weight's history and step count
        assert len(changed) == 5 and scale[0] < trained_scale[0] / 50
    else:
        assert not changed and scale == trained_scale


def test_calibrate_needs_delayed_scaling():
    with pytest.raises(fp8fx.PolicyError, match=r"calibrate: true needs delayed scaling"):
        Policy.from_recipe("tensorwise", calibrate=True)


class _States:
    """A delayed-scaling instance (`fp8fx.ops.delayed.register`) holding plain states by key."""

    def __init__(self, specs: dict[str, int]):
        self.states = {
            key: SimpleNamespace(
                amax_history=torch.zeros(length),
                scale=torch.ones(()),
                steps=torch.zeros((), dtype=torch.int64),
                non_finite=torch.zeros((), dtype=torch.int64),
            )
            for key, length in specs.items()
        }

    def state(self, key):
        return self.states[key]


def test_batched_steps_match_one_state_at_a_time_in_a_fixed_number_of_ops():
    """`delayed_scale_steps` on states of mixed settings and history lengths (generated), with
    partial amaxes holding zeros, infs and NaNs, leaves every state bit for bit where
    `delayed_scale_update` one state at a time does; and its tensor ops (a GPU's kernels) grow with
    the states by one reduction of each state's amax, not by a whole update each."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fp8fx.ops import delayed

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    settings = list(itertools.product([448.0, 57344.0], [0, 2], [False, True], [False, True], [1, 3], [1, 4]))
    ops_per_call = []
    for n_states in (len(settings), 2 * len(settings)):
        chosen = [settings[i % len(settings)] for i in range(n_states)]
        keys = [f"layer{i}.output.input" for i in range(n_states)]
        batched, single = _States(dict(zip(keys, (s[-1] for s in chosen)))), _States(dict(zip(keys, (s[-1] for s in chosen))))
        handle = delayed.register(batched)
        for _ in range(6):
            amaxes = []
            for _ in keys:
                rows = torch.rand(int(torch.randint(1, 5, (), generator=gen)), generator=gen) * 2.0 ** int(
                    torch.randint(-20, 20, (), generator=gen)
                )
                pick = torch.rand(rows.shape, generator=gen)
                rows = torch.where(
                    pick < 0.1, torch.tensor(float("nan")), torch.where(pick < 0.2, torch.tensor(float("inf")), rows)
                )
                amaxes.append(torch.where(pick > 0.9, torch.zeros(()), rows))
            columns = [list(c) for c in zip(*(s[:-1] for s in chosen))]
            torch.ops.fp8fx.delayed_scale_steps(handle, "\n".join(keys), amaxes, *columns)
            for key, amax, setting in zip(keys, amaxes, chosen):
                s = single.state(key)
                updated = ops.delayed_scale_update(s.amax_history, s.scale, s.steps, s.non_finite, amax.amax(), *setting[:-1])
                s.amax_history, s.scale, s.steps, s.non_finite = updated
                b = batched.state(key)
                for got, want in zip((b.amax_history, b.scale, b.steps, b.non_finite), updated):
                    assert torch.equal(got, want), key
        counter = CountOps()
        with counter:  # the op's body, whose tensor ops the mode sees one by one
            delayed.delayed_scale_steps._init_fn(handle, "\n".join(keys), amaxes, *columns)
        ops_per_call.append(counter.ops)
    # Each setting is a group of its own; doubling the states adds to each group one state, whose
    # amax is reduced and whose handle is read (a CPU tensor's element: two ops).
    assert ops_per_call[1] - ops_per_call[0] <= 3 * len(settings)
    assert ops_per_call[0] <= 70 * len(settings)  # a group's update, stacks and copies back
