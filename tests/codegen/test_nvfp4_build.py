"""The NVFP4 GEMM built for Blackwell on the CPU: the FP4 block-scaled MMA with 16-element E4M3
scales (`tcgen05.mma ... kind::mxf4nvf4.block_scale.block16`) in the PTX, no spills, shared memory
within the limit; and no other GPU target gets it. (tests/codegen/interpreter/test_nvfp4.py runs
the same kernel through the same launcher.)"""

from __future__ import annotations

import pytest
import torch

from fp8fx.codegen.launch import nvfp4_autotuner
from fp8fx.codegen.targets import build_nvfp4
from fp8fx.codegen.variants import GPU_TARGETS, NVFP4_CONFIGS, GemmVariant

E4M3 = torch.float8_e4m3fn


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
    assert GemmVariant(E4M3, E4M3, (1, 16), (16, 16)).nvfp4 and GemmVariant(E4M3, E4M3, (16, 16), (16, 1)).nvfp4
    assert not GemmVariant(E4M3, E4M3, (1, 32), (32, 1)).nvfp4 and not GemmVariant(E4M3, E4M3, (1, 16), (32, 1)).nvfp4
