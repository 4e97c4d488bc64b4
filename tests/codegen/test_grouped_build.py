"""The grouped FP8 GEMM (mixture-of-experts) built for Hopper and Blackwell on the CPU: FP8 tensor
cores, no spills, shared memory within the limit; and its launch autotuner on every target.
(tests/codegen/interpreter/test_grouped.py runs the same kernel through the same launcher.)"""

from __future__ import annotations

import inspect

import pytest
import torch

from fp8fx.codegen import launch
from fp8fx.codegen.targets import build_grouped
from fp8fx.codegen.variants import GROUPED_BLOCK_SCALED_TARGETS, GROUPED_CONFIGS, TARGETS, GroupedVariant

E4M3 = torch.float8_e4m3fn
FP8_MMA = {"sm_90a": "wgmma.mma_async.sync.aligned.", "sm_100a": "tcgen05.mma.cta_group::1.kind::f8f6f4"}


def check(variant: GroupedVariant, arch: str, config) -> None:
    r = build_grouped(variant, arch, config)
    assert r.ok, r  # 0 spills, shared memory within the limit
    assert r.fp8_mma and r.fp8_mma.startswith(FP8_MMA[arch]), r
    if arch == "sm_90a":
        assert r.fp8_mma.endswith(".e4m3.e4m3"), r


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("k_grouped", [False, True], ids=["2d3d", "2d2d"])
def test_grouped_gemm_builds_with_fp8_tensor_cores(arch, k_grouped):
    """The largest config of each form (2D-2D adds the partial K windows' loads and MMAs)."""
    check(GroupedVariant(E4M3, E4M3, k_grouped, torch.bfloat16), arch, GROUPED_CONFIGS[arch][0])


# Scales in blocks along K: MX (E5M2 gradients by E4M3, 1 x 32 blocks: 32-wide K windows) and
# blockwise (1 x 128 by 128 x 128 weights, or 128 x 1 in the weight gradient).
K_BLOCK_VARIANTS = [
    GroupedVariant(torch.float8_e5m2, E4M3, False, torch.bfloat16, k_block=32),
    GroupedVariant(E4M3, E4M3, False, torch.bfloat16, k_block=128, b_col_block=128),
    GroupedVariant(E4M3, torch.float8_e5m2, True, torch.float32, k_block=128),
]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("variant", K_BLOCK_VARIANTS, ids=lambda v: v.name)
def test_grouped_gemm_with_k_block_scales_builds(arch, variant):
    configs = variant.configs(arch)
    assert all(variant.k_block % c.block_k == 0 for c in configs)
    r = build_grouped(variant, arch, configs[0])
    assert r.ok, r
    assert r.fp8_mma and r.fp8_mma.startswith(FP8_MMA[arch]), r


@pytest.mark.parametrize("k_grouped", [False, True], ids=["2d3d", "2d2d"])
def test_mx_grouped_gemm_builds_with_block_scaled_mma_on_blackwell(k_grouped):
    variant = GroupedVariant(torch.float8_e5m2, E4M3, k_grouped, torch.bfloat16, k_block=32, block_scaled=True)
    configs = variant.configs("sm_100a")
    assert {c.block_k for c in configs} == ({32} if k_grouped else {128})  # 2D-2D groups end on any 32-block
    for config in configs:
        r = build_grouped(variant, "sm_100a", config)
        assert r.ok, r
        assert r.fp8_mma == "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32", r


@pytest.mark.slow
def test_every_grouped_config_builds():
    for arch in ("sm_90a", "sm_100a"):
        for k_grouped in (False, True):
            variant = GroupedVariant(E4M3, E4M3, k_grouped, torch.float32)
            for config in variant.configs(arch):  # GROUPED_CONFIGS, less what this Triton spills (versions)
                check(variant, arch, config)


def test_grouped_autotuner_builds_for_every_target():
    """Each config names the kernel's tile constexprs, which with the variant's fill every
    constexpr parameter; the interpreter has one config (it never benchmarks)."""
    block_scaled = [
        GroupedVariant(torch.float8_e5m2, E4M3, k_grouped, k_block=32, block_scaled=True) for k_grouped in (False, True)
    ]
    for target in TARGETS:
        variants = [GroupedVariant(E4M3, E4M3, k_grouped) for k_grouped in (False, True)] + K_BLOCK_VARIANTS
        for variant in variants + (block_scaled if target in GROUPED_BLOCK_SCALED_TARGETS else []):
            tuner = launch.grouped_autotuner(target, variant)
            assert tuner.configs, (target, variant.name)
            assert tuner is launch.grouped_autotuner(target, variant)
            constexprs = {p.name for p in tuner.fn.params if p.is_constexpr}
            required = {p.name for p in tuner.fn.params if p.is_constexpr and p.default is inspect.Parameter.empty}
            for config in tuner.configs:
                assert required == set(config.kwargs) | set(variant.constexprs()) <= constexprs, target
    assert len(launch.grouped_autotuner("interpreter", GroupedVariant(E4M3, E4M3, False)).configs) == 1
