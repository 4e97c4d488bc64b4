"""The persistent TMA GEMM kernel (family "tma"), run by Triton's interpreter against the reference.

Every scale granularity pair and every epilogue of test_kernels.py, with format pairs, output
dtypes, fast_accum and shapes sampled alongside: partial tiles in M, N and K, one-row operands,
and more tiles than the interpreter's 3 persistent programs. The interpreter config (32 x 32 x 32,
EPILOGUE_SUBTILE=2) runs the tile loop and the epilogue's column slices.

Runs only with TRITON_INTERPRET=1 set before import (tests/codegen/test_kernels.py starts it that way)."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
from test_kernels import E4M3, E5M2, EPILOGUES, GEMM_BLOCKS, assert_matches, case_seed, run_both

from fp8fx.codegen import launch
from fp8fx.codegen.variants import CONFIGS, GemmVariant, configs_for

pytestmark = [
    pytest.mark.skipif(not launch.interpreter_active(), reason="needs TRITON_INTERPRET=1 before import"),
    # gelu_tanh's exp(2 x) overflows to inf for large x in numpy, and 2 / inf = 0 gives the right tanh
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]

# (M, N, K): M in {1, 7, 40}; N = 1 makes B^T a one-row operand; K never a multiple of BLOCK_K = 32
# except 256 (two 128-K-blocks, the blockwise recipes' promotion points); most shapes have more
# tiles than programs, a few fewer. 8 shapes against 7 epilogues: each epilogue meets several.
SHAPES = [(1, 100, 200), (7, 100, 130), (40, 144, 256), (40, 70, 48), (7, 33, 300), (40, 1, 200), (1, 40, 72), (40, 64, 100)]
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, E4M3)
FORMATS = ((E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2))


def _sampled(shift: int) -> list:
    """Every (scale blocks, epilogue) pair once, with output dtype, shape, formats and fast_accum
    cycling beside it; `shift` starts the cycles elsewhere, so a second pass meets other pairings."""
    return [
        (blocks, ep, out_dtype, shape, formats, fast_accum)
        for (blocks, ep), out_dtype, shape, (formats, fast_accum) in zip(
            itertools.product(GEMM_BLOCKS, EPILOGUES),
            itertools.islice(itertools.cycle(OUT_DTYPES), shift, None),
            itertools.islice(itertools.cycle(SHAPES), 3 * shift, None),
            itertools.islice(itertools.cycle(itertools.product(FORMATS, (False, True))), shift, None),
        )
    ]


CASES = list(dict.fromkeys(_sampled(0) + _sampled(1)))


def _case_id(v):
    if hasattr(v, "spec"):
        return v.spec() or "plain"
    return str(v).replace("torch.", "").replace("float8_", "")


@pytest.mark.parametrize("blocks,epilogue,out_dtype,shape,formats,fast_accum", CASES, ids=_case_id)
def test_tma_gemm_matches_reference(blocks, epilogue, out_dtype, shape, formats, fast_accum):
    got, ref = run_both(blocks, epilogue, out_dtype, shape, formats, fast_accum, case_seed(blocks, epilogue.spec(), shape), "tma")
    assert got[0].shape == shape[:2] and got[0].dtype == out_dtype
    assert_matches(epilogue, got, ref)


def test_cases_cover_the_sampled_dimensions():
    """The sampling above reaches every value it is meant to (a guard against a zip that stops short)."""
    assert {c[0] for c in CASES} == set(GEMM_BLOCKS) and len({c[1] for c in CASES}) == len(EPILOGUES)
    assert len(CASES) == 2 * len(GEMM_BLOCKS) * len(EPILOGUES)
    assert {c[2] for c in CASES} == set(OUT_DTYPES)
    assert {c[3] for c in CASES} == set(SHAPES) and {c[3][0] for c in CASES} == {1, 7, 40}
    assert {c[4] for c in CASES} == set(FORMATS) and {c[5] for c in CASES} == {False, True}
    (config,) = CONFIGS["interpreter", "tma"]
    tiles = [-(-m // config.block_m) * -(-n // config.block_n) for m, n, _ in SHAPES]
    assert max(tiles) > launch.INTERPRETER_SMS and min(tiles) < launch.INTERPRETER_SMS
    assert all(k % config.block_k for _, _, k in SHAPES if k != 256)
    assert dict(config.extra).get("EPILOGUE_SUBTILE", 1) > 1


def test_pre_hook_sets_the_chosen_configs_block_shapes(monkeypatch):
    """The autotuner's config pre-hook runs under the interpreter too (one code path): the
    descriptors the launcher made with placeholder block shapes carry the config's tiles."""
    made = []

    from fp8fx.codegen import tma_kernel

    def capture(*args):
        descs = make_descriptors(*args)
        made.extend(descs)
        return descs

    make_descriptors = tma_kernel.operand_descriptors
    monkeypatch.setattr(tma_kernel, "operand_descriptors", capture)
    blocks = ((1, 128), (128, 128))
    run_both(blocks, EPILOGUES[0], torch.bfloat16, (7, 100, 130), (E4M3, E4M3), False, 5, "tma")
    variant = GemmVariant(E4M3, E4M3, *blocks)
    (config,) = configs_for("interpreter", variant, "tma")
    a_desc, b_desc = made
    assert a_desc.block_shape == [config.block_m, config.block_k]
    assert b_desc.block_shape == [config.block_n, config.block_k]
    assert (a_desc.shape, b_desc.shape) == ([7, 130], [100, 130])


