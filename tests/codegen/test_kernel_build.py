"""The persistent TMA GEMM kernel built for Hopper and Blackwell on the CPU, and what both GEMM
families' PTX and TTIR show about accumulation precision and 64-bit addressing."""

from __future__ import annotations

import re

import torch

from fp8fx.codegen import versions
from fp8fx.codegen.targets import build_all, build_gemm, build_split_k_reduce, coverage_variants, families_of, gemm_ir
from fp8fx.codegen.variants import CONFIGS, GemmVariant, TileConfig, configs_for, gemm_family
from fp8fx.core.epilogue import Epilogue

E4M3 = torch.float8_e4m3fn
TMA_ARCHS = ("sm_90a", "sm_100a")


def gemm_coverage() -> list[GemmVariant]:
    return [v for v in coverage_variants() if isinstance(v, GemmVariant)]


def test_families_per_architecture():
    """The pointer kernel builds everywhere (Ada's kernel and the fallback); TMA on Hopper and Blackwell."""
    assert families_of("sm_89") == ("pointer",)
    assert families_of("sm_90a") == families_of("sm_100a") == ("pointer", "tma")
    # Blackwell's largest config warp-specializes, where this Triton builds it (3.7 on); none does before
    warp_specialized = [c for c in CONFIGS["sm_100a", "tma"] if dict(c.extra).get("WARP_SPECIALIZE")]
    if versions.has("sm100_warp_specialize"):
        assert warp_specialized and warp_specialized[0] == CONFIGS["sm_100a", "tma"][0]
    else:
        assert not warp_specialized and CONFIGS["sm_100a", "tma"]


def test_every_coverage_variant_builds_with_tma_on_hopper_and_blackwell():
    variants = gemm_coverage()
    results = build_all(variants, archs=TMA_ARCHS, families=("tma",), workers=2)
    assert len(results) == len(variants) * len(TMA_ARCHS)
    for r in results:
        assert r.family == "tma" and r.ok, r  # 0 spills, shared memory within the limit
        assert r.tma, r  # operands through cp.async.bulk.tensor
        assert r.fp8_mma and r.fp8_mma.startswith({"sm_90a": "wgmma.mma_async", "sm_100a": "tcgen05.mma"}[r.arch]), r
        assert r.warp_specialized == r.warp_specialize_asked, r
    # its first config asks for it (Triton >= 3.7; before, none does)
    assert all(r.warp_specialized == versions.has("sm100_warp_specialize") for r in results if r.arch == "sm_100a")
    assert all("kind::f8f6f4" in r.fp8_mma for r in results if r.arch == "sm_100a")


def test_split_k_kernels_build_for_hopper_and_blackwell():
    """Split-K's two kernels on sm_90a and sm_100a: the partial sums (no epilogue: they depend on
    the operand formats and on scales along K, not on the epilogue) in each family's first partial
    config, with the FP8 tensor-core instruction, TMA loads in the tma family and 0 spills; the
    reduction (the epilogue) of every coverage variant with 0 spills."""
    mx = GemmVariant(E4M3, E4M3, (1, 32), (32, 1), Epilogue(), torch.bfloat16)
    partial_sums = [GemmVariant(E4M3, E4M3, (1, 0), (0, 1)), gemm_coverage()[3]]  # rowwise (as tensorwise), blockwise
    results = []
    for arch in TMA_ARCHS:
        for variant in partial_sums:
            for family in ("tma", "pointer"):
                results.append(build_gemm(variant, arch, configs_for(arch, variant, family, partial=True)[0], family, partial=True))
        if gemm_family(arch, mx) == "mx":  # Blackwell's block-scaled MMA
            results.append(build_gemm(mx, arch, configs_for(arch, mx, "mx", partial=True)[0], "mx", partial=True))
    assert len(results) == 2 * 2 * 2 + 1
    for r in results:
        assert r.ok and r.kernel.endswith(".split_k"), r
        assert r.fp8_mma and r.fp8_mma.startswith({"sm_90a": "wgmma.mma_async", "sm_100a": "tcgen05.mma"}[r.arch]), r
        assert r.tma == (r.family == "tma"), r
    assert any("block_scale" in r.fp8_mma for r in results)
    reductions = [build_split_k_reduce(v, arch) for arch in TMA_ARCHS for v in gemm_coverage()]
    assert all(r.ok and r.fp8_mma is None for r in reductions), "\n".join(map(str, reductions))


