"""Build the generated kernels for real GPUs without one: PTX and SASS for sm_89, sm_90a, sm_100a.

Triton compiles for any target on the CPU (it ships ptxas). For each variant, tile config and GEMM
kernel family (`pointer`: `triton_kernels.fp8_gemm_kernel`; `tma`: the persistent
`tma_kernel.fp8_gemm_tma_kernel`, Hopper and Blackwell) this module compiles the kernel, then reads
what a GPU engineer would check: the FP8 tensor-core instruction in the PTX (`mma ... e4m3` on Ada,
`wgmma.mma_async ... e4m3` on Hopper, `tcgen05.mma ... f8f6f4` on Blackwell, and for MX GEMMs
there (family `mx`) `tcgen05.mma ... mxf8f6f4.block_scale`), register use and
spills from ptxas, shared memory against the architecture's per-block limit, TMA loads
(`cp.async.bulk.tensor`) and warp specialization.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fp8fx.codegen.triton_kernels import fp8_gemm_kernel, quantize_kernel, split_k_reduce_kernel
from fp8fx.codegen.variants import (
    CONFIGS,
    FAMILIES,
    SPLIT_K_REDUCE,
    GemmVariant,
    GroupedVariant,
    QuantizeVariant,
    TileConfig,
    configs_for,
)
from fp8fx.core.epilogue import Epilogue

CAPABILITY = {"sm_89": 89, "sm_90a": 90, "sm_100a": 100}
SHARED_MEMORY_LIMIT = {"sm_89": 101376, "sm_90a": 232448, "sm_100a": 232448}  # bytes per block (opt-in max)
# The FP8 tensor-core instruction each architecture must use.
FP8_MMA = {
    "sm_89": re.compile(r"mma\.sync\.aligned\.\S*\.e[45]m[23]\.e[45]m[23]"),
    "sm_90a": re.compile(r"wgmma\.mma_async\.\S*\.e[45]m[23]\.e[45]m[23]"),
    "sm_100a": re.compile(r"tcgen05\.mma\.\S*kind::f8f6f4"),
}
# MX GEMMs on Blackwell (family mx): the block-scaled MMA, E8M0 scales per 32 elements of K.
BLOCK_SCALED_MMA = re.compile(r"tcgen05\.mma\.\S*kind::mxf8f6f4\.block_scale\S*")
# NVFP4 GEMMs on Blackwell: the FP4 block-scaled MMA, E4M3 scales per 16 elements of K.
NVFP4_MMA = re.compile(r"tcgen05\.mma\.\S*kind::mxf4nvf4\.block_scale\.(?:block16|scale_vec::4X)")
# PTX's older names of the block-scaled MMAs' scale blocks (Triton < 3.9 prints them): the same
# instructions, one scale per 32 (mxf8f6f4) or 16 (mxf4nvf4) elements of K. Results say the new ones.
_SCALE_VEC_ALIASES = {
    "kind::mxf8f6f4.block_scale.scale_vec::1X": "kind::mxf8f6f4.block_scale.block32",
    "kind::mxf4nvf4.block_scale.scale_vec::4X": "kind::mxf4nvf4.block_scale.block16",
}
_PTR = {
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.float8_e5m2: "*fp8e5",
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
}


@dataclass(frozen=True)
class BuildResult:
    kernel: str
    arch: str
    config: str
    fp8_mma: str | None  # the first FP8 tensor-core instruction found in the PTX
    registers: int
    spill_bytes: int  # spill stores + loads, from ptxas
    shared_bytes: int
    shared_limit: int
    family: str = "pointer"  # "pointer", "tma", or "quantize"
    tma: bool = False  # the PTX loads through TMA (cp.async.bulk.tensor)
    warp_specialized: bool = False  # the kernel was split into warp-specialized partitions
    warp_specialize_asked: bool = False  # the config asked for it (WARP_SPECIALIZE)

    @property
    def ok(self) -> bool:
        return self.spill_bytes == 0 and self.shared_bytes <= self.shared_limit


def _ptxas_report(ptx: str, arch: str) -> tuple[int, int]:
    """(registers, spill bytes) of the kernel, from `ptxas -v`."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        cmd = [
            get_ptxas(CAPABILITY[arch]).path,
            "-v",
            "--regAllocOptLevel=2",
            f"--gpu-name={arch}",
            str(src),
            "-o",
            str(Path(d) / "k.cubin"),
        ]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return registers, spills