def test_one_row_operands_get_an_aligned_descriptor_stride():
    """A one-row operand's stride is never applied, but a descriptor needs 16-byte strides:
    rows_aligned gives it an aligned row."""
    from fp8fx.codegen.tma_kernel import operand_descriptors

    a = torch.zeros(1, 50, dtype=E4M3)
    bt = launch.rows_aligned(torch.zeros(50, 3, dtype=E4M3).t())
    a_desc, b_desc = operand_descriptors(launch.rows_aligned(a), bt)
    assert a_desc.strides == [64, 1] and a_desc.shape == [1, 50]
    assert b_desc.strides == [bt.stride(0), 1] and bt.stride(0) % 16 == 0


@pytest.mark.parametrize("shape,transposed", [((1, 50), False), ((7, 130), False), ((100, 130), True), ((40, 16), True)])
def test_descriptors_equal_the_constructors(shape, transposed):
    """The launcher's descriptors, built without the constructor's per-call checks, hold what
    Triton's TensorDescriptor constructor makes of the same aligned operand, field for field, and
    no tensor but their own (on the Triton installed: .ci/compat runs Triton 3.6)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fp8fx.codegen.tma_kernel import descriptor

    t = torch.zeros(shape[::-1] if transposed else shape, dtype=E4M3)
    t = launch.rows_aligned(t.t() if transposed else t)
    fast, built = descriptor(t), TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [16, 16])
    assert type(fast) is TensorDescriptor and vars(fast).keys() == vars(built).keys()
    assert fast.base is t
    assert {k: v for k, v in vars(fast).items() if k != "base"} == {k: v for k, v in vars(built).items() if k != "base"}


def test_tma_kernel_takes_the_pointer_kernels_arguments():
    """The launcher's contract: the pointer kernel's arguments with descriptors for the operand
    pointers and without their strides (and its own family's config constexprs, which have
    defaults: the mx family's BLOCK_SCALED_MMA, split-K's PARTIAL), then the config's constexprs."""
    from fp8fx.codegen.tma_kernel import fp8_gemm_tma_kernel
    from fp8fx.codegen.triton_kernels import fp8_gemm_kernel

    own = {p.name for p in inspect.signature(fp8_gemm_kernel.fn).parameters.values() if p.default is not inspect.Parameter.empty}
    assert own == {"BLOCK_SCALED_MMA", "PARTIAL"}
    pointer = [{"a_ptr": "a_desc", "b_ptr": "b_desc"}.get(n, n) for n in fp8_gemm_kernel.arg_names if n not in own]
    pointer = [n for n in pointer if n not in ("stride_am", "stride_ak", "stride_bk", "stride_bn")]
    tma = fp8_gemm_tma_kernel.arg_names
    assert tma[: len(pointer)] == pointer
    extra = set(tma[len(pointer) :])
    defaults = {
        p.name for p in inspect.signature(fp8_gemm_tma_kernel.fn).parameters.values() if p.default is not inspect.Parameter.empty
    }
    assert extra == defaults  # every extra constexpr has a default: configs set only what they change
    for (target, family), configs in CONFIGS.items():
        if family == "tma":
            assert all(dict(c.extra).keys() <= extra for c in configs), target
