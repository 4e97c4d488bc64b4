"""fp8fx with PyTorch's own distributed engines: FP8 all-gather of weights under FSDP2, FP8
gradient reduction for FSDP2 (a reduce-scatter) and DDP (a comm hook), and MS-AMP's precision
levels built from them (`shard_with_level`, `ddp_with_level`).

`enable_fp8_all_gather(model, policy)` is called before `fully_shard`. It wraps the weight of
every `nn.Linear` whose output and grad_input GEMMs both cast the weight with dynamic tensorwise scaling in
`Fp8AllGatherWeight`, a tensor subclass that implements FSDP2's all-gather extension: each rank
casts its shard to FP8 with a scale taken from the amax reduced (max) over the data-parallel
group, so all ranks use one scale, and 1 byte per element crosses the wire instead of 2 (BF16)
or 4 (fp32). After the all-gather each rank dequantizes to the parameter dtype; the compiled
graph's own cast of that weight recomputes the same scale and lands on the same FP8 values, so
the GEMMs see exactly the weights an unsharded run would cast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from fp8fx.core.formats import Fp8Format
from fp8fx.core.policy import Policy
from fp8fx.core.policy_yaml import as_policy
from fp8fx.core.recipes import Granularity, Level, Scaling
from fp8fx.ops import reference
from fp8fx.passes.annotation import ReasonKind
from fp8fx.passes.assign_precision import ALIGN, policy_decision
from fp8fx.runtime.optim import Fp8AdamW

# Ops FSDP2 uses to shard, pad and copy a parameter: their results stay wrapped. Everything else
# (optimizer arithmetic, reductions) sees the plain high-precision tensor.
_KEEP_WRAPPED = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.chunk.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
}


@dataclass(frozen=True)
class AllGatherScaling:
    fmt: Fp8Format = Fp8Format.E4M3
    margin: int = 0
    power_of_two: bool = False


class Fp8AllGatherWeight(torch.Tensor):
    """A high-precision weight that FSDP2 all-gathers in FP8 (see the module docstring)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, scaling: AllGatherScaling):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, scaling: AllGatherScaling):
        self._tensor = tensor
        self._scaling = scaling

    def __repr__(self) -> str:
        return f"Fp8AllGatherWeight({self._scaling.fmt.value}, {self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        scalings = set()

        def unwrap(t: Fp8AllGatherWeight) -> torch.Tensor:
            scalings.add(t._scaling)
            return t._tensor

        args, kwargs = pytree.tree_map_only(Fp8AllGatherWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_WRAPPED:
            return out
        (scaling,) = scalings
        return pytree.tree_map_only(torch.Tensor, lambda t: Fp8AllGatherWeight(t, scaling), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._scaling

    @staticmethod
    def __tensor_unflatten__(inner: dict, scaling: AllGatherScaling, outer_size, outer_stride):  # noqa: ANN001
        return Fp8AllGatherWeight(inner["_tensor"], scaling)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):  # noqa: ANN001 - FSDP2's signature
        """Cast this rank's shard to FP8 with the group's scale; send its bytes."""
        s = self._scaling
        amax = reference.amax(self._tensor, [])
        if mesh.size() > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        scale = reference.amax_to_scale(amax, s.fmt.max, s.margin, s.power_of_two)
        data = reference.cast(self._tensor, scale, s.fmt.dtype, [])
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 pads uneven shards to ceil(rows / world)
        if data.shape[0] != rows:
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        # As bytes: collectives (gloo among them) need not know the FP8 dtypes.
        return (data.view(torch.uint8),), (scale,)

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out=None,  # noqa: ANN001
    ):
        """Dequantize the gathered FP8 weight to the parameter dtype (into `out` when FSDP2 reuses it)."""
        (data,), (scale,) = outputs, metadata
        weight = (data.view(self._scaling.fmt.dtype).float() * scale.reciprocal()).to(param_dtype)
        if out is not None:  # a re-gather (backward): autograd saved `out`, so keep its version as FSDP2 does
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.view(-1).copy_(weight.view(-1)[: out.numel()])
            return None
        return weight, (weight,)


@dataclass(frozen=True)
class AllGatherDecision:
    """Whether a linear's weight is all-gathered in FP8, and why (or why not)."""

    name: str
    fp8: bool
    reason: str