def _compile(fn, signature: dict, constexprs: dict, arch: str, num_warps: int, num_stages: int, aligned: tuple = ()):
    # Pointers, and the sizes and strides the launcher guarantees to be multiples of 16, carry
    # Triton's divisibility hint, as Triton's launcher specialises them at run time.
    attrs = {
        (fn.arg_names.index(name),): [["tt.divisibility", 16]]
        for name, ty in signature.items()
        if ty.startswith("*") or name in aligned
    }
    src = ASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True}
    return triton.compile(src, target=GPUTarget("cuda", CAPABILITY[arch], 32), options=options)


def _signature(fn, pointers: dict, constexprs: dict) -> dict:
    return {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}


def _gemm_kernel(variant: GemmVariant, arch: str, config: TileConfig, family: str, partial: bool = False):
    """The compiled GEMM kernel of one family (Triton's CompiledKernel: .asm holds ttir, ttgir, ptx);
    `partial`: its split-K form, writing fp32 partial sums to the workspace in out's place."""
    # The launcher's layout: K-contiguous operands, row-major outputs.
    pointers = {"out_ptr": "*fp32" if partial else _PTR[variant.out_dtype], "aux_ptr": _PTR[variant.aux_dtype]}
    for name in ("scale_a_ptr", "scale_b_ptr", "out_scale_ptr", "amax_ptr", "other_ptr"):
        pointers[name] = "*fp32"
    pointers["bias_ptr"] = pointers["residual_ptr"] = "*bf16"
    aligned = ("N", "K", "stride_om", "stride_xm", "stride_rm", "stride_aux_m")  # N, K % 16: the policy's rule
    if family in ("pointer", "mx"):  # mx: the pointer kernel with block-scaled MMAs
        fn = fp8_gemm_kernel
        constexprs = {p.name: p.default for p in fn.params if p.has_default}  # what a config leaves unset
        constexprs.update(stride_ak=1, stride_bk=1)
        pointers.update(a_ptr=_PTR[variant.a_dtype], b_ptr=_PTR[variant.b_dtype])
        aligned += ("stride_am", "stride_bn")
    elif family == "tma":
        from fp8fx.codegen.tma_kernel import fp8_gemm_tma_kernel as fn

        # Tensor descriptors: element type and block shape (the config's operand tiles) are part
        # of the argument's type, as Triton's launcher specialises a host TensorDescriptor.
        constexprs = {p.name: p.default for p in fn.params if p.has_default}
        pointers["a_desc"] = f"tensordesc<{_PTR[variant.a_dtype][1:]}[{config.block_m}, {config.block_k}]>"
        pointers["b_desc"] = f"tensordesc<{_PTR[variant.b_dtype][1:]}[{config.block_n}, {config.block_k}]>"
    else:
        raise ValueError(f"fp8fx: unknown kernel family {family!r}; expected pointer or tma")
    # Unit strides the launcher guarantees are specialised, as Triton's launcher turns an integer
    # argument equal to 1 into a constant: out and aux are allocated row-major, and block-scale
    # tensors are contiguous ([M / rows, K / k] and [K / k, N / cols]: unit stride along K for A's,
    # along N for B's). Per-K-block column scales need the latter to stay out of spills.
    constexprs.update(variant.constexprs(), **config.constexprs(), stride_on=1, stride_aux_n=1, PARTIAL=partial)
    if variant.block_a:
        constexprs["stride_sa_k"] = 1
    if variant.block_b:
        constexprs["stride_sb_col"] = 1
    signature = _signature(fn, pointers, constexprs)
    return _compile(fn, signature, constexprs, arch, config.num_warps, config.num_stages, aligned)


def build_gemm(
    variant: GemmVariant, arch: str, config: TileConfig, family: str = "pointer", partial: bool = False
) -> BuildResult:
    """One GEMM kernel built; `partial`: the split-K form (named `<variant>.split_k`)."""
    kernel = _gemm_kernel(variant, arch, config, family, partial)
    name = f"{variant.name}.split_k" if partial else variant.name
    return _result(name, arch, config, kernel, BLOCK_SCALED_MMA if family == "mx" else FP8_MMA[arch], family)


