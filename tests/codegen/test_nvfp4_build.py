"""The NVFP4 GEMM built for Blackwell on the CPU: the FP4 block-scaled MMA with 16-element E4M3
scales (`tcgen05.mma ... kind::mxf4nvf4.block_scale.block16`) in the PTX, no spills, shared memory
within the limit; and no other GPU target gets it. (tests/codegen/interpreter/test_nvfp4.py runs
the same kernel through the same launcher.)"""

from __future__ import annotations

import pytest
import torch

from fp8fx.codegen import versions
from fp8fx.codegen.launch import nvfp4_autotuner
from fp8fx.codegen.targets import build_nvfp4
from fp8fx.codegen.variants import GPU_TARGETS, NVFP4_CONFIGS, nvfp4_blocks


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_gemm_builds_with_fp4_block_scaled_mma_on_blackwell(out_dtype):
    for config in NVFP4_CONFIGS["sm_100a"]:
        r = build_nvfp4("sm_100a", config, out_dtype)
        assert r.ok, r  # 0 spills, shared memory within the limit
        assert r.fp8_mma == "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16", r


@pytest.mark.parametrize("target", [t for t in GPU_TARGETS if t != "sm_100a"])
def test_nvfp4_gemm_is_refused_without_fp4_tensor_cores(target):
    with pytest.raises(
        RuntimeError, match=rf"^fp8fx: NVFP4 GEMMs run on Blackwell's FP4 tensor cores \(sm_100a\) only; this GPU is {target}"
    ):
        nvfp4_autotuner(target)


def test_nvfp4_blocks_are_recognised():
    assert nvfp4_blocks((1, 16), (16, 16)) and nvfp4_blocks((16, 16), (16, 1))
    assert not nvfp4_blocks((1, 32), (32, 1)) and not nvfp4_blocks((1, 16), (32, 1))


@pytest.mark.parametrize("target", list(NVFP4_CONFIGS))
def test_nvfp4_autotuner_builds_where_it_runs(target):
    """What the first NVFP4 GEMM on a Blackwell GPU builds before it runs (and the interpreter's):
    the configs name exactly the kernel's tile constexprs; the interpreter has one (it never
    benchmarks)."""
    if target == "interpreter" and not versions.has("interpreter_e4m3_scales"):
        pytest.skip(versions.reason("interpreter_e4m3_scales"))
    tuner = nvfp4_autotuner(target)
    assert tuner is nvfp4_autotuner(target) and tuner.keys == ["M_BUCKET", "N", "K_BYTES"]
    constexprs = {p.name for p in tuner.fn.params if p.is_constexpr}
    assert [c.kwargs for c in tuner.configs] == [c.constexprs() for c in NVFP4_CONFIGS[target]]
    assert all(set(c.kwargs) == constexprs for c in tuner.configs)
    if target == "interpreter":
        assert len(tuner.configs) == 1
