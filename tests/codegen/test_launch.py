"""The launch path a GPU takes, built on the CPU: the autotuner of every variant on every target,
the grids of the largest shapes, and the autotune key. (The interpreter tests run the same
launcher on CPU tensors; tests/codegen/test_kernel_build.py compiles each config for the GPUs.)"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from fp8fx.codegen import launch
from fp8fx.codegen.targets import coverage_variants
from fp8fx.codegen.variants import (
    CONFIGS,
    GRID_LIMITS,
    SPLIT_K_MIN_K,
    TARGETS,
    GemmVariant,
    QuantizeVariant,
    configs_for,
    split_k,
)

GEMMS = [v for v in coverage_variants() if isinstance(v, GemmVariant)]
GEMMS += [v.__class__(**{**v.__dict__, "fast_accum": True}) for v in GEMMS[:2]]
QUANTIZERS = [v for v in coverage_variants() if isinstance(v, QuantizeVariant)]
LAUNCHES = [(target, family) for target, family in CONFIGS if target in TARGETS]


def test_every_launch_autotuner_builds_for_every_target():
    """What the first FP8 GEMM on a GPU does before anything runs: build its autotuner. Each config
    must name exactly the kernel's tile constexprs, which with the variant's fill every constexpr
    parameter (a missing or unknown name fails only at launch)."""
    built = 0
    for (target, family), variant in itertools.product(LAUNCHES, GEMMS):
        tuner = launch.autotuner(target, family, variant)
        assert tuner is launch.autotuner(target, family, variant)  # built once, cached
        assert tuner.keys == ["M_BUCKET", "N", "K", "SPLIT_K"]
        constexprs = {p.name for p in tuner.fn.params if p.is_constexpr}
        required = {p.name for p in tuner.fn.params if p.is_constexpr and p.default is inspect.Parameter.empty}
        assert [c.kwargs for c in tuner.configs] == [c.constexprs() for c in configs_for(target, variant, family)]
        for config in tuner.configs:
            given = set(config.kwargs) | set(variant.constexprs())
            assert required <= given <= constexprs, (target, family, variant.name, required ^ given)
            assert not set(config.kwargs) & set(variant.constexprs())
        if target == "interpreter":
            assert len(tuner.configs) == 1  # never benchmarks on the CPU
        built += 1
    assert built == len(LAUNCHES) * len(GEMMS)
    assert {t for t, _ in LAUNCHES} == set(TARGETS)


def test_autotune_key_buckets_token_counts():
    """Every sequence length must not re-benchmark: token counts 1..1M fall in 17 buckets."""
    buckets = {launch.m_bucket(m) for m in range(1, 1 << 20, 37)} | {launch.m_bucket(1 << 20)}
    assert len(buckets) <= 17
    assert all(launch.m_bucket(m) >= m for m in (1, 7, 16, 17, 1000, 1 << 20))


@pytest.mark.parametrize("m,n", [(1 << 20, 256 * 1024), (1, 256 * 1024), (1 << 20, 1), (1 << 20, 64 * 1024)])
def test_gemm_grids_fit_cuda_limits(m, n):
    """Up to 1M tokens and a 256k vocabulary, for every config of every target and family."""
    for (target, family), variant in itertools.product(LAUNCHES, GEMMS[:3]):
        for config in configs_for(target, variant, family):
            (programs,) = launch.gemm_grid(m, n, config, family, sms=132)
            assert 1 <= programs <= GRID_LIMITS[0]


@pytest.mark.parametrize("rows,cols", [(1 << 20, 64 * 1024), (64 * 1024, 256 * 1024), (1 << 20, 256 * 1024), (1, 256 * 1024), (256 * 1024, 1)])
def test_quantize_grids_fit_cuda_limits(rows, cols):
    """Rowwise casts of 1M tokens, per-column casts of a 256k vocabulary, 1x128 blocks of both."""
    for variant in QUANTIZERS:
        grid, _ = launch.block_grid(*variant.programs(rows, cols))
        assert all(g <= limit for g, limit in zip(grid, GRID_LIMITS))
        if not variant.block:  # the tensorwise amax pass
            grid, _ = launch.block_grid(-(-rows // variant.blocking()["TILE_R"]), -(-cols // variant.blocking()["TILE_C"]))
            assert all(g <= limit for g, limit in zip(grid, GRID_LIMITS))


def test_operands_are_copied_only_when_tensor_cores_cannot_read_them():
    x = torch.zeros(64, 48, dtype=torch.float8_e4m3fn)
    assert launch.rows_aligned(x) is x
    for view in (x[:, :14], x[:, 1:33], x.t(), x[:1].expand(64, 48), torch.zeros(8, 14, dtype=torch.float8_e4m3fn)):
        copy = launch.rows_aligned(view)
        assert copy.stride(1) == 1 and copy.stride(0) % 16 == 0 and copy.data_ptr() % 16 == 0
        assert torch.equal(copy.view(torch.uint8), view.contiguous().view(torch.uint8))


@pytest.mark.parametrize(
    "m,n,k,splits",
    [
        (4096, 4096, 2048, 1),  # 1024 output tiles: more than the SMs
        (1024, 4096, 8192, 1),  # Llama-3-8B's K / V projections' weight gradients: 256 tiles, 2 full waves
        (1024, 1024, 8192, 2),  # 64 tiles: two K ranges fill 128 of 132 SMs
        (512, 512, 16384, 8),  # 16 tiles: 8 splits fill 128 SMs
        (256, 256, 65536, 33),  # 4 tiles: 33 splits fill the 132 SMs, each 1986 long
        (512, 512, 1536, 1),  # a split would be shorter than SPLIT_K_MIN_K
        (128, 128, 0, 1),
    ],
)
def test_split_k_rule_fills_one_wave(m, n, k, splits):
    """Hopper (132 SMs, 128 x 128 tiles): split K only where the output tiles fill at most half the
    SMs, into as many ranges as one wave holds, each at least SPLIT_K_MIN_K long; the workspace
    (tiles x splits fp32 tiles) then stays within one tile per SM."""
    variant = GEMMS[0]
    tile = configs_for("sm_90a", variant, "tma", partial=True)[0]
    assert (tile.block_m, tile.block_n) == (128, 128)
    got = split_k("sm_90a", m, n, k, tile, 132)
    assert got == splits
    tiles = -(-m // 128) * -(-n // 128)
    assert got == 1 or (tiles * got <= 132 and k // got >= SPLIT_K_MIN_K["sm_90a"])


def test_split_k_grids_fit_cuda_limits():
    """Split counts go on grid y of the one-tile-per-program kernels, into the (split, tile) loop of the persistent one."""
    config = configs_for("sm_90a", GEMMS[0], "pointer", partial=True)[0]  # 128 x 128: no epilogue in the partial sums
    assert launch.gemm_grid(256, 256, config, "pointer", 132, splits=8) == (4, 8)
    assert launch.gemm_grid(256, 256, config, "tma", 132, splits=8) == (32,)
    assert launch.gemm_grid(256, 256, config, "tma", 132, splits=64) == (132,)
    with pytest.raises(ValueError, match="grid limits"):
        launch.gemm_grid(256, 256, config, "pointer", 132, splits=GRID_LIMITS[1] + 1)