def build_split_k_reduce(variant: GemmVariant, arch: str) -> BuildResult:
    """Split-K's reduction kernel (`triton_kernels.split_k_reduce_kernel`) of one variant, in the
    launcher's layout: a contiguous fp32 workspace, row-major outputs, contiguous scales."""
    fn, config = split_k_reduce_kernel, SPLIT_K_REDUCE[arch]
    pointers = {"ws_ptr": "*fp32", "out_ptr": _PTR[variant.out_dtype], "aux_ptr": _PTR[variant.aux_dtype]}
    for name in ("scale_a_ptr", "scale_b_ptr", "out_scale_ptr", "amax_ptr", "other_ptr"):
        pointers[name] = "*fp32"
    pointers["bias_ptr"] = pointers["residual_ptr"] = "*bf16"
    constexprs = {**variant.constexprs(), "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "stride_on": 1, "stride_aux_n": 1}
    signature = _signature(fn, pointers, constexprs)
    aligned = ("N", "stride_ws", "stride_wm", "stride_om", "stride_xm", "stride_rm", "stride_aux_m")
    kernel = _compile(fn, signature, constexprs, arch, config.num_warps, config.num_stages, aligned)
    return _result(f"{variant.name}.split_k_reduce", arch, config, kernel, None, "split_k_reduce")


def gemm_ir(variant: GemmVariant, arch: str, config: TileConfig, family: str = "pointer") -> dict[str, str]:
    """The kernel's intermediate forms by stage name (ttir, ttgir, llir, ptx), for tests that read them."""
    kernel = _gemm_kernel(variant, arch, config, family)
    return {stage: text for stage, text in kernel.asm.items() if isinstance(text, str)}


def build_quantize(variant: QuantizeVariant, arch: str) -> BuildResult:
    blocking = variant.blocking()  # as the launcher runs it
    config = TileConfig(blocking["TILE_R"], 1, blocking["TILE_C"], 1, 4, 1)  # (tile_r, -, tile_c), for the report
    constexprs = {**variant.constexprs(), **blocking, "COLUMNS_FIRST": False, "stride_xc": 1}
    pointers = {"x_ptr": _PTR[variant.in_dtype], "out_ptr": _PTR[variant.out_dtype], "scale_ptr": "*fp32", "amax_ptr": "*fp32"}
    signature = _signature(quantize_kernel, pointers, constexprs)
    kernel = _compile(quantize_kernel, signature, constexprs, arch, 4, 1, aligned=("C", "stride_xr", "stride_or"))
    return _result(variant.name, arch, config, kernel, None, "quantize")


def build_nvfp4(arch: str, config: TileConfig, out_dtype: torch.dtype = torch.bfloat16) -> BuildResult:
    """The NVFP4 GEMM (`nvfp4_kernel.nvfp4_gemm_kernel`) built for one arch and config, in the
    launcher's layout: packed operands and E4M3 scales K-contiguous, output row-major."""
    from fp8fx.codegen.nvfp4_kernel import nvfp4_gemm_kernel as fn

    pointers = {
        "a_ptr": "*u8",
        "b_ptr": "*u8",
        "out_ptr": _PTR[out_dtype],
        "scale_a_ptr": "*fp8e4nv",
        "scale_b_ptr": "*fp8e4nv",
        "tensor_scale_a_ptr": "*fp32",
        "tensor_scale_b_ptr": "*fp32",
    }
    constexprs = {**config.constexprs(), "stride_ak": 1, "stride_bk": 1, "stride_on": 1, "stride_sa_k": 1, "stride_sb_k": 1}
    signature = _signature(fn, pointers, constexprs)
    aligned = ("N", "K_BYTES", "stride_am", "stride_bn", "stride_om")
    kernel = _compile(fn, signature, constexprs, arch, config.num_warps, config.num_stages, aligned)
    return _result(f"nvfp4_gemm_{_PTR[out_dtype][1:]}", arch, config, kernel, NVFP4_MMA, "nvfp4")


def _grouped_kernel(variant: GroupedVariant, arch: str, config: TileConfig):
    from fp8fx.codegen.grouped_kernel import fp8_grouped_gemm_kernel as fn

    # The launcher's layout: K-contiguous operands, row-major outputs, contiguous scales.
    pointers = {
        "a_ptr": _PTR[variant.a_dtype],
        "b_ptr": _PTR[variant.b_dtype],
        "out_ptr": _PTR[variant.out_dtype],
        "scale_a_ptr": "*fp32",
        "scale_b_ptr": "*fp32",
        "offs_ptr": "*i32",
    }
    constexprs = {**variant.constexprs(), **config.constexprs(), "stride_ak": 1, "stride_bk": 1, "stride_on": 1}
    signature = _signature(fn, pointers, constexprs)
    aligned = ("N", "K", "stride_am", "stride_bg", "stride_bn", "stride_og", "stride_om")
    return _compile(fn, signature, constexprs, arch, config.num_warps, config.num_stages, aligned)


def build_grouped(variant: GroupedVariant, arch: str, config: TileConfig) -> BuildResult:
    """The grouped GEMM (`grouped_kernel.fp8_grouped_gemm_kernel`) built for one arch and config."""
    mma = BLOCK_SCALED_MMA if variant.block_scaled else FP8_MMA[arch]
    return _result(variant.name, arch, config, _grouped_kernel(variant, arch, config), mma, "grouped")


# Warp specialization is read from the TTGIR: the partitions are the regions of a
# `ttg.warp_specialize` op (its PTX then rebalances registers between them with `setmaxnreg`:
# 10 of them in the sm_100a kernel; a config asking for it on Hopper gets neither).
_WARP_SPECIALIZED_TTGIR = re.compile(r"ttg\.warp_specialize\b")
_TMA_LOAD = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.")


def _mma_name(instruction: str) -> str:
    for old, new in _SCALE_VEC_ALIASES.items():
        if instruction.endswith(old):
            return instruction[: -len(old)] + new
    return instruction


def _result(name: str, arch: str, config: TileConfig, kernel, mma: re.Pattern | None, family: str) -> BuildResult:
    ptx = kernel.asm["ptx"]
    found = mma.search(ptx) if mma is not None else None
    registers, spills = _ptxas_report(ptx, arch)
    return BuildResult(
        name,
        arch,
        config.describe(),
        _mma_name(found.group(0)) if found else None,
        registers,
        spills,
        kernel.metadata.shared,
        SHARED_MEMORY_LIMIT[arch],
        family=family,
        tma=bool(_TMA_LOAD.search(ptx)),
        warp_specialized=bool(_WARP_SPECIALIZED_TTGIR.search(kernel.asm["ttgir"])),
        warp_specialize_asked=bool(dict(config.extra).get("WARP_SPECIALIZE", False)),
    )


def _build_one(job) -> BuildResult:
    variant, arch, config, family = job
    if isinstance(variant, QuantizeVariant):
        return build_quantize(variant, arch)
    return build_gemm(variant, arch, config, family)


def families_of(arch: str) -> tuple[str, ...]:
    """The GEMM kernel families with tile configs for `arch`: the pointer kernel everywhere (Ada's
    kernel, and the fallback), the TMA kernel on Hopper and Blackwell."""
    return tuple(f for f in FAMILIES if (arch, f) in CONFIGS)


def build_all(
    variants, archs=tuple(CAPABILITY), all_configs: bool = False, workers: int = 2, families: tuple | None = None
) -> list[BuildResult]:
    """Build every variant for every arch and kernel family (`families`, default: each arch's
    `families_of`), with each tile config or the arch's first (the largest), in `workers`
    processes. Quantize variants build once per arch."""
    from concurrent.futures import ProcessPoolExecutor

    jobs = []
    for variant in dict.fromkeys(variants):
        for arch in archs:
            if isinstance(variant, QuantizeVariant):
                jobs.append((variant, arch, None, "quantize"))
                continue
            for family in families_of(arch) if families is None else [f for f in families if (arch, f) in CONFIGS]:
                configs = configs_for(arch, variant, family)
                jobs += [(variant, arch, c, family) for c in (configs if all_configs else configs[:1])]
    if workers <= 1:
        return [_build_one(j) for j in jobs]
    import multiprocessing

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_build_one, jobs))


