"""fp8fx::fp8_grouped_mm under Triton's interpreter runs the generated grouped kernel (as a GPU
runs it) with the scales the graph makes; it must agree with the exact emulation."""

from __future__ import annotations

import pytest
import torch
from helpers import sqnr

from fp8fx.codegen import launch, versions
from fp8fx.core import grouped
from fp8fx.core.recipes import GRANULARITIES, Granularity
from fp8fx.ops import reference

pytestmark = pytest.mark.skipif(not launch.interpreter_active(), reason="needs TRITON_INTERPRET=1 before import")
ops = torch.ops.fp8fx


def _cast(x, offs, form, side, block, dtype):
    """One operand cast as the graph casts it: MX blocks (32 along K) take power-of-two scales."""
    spec = grouped.operand_scales(form, side, block)
    fmax = torch.finfo(dtype).max
    if spec.per_group:
        scale = ops.amax_to_scale(ops.grouped_amax(x, offs, spec.group_dim, spec.lines), fmax, 0, False)
        return ops.grouped_cast(x, scale, offs, spec.group_dim, dtype), scale.reciprocal()
    scale = ops.amax_to_scale(ops.amax(x, list(spec.block)), fmax, 0, 32 in tuple(block))
    return ops.cast(x, scale, dtype, list(spec.block)), scale.reciprocal()


@pytest.mark.parametrize("form", ["2d-3d", "2d-2d"])
@pytest.mark.parametrize("granularity", [Granularity.TENSORWISE, Granularity.ROWWISE])
def test_grouped_op_runs_the_generated_kernel_like_the_emulation(form, granularity):
    torch.manual_seed(0)
    offs = torch.tensor([5, 5, 42, 64], dtype=torch.int32)
    if form == "2d-3d":  # forward / dgrad: E5M2 gradient rows by E4M3 expert matrices
        a, b, dtypes = torch.randn(64, 32), torch.randn(4, 32, 48), (torch.float8_e5m2, torch.float8_e4m3fn)
    else:  # wgrad: groups along K
        a, b, dtypes = torch.randn(32, 64), torch.randn(64, 48), (torch.float8_e4m3fn, torch.float8_e5m2)
    blocks = GRANULARITIES[granularity].blocks(("input", "weight"))
    (qa, sa), (qb, sb) = (
        _cast(x, offs, form, side, block, dtype) for side, (x, block, dtype) in enumerate(zip((a, b), blocks, dtypes))
    )
    args = (qa, qb, sa, sb, offs, torch.float32, list(blocks[0]), list(blocks[1]))
    # fp32 accumulation in both; only the summation order differs
    assert sqnr(ops.fp8_grouped_mm(*args), reference.fp8_grouped_mm(*args)) > 100


@pytest.mark.parametrize("form", ["2d-3d", "2d-2d"])
@pytest.mark.parametrize("granularity", [Granularity.MX, Granularity.BLOCKWISE])
def test_grouped_op_promotes_k_blocks_in_the_generated_kernel(form, granularity, monkeypatch):
    """Scales in blocks along K (MX's 1 x 32, blockwise's 1 x 128 with 128 x 128 weights): each
    K window's product is promoted with its blocks' scales. In 2-D x 2-D the graph pads every group
    to whole blocks (`fp8fx::pad_groups`), so the offsets here are multiples of the block."""
    torch.manual_seed(1)
    kb = GRANULARITIES[granularity].left[1]
    if form == "2d-3d":  # uneven row groups, one empty; K with a partial last block
        offs = torch.tensor([5, 5, 42, 64], dtype=torch.int32)
        a, b, roles = torch.randn(64, 3 * kb // 2), torch.randn(4, 3 * kb // 2, 48), ("input", "weight")
    else:
        offs = torch.tensor([kb, kb, 3 * kb, 4 * kb], dtype=torch.int32)
        a, b, roles = torch.randn(32, 4 * kb), torch.randn(4 * kb, 48), ("grad_output", "input")
    dtypes = (
        (torch.float8_e4m3fn, torch.float8_e4m3fn)
        if granularity is Granularity.BLOCKWISE
        else (torch.float8_e5m2, torch.float8_e4m3fn)
    )
    blocks = GRANULARITIES[granularity].blocks(roles)
    (qa, sa), (qb, sb) = (
        _cast(x, offs, form, side, block, dtype) for side, (x, block, dtype) in enumerate(zip((a, b), blocks, dtypes))
    )
    args = (qa, qb, sa, sb, offs, torch.float32, list(blocks[0]), list(blocks[1]))
    launched = []
    real = launch.grouped_fp8_gemm

    def recorded(*a, **kw):
        launched.append((kw.get("block_a"), kw.get("block_b")))
        return real(*a, **kw)

    monkeypatch.setattr(launch, "grouped_fp8_gemm", recorded)
    out = ops.fp8_grouped_mm(*args)
    assert launched == [blocks]
    assert sqnr(out, reference.fp8_grouped_mm(*args)) > 100


@pytest.mark.parametrize("form", ["2d-3d", "2d-2d"])
@pytest.mark.parametrize("block_scaled", [True, False], ids=["block_scaled_mma", "promoted"])
def test_mx_grouped_gemm_on_both_kernel_paths(form, block_scaled):
    """MX blocks run on the block-scaled MMA on Blackwell (the default under the interpreter, from
    Triton 3.8 on) and promote each 32-K window elsewhere (Hopper): both against the exact emulation."""
    if block_scaled and not versions.has("interpreter_dot_scaled"):
        pytest.skip(versions.reason("interpreter_dot_scaled"))
    torch.manual_seed(2)
    if form == "2d-3d":
        offs = torch.tensor([7, 7, 50, 64], dtype=torch.int32)
        a, b, roles = torch.randn(64, 200), torch.randn(4, 200, 40), ("input", "weight")  # K ends inside a block
    else:
        offs = torch.tensor([32, 32, 160, 192], dtype=torch.int32)
        a, b, roles = torch.randn(24, 192), torch.randn(192, 40), ("grad_output", "input")
    blocks = GRANULARITIES[Granularity.MX].blocks(roles)
    dtypes = (torch.float8_e4m3fn, torch.float8_e5m2)
    (qa, sa), (qb, sb) = (
        _cast(x, offs, form, side, block, dtype) for side, (x, block, dtype) in enumerate(zip((a, b), blocks, dtypes))
    )
    out = launch.grouped_fp8_gemm(
        qa, qb, sa, sb, offs, torch.float32, block_a=blocks[0], block_b=blocks[1], block_scaled=block_scaled
    )
    expected = reference.fp8_grouped_mm(qa, qb, sa, sb, offs, torch.float32, list(blocks[0]), list(blocks[1]))
    assert sqnr(out, expected) > 100


def test_block_scaled_mma_takes_mx_blocks_only():
    offs = torch.tensor([64], dtype=torch.int32)
    blocks = GRANULARITIES[Granularity.BLOCKWISE].blocks(("input", "weight"))
    (qa, sa), (qb, sb) = (
        _cast(x, offs, "2d-3d", side, block, torch.float8_e4m3fn)
        for side, (x, block) in enumerate(zip((torch.randn(64, 128), torch.randn(1, 128, 32)), blocks))
    )
    with pytest.raises(ValueError, match=r"the block-scaled MMA takes MX blocks \(1, 32\) x \(32, 1\)"):
        launch.grouped_fp8_gemm(qa, qb, sa, sb, offs, block_a=blocks[0], block_b=blocks[1], block_scaled=True)
