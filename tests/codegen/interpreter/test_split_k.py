"""Split-K (`fp8fx.codegen.variants.split_k`): partial sums of K ranges in an fp32 workspace, then
`split_k_reduce_kernel` adds them in split order and runs the scales and the epilogue once. Run by
Triton's interpreter through the launcher a GPU uses, against the exact CPU reference.

The interpreter's rule splits a GEMM of one 32 x 32 tile (3 "SMs") whose K is 512 or more; the
shapes below have ragged K (not a multiple of BLOCK_K = 32) and forced split counts with empty
splits. Runs only with TRITON_INTERPRET=1 set before import (tests/codegen/test_kernels.py starts it that way)."""

from __future__ import annotations

import pytest
import torch
from layouts import check_layout, gemm_operands
from test_kernels import E4M3, E5M2, assert_matches, case_seed, close_as, fp8_operand, run_both
from test_mx import MX_A, MX_B, MX_FAMILY, mx_operand

from fp8fx.codegen import launch
from fp8fx.codegen.variants import GemmVariant, configs_for, split_k
from fp8fx.core.epilogue import Epilogue
from fp8fx.ops import cuda, reference
from fp8fx.ops.args import Fp8GemmArgs

pytestmark = [
    pytest.mark.skipif(not launch.interpreter_active(), reason="needs TRITON_INTERPRET=1 before import"),
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),  # silu's exp(-y) for large -y: y / inf = 0
]

HEAVY = Epilogue(bias=True, activation="gelu", aux="pre_activation", out_amax=True)
# (scale blocks, epilogue, output dtype, (M, N, K), formats, family): tensorwise and rowwise (scales
# after the reduction), blockwise (each split promotes its own K-blocks), in both families.
CASES = [
    (((), ()), Epilogue(), torch.bfloat16, (20, 30, 700), (E4M3, E4M3), "tma"),
    (((1, 0), (0, 1)), HEAVY, torch.float32, (32, 17, 1000), (E5M2, E4M3), "tma"),
    (
        ((1, 0), (0, 1)),
        Epilogue(activation="silu", mul="by_other", residual=True, aux="product"),
        E4M3,
        (9, 32, 777),
        (E4M3, E5M2),
        "pointer",
    ),
    (
        ((), ()),
        Epilogue(bias=True, residual=True, aux="sum", out_amax=True),
        torch.float16,
        (1, 24, 520),
        (E4M3, E4M3),
        "pointer",
    ),
    (((1, 128), (128, 128)), Epilogue(activation="relu"), torch.bfloat16, (24, 32, 640), (E4M3, E4M3), "tma"),
]


def splits_run(monkeypatch) -> list[int]:
    """The split count of every split-K reduction the launcher runs from now on."""
    seen, real = [], launch.split_k_reduce_kernel

    class Recorder:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append(args[12])  # (workspace, out, 8 pointers, m, n, splits, ...)
                return real[grid](*args, **kwargs)

            return run

    monkeypatch.setattr(launch, "split_k_reduce_kernel", Recorder())
    return seen


@pytest.mark.parametrize(
    "blocks,epilogue,out_dtype,shape,formats,family", CASES, ids=lambda v: getattr(v, "spec", lambda: str(v))() or "plain"
)
def test_split_k_by_the_rule_matches_reference(blocks, epilogue, out_dtype, shape, formats, family, monkeypatch):
    """The rule splits these GEMMs (one output tile, K >= 512), and the result is the reference's up
    to summation order, bit-identical when run again (a fixed reduction order, no atomics)."""
    seen = splits_run(monkeypatch)
    m, n, k = shape
    variant = GemmVariant(*formats, *blocks)
    expected = split_k(
        "interpreter", m, n, k, configs_for("interpreter", variant, family, partial=True)[0], launch.INTERPRETER_SMS
    )
    assert expected >= 2
    seed = case_seed(blocks, epilogue.spec(), shape)
    got, ref = run_both(blocks, epilogue, out_dtype, shape, formats, False, seed, family)
    assert seen == [expected]
    assert_matches(epilogue, got, ref)
    again, _ = run_both(blocks, epilogue, out_dtype, shape, formats, False, seed, family)
    for x, y in zip(got, again):
        assert (x is None and y is None) or torch.equal(
            x.view(torch.uint8) if x.dtype == E4M3 else x, y.view(torch.uint8) if y.dtype == E4M3 else y
        )