def coverage_variants() -> list:
    """A small set of variants in which every epilogue hook, scale granularity, operand format
    pair and output dtype appears at least once, plus the quantize kernels of each granularity."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    gemms = [
        GemmVariant(e4, e4, (), (), Epilogue(bias=True, activation="gelu", aux="pre_activation", out_amax=True), torch.bfloat16),
        GemmVariant(e4, e4, (1, 0), (0, 1), Epilogue(activation="silu", mul="by_other", aux="activation"), torch.float16),
        GemmVariant(
            e4, e4, (1, 128), (128, 128), Epilogue(mul="gated", mul_activation="silu", aux="pre_activation"), torch.bfloat16
        ),
        GemmVariant(e5, e4, (1, 128), (128, 1), Epilogue(activation="relu", residual=True, aux="product"), torch.float32),
        GemmVariant(e4, e5, (), (), Epilogue(activation="gelu_tanh", residual=True, aux="sum", out_amax=True), torch.bfloat16),
        GemmVariant(e4, e4, (), (), Epilogue(bias=True, residual=True), e4),
    ]
    quantizers = [
        QuantizeVariant(torch.bfloat16, fmt, block, amax_given=not block)
        for fmt in (e4, e5)
        for block in ((), (1, 0), (0, 1), (1, 128), (128, 128), (128, 1))
    ]
    quantizers += [QuantizeVariant(torch.float32, e4, block, scale_given=True) for block in ((), (1, 0), (1, 128), (128, 1))]
    return gemms + quantizers


__all__ = [
    "BuildResult",
    "build_all",
    "build_gemm",
    "build_grouped",
    "build_nvfp4",
    "build_quantize",
    "coverage_variants",
    "families_of",
    "gemm_ir",
]