def _fp8_all_gather_problem(policy: Policy, name: str, module: nn.Linear) -> tuple[str | None, AllGatherScaling | None]:
    """Why the linear's weight cannot be gathered in FP8, or how it is cast: from the decisions the
    passes will make for the two GEMMs that read the weight (`policy_decision`)."""
    kind = "addmm" if module.bias is not None else "mm"
    out_features, in_features = module.weight.shape
    reads = {"output": ("input", "weight"), "grad_input": ("grad_output", "weight")}
    decisions = {
        role: policy_decision(policy, (name,), kind, role, roles, (out_features, in_features)) for role, roles in reads.items()
    }
    out = decisions["output"]
    if any(d.reason_kind is ReasonKind.OP_KIND for d in decisions.values()):
        return out.reason, None
    high = [role for role, d in decisions.items() if d.reason_kind is ReasonKind.POLICY and not d.fp8]
    if high:  # a high-precision GEMM must see the weight itself, not its FP8 rounding
        where = decisions[high[0]].source
        return (
            f"{where}: the weight's {' and '.join(high)} {'GEMMs run' if len(high) > 1 else 'GEMM runs'} in high precision",
            None,
        )
    if any(d.reason_kind is ReasonKind.SHAPE for d in decisions.values()):
        return f"weight shape {tuple(module.weight.shape)} is not a multiple of {ALIGN}: its GEMMs stay high", None
    if out.scaling is not Scaling.DYNAMIC:
        return (
            f"{out.source}: {out.scaling.value} scaling casts with the scale of its amax history, not the weight's own amax",
            None,
        )
    if out.granularity is not Granularity.TENSORWISE:
        return f"{out.source}: {out.granularity.value} weight scales would quantize the gathered FP8 weight a second time", None
    return None, AllGatherScaling(out.formats[1], out.margin, out.power_of_two)


def enable_fp8_all_gather(model: nn.Module, policy: Policy | str | Path | None = None) -> list[AllGatherDecision]:
    """Make FSDP2 all-gather the FP8-cast linear weights of `model` in FP8. Call before `fully_shard`.

    `policy` is the one the model is compiled with (default: fp8fx's default policy). A weight
    is gathered in FP8 when its site runs both GEMMs that read it (output and grad_input) in FP8
    with dynamic tensorwise scaling; every linear gets a decision with its reason."""
    policy = as_policy(policy, "fp8fx.distributed.enable_fp8_all_gather")
    decisions = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if isinstance(module.weight, Fp8AllGatherWeight):
            decisions.append(AllGatherDecision(name, True, "already gathered in FP8"))
            continue
        if type(module.weight) is not nn.Parameter or type(module.weight.data) is not torch.Tensor:
            raise ValueError(
                f"fp8fx: {name}.weight is a {type(module.weight.data).__name__}; call enable_fp8_all_gather before fully_shard"
            )
        problem, scaling = _fp8_all_gather_problem(policy, name, module)
        if problem is not None:
            decisions.append(AllGatherDecision(name, False, problem))
            continue
        module.weight = nn.Parameter(Fp8AllGatherWeight(module.weight.data, scaling), requires_grad=module.weight.requires_grad)
        decisions.append(AllGatherDecision(name, True, f"{scaling.fmt.value}, tensorwise scale from the amax over the group"))
    return decisions


# FP8 gradient reduction. Gradients are quantized to E4M3 in blocks of GRAD_BLOCK elements of the
# flat buffer (one fp32 scale each: 1.6% on top of the FP8 bytes), so a block never mixes the range
# of two tensors by much and no scale has to agree across ranks: each rank dequantizes what it
# receives with the sender's scales and sums in fp32. A reduce-scatter is an all-to-all of FP8
# chunks; an all-reduce adds an all-gather of the reduced chunks, re-quantized.
GRAD_BLOCK = 256
GRAD_FORMAT = Fp8Format.E4M3


def _quantize_blocks(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> FP8 bytes [R, C'] and scales [R, C' / GRAD_BLOCK], C' = C rounded up to a block."""
    pad = -rows.shape[1] % GRAD_BLOCK
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    block = [1, GRAD_BLOCK]
    scale = reference.amax_to_scale(reference.amax(rows, block), GRAD_FORMAT.max, 0, False)
    return reference.cast(rows, scale, GRAD_FORMAT.dtype, block).view(torch.uint8), scale


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, group) -> None:  # noqa: ANN001, A002
    """`dist.all_gather_single` where torch has it (2.13, which deprecates the older name), else the
    same collective as `dist.all_gather_into_tensor` (torch 2.11)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def _dequantize_blocks(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    blocks = data.view(GRAD_FORMAT.dtype).float().view(data.shape[0], -1, GRAD_BLOCK)
    return (blocks / scale.unsqueeze(-1)).view(data.shape)


class Fp8GradientComm:
    """Reduce-scatter and all-reduce of fp32/bf16 gradient buffers with FP8 on the wire.
    `bytes_sent` counts what this rank put into collectives."""

    def __init__(self):
        self.bytes_sent = 0

    def _exchange(self, chunks: torch.Tensor, group) -> torch.Tensor:  # noqa: ANN001
        """Sum over ranks of chunk r of every rank's [W, S] buffer, on rank r (fp32, padded)."""
        data, scale = _quantize_blocks(chunks)
        data_in, scale_in = torch.empty_like(data), torch.empty_like(scale)
        dist.all_to_all_single(data_in, data, group=group)
        dist.all_to_all_single(scale_in, scale, group=group)
        self.bytes_sent += data.numel() + scale.numel() * scale.element_size()
        return _dequantize_blocks(data_in, scale_in).sum(0)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group, average: bool) -> None:  # noqa: ANN001, A002
        world = group.size()
        total = self._exchange(input.view(world, -1), group)[: output.numel()]
        output.copy_(total.div_(world) if average else total)

    def all_reduce(self, buffer: torch.Tensor, group, average: bool) -> None:  # noqa: ANN001
        world = group.size()
        flat = torch.nn.functional.pad(buffer.view(-1), (0, -buffer.numel() % world))
        mine = self._exchange(flat.view(world, -1), group)
        if average:
            mine.div_(world)
        data, scale = _quantize_blocks(mine.unsqueeze(0))
        all_data = data.new_empty(world, *data.shape[1:])
        all_scale = scale.new_empty(world, *scale.shape[1:])
        _all_gather_single(all_data, data, group)
        _all_gather_single(all_scale, scale, group)
        self.bytes_sent += data.numel() + scale.numel() * scale.element_size()
        reduced = _dequantize_blocks(all_data, all_scale)[:, : flat.numel() // world].reshape(-1)
        buffer.view(-1).copy_(reduced[: buffer.numel()])


class Fp8ReduceScatter:
    """FSDP2's gradient reduce-scatter in FP8: `module.set_custom_reduce_scatter(Fp8ReduceScatter())`
    after `fully_shard(module)`. Sharded gradients keep FSDP2's reduce dtype."""

    def __init__(self, comm: Fp8GradientComm | None = None):
        self.comm = comm or Fp8GradientComm()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # noqa: ANN001
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):  # noqa: ANN001 - FSDP2's signature
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise NotImplementedError(
                f"fp8fx: FP8 reduce-scatter supports SUM and AVG, not {op} (FSDP2's gradient divide factor)"
            )
        self.comm.reduce_scatter(output_tensor, input_tensor, group, average=op == dist.ReduceOp.AVG)
        return None