@pytest.mark.parametrize("family", ["tma", "pointer"])
def test_forced_split_counts_including_empty_splits(family, monkeypatch):
    """Any split count: K = 200 is 7 windows of 32, so 3 splits take 3 + 3 + 1 windows, 5 take
    2 + 2 + 2 + 1 + 0 and 9 leave two splits empty (they add zeros); 1 runs the single kernel."""
    seen = splits_run(monkeypatch)
    a, sa = fp8_operand((40, 200), E4M3, (1, 0), 5)
    b, sb = fp8_operand((200, 36), E4M3, (0, 1), 6, column_major=True)
    ref = reference.scaled_mm(a, b, sa, sb, None, torch.float32, [1, 0], [0, 1])
    for splits in (1, 3, 5, 9):
        out, _, _ = launch.fp8_gemm(
            a, b, sa, sb, block_a=(1, 0), block_b=(0, 1), out_dtype=torch.float32, family=family, splits=splits
        )
        close_as(out, ref)
    assert seen == [3, 5, 9]
    with pytest.raises(ValueError, match="splits must be a positive int"):
        launch.fp8_gemm(a, b, sa, sb, block_a=(1, 0), block_b=(0, 1), splits=0)


def test_mx_blocks_split_by_the_rule(monkeypatch):
    """MX blocks (on the block-scaled MMA where this Triton's interpreter runs tl.dot_scaled): each
    split hands its own blocks' scales to the MMA; K = 1000 ends inside an MX block."""
    seen = splits_run(monkeypatch)
    a, sa = mx_operand((16, 1000), E4M3, MX_A, 7)
    b, sb = mx_operand((1000, 32), E4M3, MX_B, 8)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    out, _, _ = launch.fp8_gemm(
        a, b, sa, sb, block_a=MX_A, block_b=MX_B, epilogue=Epilogue(bias=True), bias=bias, out_dtype=torch.float32
    )
    close_as(out, reference.scaled_mm(a, b, sa, sb, bias, torch.float32, list(MX_A), list(MX_B)))
    assert (
        len(seen) == 1
        and seen[0] >= 2
        and launch.gemm_plan(
            (E4M3, E4M3, MX_A, MX_B, Epilogue(bias=True), torch.float32, torch.bfloat16, False),
            a.device,
            (True, False, False, False),
            None,
            False,
        ).family
        == MX_FAMILY
    )


def test_split_k_op_output_matches_its_fake(monkeypatch):
    """fp8fx::fp8_gemm's GPU implementation through split-K returns what the op's fake promises
    (sizes, strides, dtypes), for transposed and sliced operands as graphs hand them over."""
    seen = splits_run(monkeypatch)
    for layouts in (("contiguous", "transposed"), ("transposed_slice", "sliced")):
        a, b, sa, sb = gemm_operands(([1, 0], [0, 1]), (24, 32, 600), *layouts)
        gemm = Fp8GemmArgs(
            a, b, sa, sb, bias=torch.randn(32), out_dtype=torch.bfloat16, aux_dtype=torch.bfloat16, block_a=[1, 0], block_b=[0, 1],
            epilogue="bias,act=gelu,aux=pre_activation,amax", gpu_kernel="triton",
        )  # fmt: skip
        check_layout(torch.ops.fp8fx.fp8_gemm, cuda.fp8_gemm_cuda, *gemm.call_args(), what=f"split-K {layouts}")
    assert seen and all(s >= 2 for s in seen)
