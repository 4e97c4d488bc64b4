"""fp8fx with PyTorch's own distributed engines: FP8 all-gather of weights under FSDP2.

`enable_fp8_all_gather(model, policy)` is called before `fully_shard`. It wraps the weight of
every `nn.Linear` whose FP8 GEMMs cast the weight with dynamic tensorwise scaling in
`Fp8AllGatherWeight`, a tensor subclass that implements FSDP2's all-gather extension: each rank
casts its shard to FP8 with a scale taken from the amax reduced (max) over the data-parallel
group, so all ranks use one scale, and 1 byte per element crosses the wire instead of 2 (BF16)
or 4 (fp32). After the all-gather each rank dequantizes to the parameter dtype; the compiled
graph's own cast of that weight recomputes the same scale and lands on the same FP8 values, so
the GEMMs see exactly the weights an unsharded run would cast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from fp8fx.formats import Fp8Format, saturating_cast
from fp8fx.passes.assign_precision import ALIGN
from fp8fx.policy import Policy, Precision, Scaling, Granularity, load_policy
from fp8fx.scaling import amax_to_scale, tensor_amax

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
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad,
        )  # fmt: skip

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
        amax = tensor_amax(self._tensor)
        if mesh.size() > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        scale = amax_to_scale(amax, s.fmt.max, s.margin, s.power_of_two)
        data = saturating_cast(self._tensor.float() * scale, s.fmt)
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 pads uneven shards to ceil(rows / world)
        if data.shape[0] != rows:
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        # As bytes: collectives (gloo among them) need not know the FP8 dtypes.
        return (data.view(torch.uint8),), (scale,)

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *, out=None):  # noqa: ANN001
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
    op = "addmm" if module.bias is not None else "mm"
    res = policy.resolve((name,), op)
    where = res.source if res.rule_index is None else f"{res.source} (match {policy.rules[res.rule_index].match!r})"
    s = res.settings
    if op not in s.ops and not res.forced_fp8:
        return f"op {op} is not in defaults.ops", None
    if s.gemms.output is Precision.HIGH and s.gemms.grad_input is Precision.HIGH:
        return f"{where}: the weight's GEMMs (output, grad_input) are high precision", None
    if any(dim % ALIGN for dim in module.weight.shape):
        return f"weight shape {tuple(module.weight.shape)} is not a multiple of {ALIGN}: its GEMMs stay high", None
    if s.scaling is not Scaling.DYNAMIC:
        return f"{where}: {s.scaling.value} scaling casts with the scale of its amax history, not the weight's own amax", None
    if s.granularity is not Granularity.TENSORWISE:
        return f"{where}: {s.granularity.value} weight scales would quantize the gathered FP8 weight a second time", None
    return None, AllGatherScaling(s.format.operand_format("weight"), s.margin, s.power_of_two_scales)


def enable_fp8_all_gather(model: nn.Module, policy: Policy | str | None = None) -> list[AllGatherDecision]:
    """Make FSDP2 all-gather the FP8-cast linear weights of `model` in FP8. Call before `fully_shard`.

    `policy` is the one the model is compiled with (default: fp8fx's default policy). A weight
    is gathered in FP8 when its site runs the output or grad_input GEMM in FP8 with dynamic
    tensorwise scaling; every linear gets a decision with its reason."""
    if policy is None:
        policy = Policy()
    elif isinstance(policy, str):
        policy = load_policy(policy)
    decisions = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if isinstance(module.weight, Fp8AllGatherWeight):
            decisions.append(AllGatherDecision(name, True, "already gathered in FP8"))
            continue
        if type(module.weight) is not nn.Parameter or type(module.weight.data) is not torch.Tensor:
            raise ValueError(f"fp8fx: {name}.weight is a {type(module.weight.data).__name__}; call enable_fp8_all_gather before fully_shard")
        problem, scaling = _fp8_all_gather_problem(policy, name, module)
        if problem is not None:
            decisions.append(AllGatherDecision(name, False, problem))
            continue
        module.weight = nn.Parameter(Fp8AllGatherWeight(module.weight.data, scaling), requires_grad=module.weight.requires_grad)
        decisions.append(AllGatherDecision(name, True, f"{scaling.fmt.value}, tensorwise scale from the amax over the group"))
    return decisions