def _adds(ptx: str) -> int:
    return len(re.findall(r"\badd(?:\.rn)?\.f32\b", ptx))


def test_hopper_promotes_fp8_partial_sums_without_fast_accum():
    """Without FAST_ACCUM, every BLOCK_K slice's wgmma chain accumulates into a zeroed temporary
    (Hopper's FP8 wgmma keeps fewer mantissa bits than fp32) and the temporary is then added into
    the fp32 accumulator: one add.f32 per accumulator value a thread holds (measured: 64 for
    128 x 128 tiles on 8 warps, in both families; the fast build has none, the wgmmas accumulate
    in place)."""
    for family in ("pointer", "tma"):
        ptx = {}
        for fast in (False, True):
            variant = GemmVariant(E4M3, E4M3, (), (), Epilogue(), torch.bfloat16, fast_accum=fast)
            config = configs_for("sm_90a", variant, family)[0]
            ptx[fast] = gemm_ir(variant, "sm_90a", config, family)["ptx"]
        assert ptx[False] != ptx[True], family
        assert all("wgmma.mma_async" in p for p in ptx.values()), family
        per_thread = config.block_m * config.block_n // (32 * config.num_warps)
        assert _adds(ptx[False]) - _adds(ptx[True]) == per_thread, (family, _adds(ptx[False]), _adds(ptx[True]))


def _offsets(ttir: str) -> list[tuple[str, str]]:
    """(pointer type, offset type) of every tt.addptr."""
    return re.findall(r"tt\.addptr [^:\n]*: ([^,\n]+), (\S+)", ttir)


def _dims(ty: str) -> list[int]:
    return [int(d) for d in re.findall(r"(\d+)x", ty)]


def test_offsets_meeting_strides_are_64_bit_in_both_families():
    """Operand, output and epilogue offsets are int64 in the TTIR: a 2**31-element operand must not
    wrap. A config whose BLOCK_K (128) differs from BLOCK_M (64) and BLOCK_N (32) tells the K
    direction apart: only in-tile K offsets of the pointer kernel's operands may be 32-bit. The
    pointer kernel adds a scale tensor's K-block offset (K / 128 times a stride: at most the scale
    tensor's size) in 32 bits; its 1-D and scalar scale offsets are left out of its check."""
    variant = GemmVariant(
        E4M3, E4M3, (1, 128), (128, 1), Epilogue(bias=True, activation="gelu", mul="by_other", residual=True, aux="sum", out_amax=True), torch.bfloat16
    )
    for family, extra in (("pointer", ()), ("tma", (("EPILOGUE_SUBTILE", 2),))):
        config = TileConfig(64, 32, 128, 8, 4, 2, extra)
        ttir = gemm_ir(variant, "sm_90a", config, family)["ttir"]
        offsets = _offsets(ttir)
        checked = [(p, o) for p, o in offsets if family == "tma" or not (len(_dims(p)) <= 1 and "f32" in p)]
        assert len(checked) >= 8, (family, offsets)
        for pointer, offset in checked:
            if offset.endswith("i32>") or offset == "i32":
                assert config.block_k in _dims(offset), (family, pointer, offset)  # K-direction only
            else:
                assert offset.endswith("i64>") or offset == "i64", (family, pointer, offset)
        # out, aux, other and residual: a 64-bit offset per element of the (sub-)tile
        slice_n = config.block_n // dict(extra).get("EPILOGUE_SUBTILE", 1)
        tiles = [o for _, o in offsets if o == f"tensor<64x{slice_n}xi64>"]
        assert len(tiles) >= 4, (family, offsets)
        assert ("tt.descriptor_load" in ttir) == (family == "tma")
        assert re.search(r"arith\.extsi %\S+ : tensor<\d+xi32> to tensor<\d+xi64>", ttir), family
