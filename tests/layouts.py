"""Generated layout cases for the fp8fx ops: every op's real outputs against its fake's.

Inductor checks each fallback op's real output against its fake (`assert_size_stride` in the code
it generates) and eager code can `view` an output as its fake says it is laid out, so a real
implementation that returns another layout breaks real models on the device that runs it. The
checks here run the real implementations (the CPU reference, and under Triton's interpreter the
code a GPU runs) on inputs laid out as graphs hand them over: contiguous, transposed, permuted
N-D, sliced, a slice of a transposed tensor, and broadcast.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch
from torch._C._dynamo.guards import assert_size_stride
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LAYOUTS = ("contiguous", "transposed", "permuted", "sliced", "transposed_slice", "broadcast")


def laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """`values` (any shape, rank >= 2) as a tensor of the same values with `layout`'s strides."""
    shape = values.shape
    if layout == "contiguous":
        return values.contiguous()
    if layout == "transposed":  # the last two dims swapped in memory (a weight's .t())
        return values.transpose(-2, -1).contiguous().transpose(-2, -1)
    if layout == "permuted":  # [B, H, S, D] stored as [B, S, H, D] (attention's output); 2-D: transposed
        dims = (0, 1) if values.dim() == 2 else (1, 2)
        return values.transpose(*dims).contiguous().transpose(*dims)
    if layout == "sliced":  # rows longer than the tensor's last dim: not dense
        wide = values.new_zeros(*shape[:-1], shape[-1] + 16)
        return wide[..., : shape[-1]].copy_(values)
    if layout == "transposed_slice":  # a slice of a transposed tensor: permuted and not dense
        wide = values.new_zeros(*shape[:-2], shape[-1], shape[-2] + 8).transpose(-2, -1)
        return wide[..., : shape[-2], :].copy_(values)
    if layout == "broadcast":  # the first dim a broadcast of one slice (stride 0)
        return values[:1].expand(shape)
    raise ValueError(layout)


def fake_outputs(op: Callable, args: tuple, kwargs: dict) -> list:
    mode = FakeTensorMode()
    fake_args, fake_kwargs = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, (args, kwargs))
    with mode:
        return tree_flatten(op(*fake_args, **fake_kwargs))[0]


def check_layout(op: Callable, impl: Callable, args: tuple, kwargs: dict | None = None, what: str = "") -> None:
    """`impl(*args)` (a real implementation of `op`) returns what `op`'s fake promises: the same
    sizes, strides (as Inductor's `assert_size_stride` compares them) and dtypes, and tensors that
    share no memory with the inputs or each other (custom ops' outputs may not alias)."""
    kwargs = kwargs or {}
    real = tree_flatten(impl(*args, **kwargs))[0]
    fake = fake_outputs(op, args, kwargs)
    assert len(real) == len(fake), what
    inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.numel()}
    seen = set()
    for i, (r, f) in enumerate(zip(real, fake)):
        where = f"{what}: output {i}"
        assert r.dtype == f.dtype, f"{where}: dtype {r.dtype}, fake {f.dtype}"
        try:
            assert_size_stride(r, tuple(f.shape), tuple(f.stride()))
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None
        if r.numel():
            ptr = r.untyped_storage().data_ptr()
            assert ptr not in inputs and ptr not in seen, f"{where} aliases an input or another output"
            seen.add(ptr)


def scaled(x: torch.Tensor, dtype: torch.dtype, block: list[int], layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x cast to `dtype` with `block` scales (exact reference), the FP8 tensor laid out as `layout`."""
    from fp8fx.ops import reference

    scale = reference.amax_to_scale(reference.amax(x, block), torch.finfo(dtype).max, 0, False)
    return laid_out(reference.cast(x, scale, dtype, block), layout), scale.reciprocal()


# (shape, block): the casts graphs make (activations N-D tensorwise or by rows; operands 2-D any
# block), with a partial 128-block
CAST_CASES = [
    ((24, 136), block) for block in ([], [1, 0], [0, 1], [1, 128], [128, 128], [128, 1])
] + [((2, 3, 5, 136), block) for block in ([], [1, 0], [1, 128])]  # fmt: skip

# (a block, b block, (m, n, k)): tensorwise, rowwise, blockwise GEMMs; sizes not multiples of 16
GEMM_CASES = [([], [], (40, 48, 64)), ([1, 0], [0, 1], (40, 56, 64)), ([1, 128], [128, 128], (40, 136, 256)), ([1, 128], [128, 1], (24, 48, 256))]


def cast_cases(layouts=LAYOUTS, seed: int = 0) -> Iterator[tuple[str, tuple]]:
    """(name, fp8fx::cast's arguments) for every cast case, layout and FP8 format."""
    from fp8fx.ops import reference

    g = torch.Generator().manual_seed(seed)
    for (shape, block), layout, dtype in itertools.product(CAST_CASES, layouts, (E4M3, E5M2)):
        x = laid_out(torch.randn(shape, generator=g), layout)
        scale = reference.amax_to_scale(reference.amax(x, block), torch.finfo(dtype).max, 0, False)
        yield f"cast {shape} block={block} {layout} {dtype}", (x, scale, dtype, block)


def gemm_operands(blocks, mnk, a_layout: str, b_layout: str, seed: int = 0):
    """(a, b, scale_inv_a, scale_inv_b): E4M3 operands of an [m, k] @ [k, n] GEMM with the given layouts."""
    g = torch.Generator().manual_seed(seed)
    m, n, k = mnk
    a, sa = scaled(torch.randn(m, k, generator=g), E4M3, blocks[0], a_layout)
    b, sb = scaled(torch.randn(k, n, generator=g), E4M3, blocks[1], b_layout)
    return a, b, sa, sb


OPERAND_LAYOUTS = ("contiguous", "transposed", "sliced", "transposed_slice")