def fp8_allreduce_hook(comm: Fp8GradientComm, bucket):  # noqa: ANN001, ANN201 - DDP checks the annotations as objects
    """DDP's gradient all-reduce (averaged, as DDP's own) in FP8:
    `ddp.register_comm_hook(Fp8GradientComm(), fp8_allreduce_hook)`."""
    buffer = bucket.buffer()
    comm.all_reduce(buffer, dist.group.WORLD, average=True)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


# MS-AMP's precision levels, on PyTorch's engines.
@dataclass
class LevelSetup:
    """What a precision level set up: the gradient communicator (its `bytes_sent`), the FP8
    all-gather decisions (O3), and the optimizer the level trains with."""

    level: Level
    comm: Fp8GradientComm
    all_gather: list[AllGatherDecision]

    def optimizer(self, params, **kwargs: Any) -> torch.optim.Optimizer:  # noqa: ANN001
        """AdamW for O1; `Fp8AdamW` (FP8 first moment, FP16 second) for O2 and O3."""
        return torch.optim.AdamW(params, **kwargs) if self.level is Level.O1 else Fp8AdamW(params, **kwargs)


def _level_of(policy: Policy) -> Level:
    if policy.level is None:
        raise ValueError("fp8fx: the policy sets no `level`; add `level: O1|O2|O3` at its top level")
    return policy.level


def shard_with_level(model: nn.Module, units: list[nn.Module], policy: Policy) -> LevelSetup:
    """`fully_shard` each of `units` (the repeated blocks, ...) and then `model` with FSDP2, at the
    policy's level: O1 and O2 gather weights as FP16 compute copies and reduce gradients in FP8
    (the sharded masters keep their dtype); O3 also stores the sharded master weights in FP16 and
    all-gathers the linears' weights in FP8. Compile the units with fp8fx before or after."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    level = _level_of(policy)
    decisions = []
    if level is Level.O3:  # FSDP2 wants one dtype per unit: every master weight in FP16
        model.to(torch.float16)
        decisions = enable_fp8_all_gather(model, policy)
    comm = Fp8GradientComm()
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for module in [*units, model]:
        fully_shard(module, mp_policy=mp_policy)
        module.set_custom_reduce_scatter(Fp8ReduceScatter(comm))
    return LevelSetup(level, comm, decisions)


def ddp_with_level(model: nn.Module, policy: Policy, **ddp_kwargs: Any) -> tuple[nn.Module, LevelSetup]:
    """`DistributedDataParallel(model)` at the policy's level: gradients all-reduced in FP8 (O1, O2),
    `Fp8AdamW` from `setup.optimizer` (O2). Weights keep their dtype (no master copy to keep them
    in); O3 shards master weights and needs FSDP2 (`shard_with_level`)."""
    from torch.nn.parallel import DistributedDataParallel

    level = _level_of(policy)
    if level is Level.O3:
        raise ValueError(
            "fp8fx: level O3 keeps sharded FP16 master weights and FP8 weight all-gathers: use FSDP2 "
            "(fp8fx.distributed.shard_with_level)"
        )
    ddp = DistributedDataParallel(model, **ddp_kwargs)
    comm = Fp8GradientComm()
    ddp.register_comm_hook(comm, fp8_allreduce_hook)
    return ddp, LevelSetup(level, comm, [])
