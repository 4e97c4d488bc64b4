"""Kernel variants: the constexpr signature of each generated kernel, tile configs per GPU target,
and which target a device is. Imports no Triton: the graph passes and the report use it too.

A variant is everything that changes the generated code (operand formats, scale granularity,
epilogue, accumulation precision, output dtype); sizes and strides do not. Triton caches one binary
per variant and config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from fp8fx.codegen import versions
from fp8fx.core.epilogue import PLAIN, Epilogue
from fp8fx.core.formats import fp8_format_of
from fp8fx.core.recipes import MX_BLOCK, NVFP4_BLOCK

_FP8_CONSTS = {  # FP8_MAX, MANTISSA_BITS, MIN_EXPONENT (of normal numbers)
    torch.float8_e4m3fn: (448.0, 3, -6),
    torch.float8_e5m2: (57344.0, 2, -14),
}
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
_SHORT = {
    torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2",
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
}


@dataclass(frozen=True)
class GemmVariant:
    """One generated FP8 GEMM kernel: C[M, N] = epilogue(A[M, K] @ B[K, N])."""

    a_dtype: torch.dtype
    b_dtype: torch.dtype
    block_a: tuple = ()  # scale blocks, as in fp8fx.core.scaling: () | (rows, k) with 0 = whole dim
    block_b: tuple = ()
    epilogue: Epilogue = PLAIN
    out_dtype: torch.dtype = torch.bfloat16
    aux_dtype: torch.dtype = torch.bfloat16
    # Hopper's FP8 wgmma accumulates in reduced precision: fast_accum keeps the whole K loop there,
    # otherwise each BLOCK_K slice is promoted to the fp32 accumulator (TE's split accumulator).
    fast_accum: bool = False

    def __post_init__(self):
        for name in ("a_dtype", "b_dtype"):
            fp8_format_of(getattr(self, name))
        if self.a_dtype == self.b_dtype == torch.float8_e5m2:
            raise ValueError("FP8 GEMM with two E5M2 operands: no tensor-core instruction takes it; use format hybrid or e4m3")
        if self.out_dtype not in _OUT_DTYPES:
            raise ValueError(f"FP8 GEMM output dtype {self.out_dtype} is not one of {_OUT_DTYPES}")
        for name, block in (("block_a", self.block_a), ("block_b", self.block_b)):
            if block and (len(block) != 2 or any(b not in (0, 1) and b % 16 for b in block)):
                raise ValueError(f"FP8 GEMM {name}={block}: blocks are () or two sizes in {{0, 1, multiples of 16}}")

    @property
    def k_block(self) -> int:
        """Size of the K-blocks scales are promoted at (0: scales constant along K)."""
        ks = [k for k in (self.block_a[1] if self.block_a else 0, self.block_b[0] if self.block_b else 0) if k]
        return min(ks) if ks else 0

    @property
    def name(self) -> str:
        def blk(b):
            return "t" if not b else "x".join(str(v) if v else "all" for v in b)

        ep = self.epilogue.spec().replace(",", "_").replace("=", "-") or "plain"
        fast = "_fastacc" if self.fast_accum else ""
        return (
            f"fp8_gemm_{_SHORT[self.a_dtype]}{_SHORT[self.b_dtype]}_s{blk(self.block_a)}.{blk(self.block_b)}"
            f"_{ep}_{_SHORT[self.out_dtype]}{fast}"
        )

    def constexprs(self) -> dict:
        out_fp8 = self.out_dtype in _FP8_CONSTS
        fp8_max, mantissa, min_exp = _FP8_CONSTS[self.out_dtype] if out_fp8 else _FP8_CONSTS[torch.float8_e4m3fn]
        a_rows, a_k = self.block_a or (0, 0)
        b_k, b_cols = self.block_b or (0, 0)
        return dict(
            A_ROW_BLOCK=a_rows,
            A_K_BLOCK=a_k,
            B_K_BLOCK=b_k,
            B_COL_BLOCK=b_cols,
            **self.epilogue.constexprs(),
            OUT_FP8=out_fp8,
            FP8_MAX=fp8_max,
            MANTISSA_BITS=mantissa,
            MIN_EXPONENT=min_exp,
            FAST_ACCUM=self.fast_accum,
        )

    @property
    def mx(self) -> bool:
        """MX (OCP Microscaling) blocks: 1 x 32 along K for A, 32 x 1 for B, power-of-two scales."""
        return self.block_a == (1, MX_BLOCK) and self.block_b == (MX_BLOCK, 1)

    def with_epilogue(self, **changes) -> GemmVariant:
        return replace(self, epilogue=replace(self.epilogue, **changes))


def nvfp4_blocks(block_a, block_b) -> bool:
    """Whether scale blocks `block_a` x `block_b` are NVFP4's (16 along K; weights 16 x 16)."""
    return tuple(block_a) in ((1, NVFP4_BLOCK), (NVFP4_BLOCK, NVFP4_BLOCK)) and tuple(block_b) in (
        (NVFP4_BLOCK, 1),
        (NVFP4_BLOCK, NVFP4_BLOCK),
    )


@dataclass(frozen=True)
class QuantizeVariant:
    """One generated quantize kernel: amax per block (or given), scale, saturating cast."""

    in_dtype: torch.dtype
    out_dtype: torch.dtype
    block: tuple = ()
    margin: int = 0
    power_of_two: bool = False
    amax_given: bool = False
    scale_given: bool = False  # a cast with scales computed beforehand

    def blocking(self) -> dict[str, int]:
        """The launch's geometry, as `quantize_kernel` constexprs: the ROW_BLOCK x COL_BLOCK scale block
        (0: the whole dimension), the TILE_R x TILE_C tile a program walks its part in, and the BLOCKS_R x
        BLOCKS_C blocks each program covers: one, or a tile's worth along a block side of 1 (32 rows of
        rowwise or 1 x 128 blocks, 128 columns of per-column or 128 x 1 ones), so that no program is a
        single row or column. Tensorwise runs 32 x 128 blocks that share one scale."""
        b0, b1 = self.block or (32, 128)

        def tile(b: int, cap: int) -> int:
            return min(1 << (b - 1).bit_length(), cap) if b > 1 else cap

        # Per-column scales take registers beside the tile: 16-row tiles there, as 32 spill on Triton 3.6 (sm_89).
        tile_r, tile_c = tile(b0, 16 if b1 == 1 else 32), tile(b1, 128)
        blocks_r, blocks_c = (tile_r if b0 == 1 else 1), (tile_c if b1 == 1 else 1)
        return {"ROW_BLOCK": b0, "COL_BLOCK": b1, "TILE_R": tile_r, "TILE_C": tile_c, "BLOCKS_R": blocks_r, "BLOCKS_C": blocks_c}

    def programs(self, rows: int, cols: int) -> tuple[int, int]:
        """Programs along the rows and the columns of a rows x cols tensor, `blocking`'s."""
        g = self.blocking()

        def count(n: int, block: int, per_program: int) -> int:
            blocks = -(-n // block) if block else 1
            return -(-blocks // per_program)

        return count(rows, g["ROW_BLOCK"], g["BLOCKS_R"]), count(cols, g["COL_BLOCK"], g["BLOCKS_C"])

    def constexprs(self) -> dict:
        fp8_max, mantissa, min_exp = _FP8_CONSTS[self.out_dtype]
        return {
            "AMAX_GIVEN": self.amax_given,
            "SCALE_GIVEN": self.scale_given,
            "FP8_MAX": fp8_max,
            "MARGIN_FACTOR": 2.0**self.margin,
            "POWER_OF_TWO": self.power_of_two,
            "MANTISSA_BITS": mantissa,
            "MIN_EXPONENT": min_exp,
        }

    @property
    def name(self) -> str:
        blk = "t" if not self.block else "x".join(str(v) if v else "all" for v in self.block)
        return (
            f"quantize_{_SHORT[self.in_dtype]}_to_{_SHORT[self.out_dtype]}_s{blk}"
            + ("_p2" if self.power_of_two else "")
            + ("_amaxin" if self.amax_given else "")
            + ("_scalein" if self.scale_given else "")
        )


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    extra: tuple = ()  # (name, value) constexprs of one kernel family only (the TMA kernel's)

    def constexprs(self) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k, GROUP_M=self.group_m, **dict(self.extra))

    def describe(self) -> str:
        extra = "".join(f" {k.lower()}={v}" for k, v in self.extra)
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}{extra}"


# Where kernels run: three GPU architectures, and Triton's interpreter on CPU tensors (tests and
# debugging). Each target runs one kernel family by default: `pointer` (tiles loaded through
# pointers, `fp8fx.codegen.triton_kernels`) or `tma` (persistent, operands through TMA tensor
# descriptors, `fp8fx.codegen.tma_kernel`); the interpreter runs either, with small tiles.
GPU_TARGETS = ("sm_89", "sm_90a", "sm_100a")
TARGETS = (*GPU_TARGETS, "interpreter")
FAMILIES = ("pointer", "tma")
DEFAULT_FAMILY = {"sm_89": "pointer", "sm_90a": "tma", "sm_100a": "tma", "interpreter": "tma"}

# Tile configs per target and family, largest first; each one is compiled on the CPU for every
# variant in the tests, which check that it uses FP8 tensor cores, does not spill and fits shared
# memory. Pointer kernel on Hopper / Blackwell: 128-wide tiles with 8 warps (two warpgroups) and
# 4 stages; 128 x 256 tiles spill with the larger epilogues. Ada: 99 KB of shared memory and
# mma.sync; 128 x 128 tiles spill with a GELU epilogue, so 128 x 64. Epilogues that load tiles
# (product, residual) get the smaller tiles only (see configs_for). BLOCK_K = 128 matches blockwise
# scaling's K-blocks. The interpreter times nothing: one config, so its autotuner never benchmarks.
_HOPPER = (
    TileConfig(128, 128, 128, 8, 8, 4),
    TileConfig(128, 64, 128, 8, 8, 4),
    TileConfig(128, 128, 64, 8, 8, 4),
    TileConfig(64, 128, 128, 8, 4, 4),
    TileConfig(64, 64, 128, 8, 4, 3),
)
CONFIGS: dict[tuple[str, str], tuple[TileConfig, ...]] = {
    ("sm_90a", "pointer"): _HOPPER,
    ("sm_100a", "pointer"): _HOPPER,
    ("sm_89", "pointer"): (TileConfig(128, 64, 128, 8, 4, 3), TileConfig(64, 64, 128, 8, 4, 3)),
    ("interpreter", "pointer"): (TileConfig(32, 32, 32, 2, 1, 1),),
    # Persistent TMA kernel (fp8fx.codegen.tma_kernel): the epilogue runs on 4 (2) column slices
    # of 128 x 128 (128 x 64) tiles, which keeps every coverage variant out of spills; 128 x 256
    # tiles spill (blockwise promotion holds two 128-value tiles per thread). Blackwell warp-
    # specializes the tile loop; Triton 3.9 does not on Hopper (its pass fails on this kernel with
    # 4 warps, does nothing with 8), which flattens the loop instead: that frees the registers
    # its 128 x 128 tiles need.
    ("sm_100a", "tma"): (
        TileConfig(128, 128, 128, 8, 8, 4, (("EPILOGUE_SUBTILE", 4), ("WARP_SPECIALIZE", True))),
        TileConfig(128, 128, 128, 8, 8, 4, (("EPILOGUE_SUBTILE", 4),)),
        TileConfig(128, 64, 128, 8, 8, 4, (("EPILOGUE_SUBTILE", 2), ("WARP_SPECIALIZE", True))),
    ),
    ("sm_90a", "tma"): (
        TileConfig(128, 128, 128, 8, 8, 4, (("EPILOGUE_SUBTILE", 4), ("FLATTEN", True))),
        TileConfig(128, 64, 128, 8, 8, 4, (("EPILOGUE_SUBTILE", 2),)),
    ),
    ("interpreter", "tma"): (TileConfig(32, 32, 32, 2, 1, 1, (("EPILOGUE_SUBTILE", 2),)),),
    # MX GEMMs on Blackwell: the pointer kernel with block-scaled MMAs (BLOCK_SCALED_MMA), whole
    # 128-wide K tiles (four E8M0 scales per row each); the interpreter runs the same kernel.
    ("sm_100a", "mx"): (
        TileConfig(128, 128, 128, 8, 8, 4, (("BLOCK_SCALED_MMA", True),)),
        TileConfig(128, 64, 128, 8, 8, 4, (("BLOCK_SCALED_MMA", True),)),
    ),
    ("interpreter", "mx"): (TileConfig(32, 32, 64, 2, 1, 1, (("BLOCK_SCALED_MMA", True),)),),
}


# Split-K (`split_k`): a GEMM whose output tiles leave SMs idle (the weight gradients of narrow
# projections: small M x N, the token count as K) splits K into SPLITS ranges of whole BLOCK_K
# windows, one program per (tile, split), each writing its fp32 partial sum to a workspace
# [splits, M, N]; `triton_kernels.split_k_reduce_kernel` adds the partials in split order (the
# same order every run: bit-reproducible, unlike atomics) and then runs the scales and the epilogue
# once. The rule: the largest split count that keeps tiles x splits within one wave (at most one
# program per SM: a second, partial wave would cost a whole wave of K / splits), with each split at
# least SPLIT_K_MIN_K long (a pipelined K loop shorter than that is mostly prologue). The workspace
# is then at most SMs x BLOCK_M x BLOCK_N fp32 values (8.6 MB on an H200 with 128 x 128 tiles).
# These numbers are a first guess, not measured on a GPU yet. The interpreter's minimum keeps the
# CPU tests' small GEMMs unsplit (their K stays under 512), so split-K runs where a test asks for it.
SPLIT_K_MIN_K = {"sm_89": 1024, "sm_90a": 1024, "sm_100a": 1024, "interpreter": 256}
# The reduction kernel's tile per target: 32 accumulator values per thread (the epilogue's bound,
# `configs_for`), so the heaviest epilogue stays out of spills. BLOCK_K is unused (0).
SPLIT_K_REDUCE = {
    "sm_89": TileConfig(64, 64, 0, 1, 4, 1),
    "sm_90a": TileConfig(64, 64, 0, 1, 4, 1),
    "sm_100a": TileConfig(64, 64, 0, 1, 4, 1),
    "interpreter": TileConfig(32, 32, 0, 1, 1, 1),
}


def split_k(target: str, m: int, n: int, k: int, tile: TileConfig, sms: int) -> int:
    """How many K ranges a GEMM of m x n x k runs in on `target` with `sms` SMs, its output in
    tiles of `tile` (the target's first config for the variant): 1 (no split) unless its tiles
    fill less than half the SMs; else the largest count with tiles x splits <= sms and
    k / splits >= SPLIT_K_MIN_K[target]. See the comment above SPLIT_K_MIN_K."""
    tiles = -(-m // tile.block_m) * -(-n // tile.block_n)
    if tiles == 0 or k <= 0:
        return 1
    return max(1, min(sms // tiles, k // SPLIT_K_MIN_K[target]))


def _without_warp_specialization(configs: tuple[TileConfig, ...]) -> tuple[TileConfig, ...]:
    """`configs` with WARP_SPECIALIZE dropped from each (duplicates removed, order kept)."""
    plain = [replace(c, extra=tuple(kv for kv in c.extra if kv[0] != "WARP_SPECIALIZE")) for c in configs]
    return tuple(dict.fromkeys(plain))


# Triton before 3.7 cannot warp-specialize the persistent TMA kernel for sm_100a (its pass fails
# to build it): Blackwell then runs the same tiles with the tile loop left whole.
if not versions.has("sm100_warp_specialize"):
    CONFIGS["sm_100a", "tma"] = _without_warp_specialization(CONFIGS["sm_100a", "tma"])
# Triton's interpreter runs no tl.dot_scaled before 3.8: MX GEMMs there take the interpreter's
# default family (each 32-K block promoted in fp32, as on Hopper) instead of the block-scaled MMA.
if not versions.has("interpreter_dot_scaled"):
    del CONFIGS["interpreter", "mx"]
# The NVFP4 GEMM (fp8fx.codegen.nvfp4_kernel): Blackwell only (FP4 tensor cores), and the
# interpreter. BLOCK_K counts FP4 elements: 256 is 128 bytes of each operand row per step.
NVFP4_CONFIGS: dict[str, tuple[TileConfig, ...]] = {
    "sm_100a": (TileConfig(128, 128, 256, 8, 4, 3), TileConfig(128, 64, 256, 8, 4, 3), TileConfig(128, 128, 128, 8, 4, 4)),
    "interpreter": (TileConfig(32, 32, 64, 2, 1, 1),),
}
# Targets whose grouped GEMMs take MX blocks on the block-scaled MMA (GroupedVariant.block_scaled).
GROUPED_BLOCK_SCALED_TARGETS = ("sm_100a", "interpreter") if versions.has("interpreter_dot_scaled") else ("sm_100a",)
# The grouped GEMM (fp8fx.codegen.grouped_kernel): pointer loads, persistent over the groups'
# tiles. Mixture-of-experts groups are often a few hundred tokens, so smaller tiles follow the
# largest; 128 x 128 x 128 on 8 warps is the dense pointer kernel's first config.
GROUPED_CONFIGS: dict[str, tuple[TileConfig, ...]] = {
    "sm_90a": (TileConfig(128, 128, 128, 8, 8, 4), TileConfig(64, 128, 128, 8, 4, 4), TileConfig(64, 64, 128, 8, 4, 3)),
    "sm_100a": (TileConfig(128, 128, 128, 8, 8, 4), TileConfig(64, 128, 128, 8, 4, 4), TileConfig(64, 64, 128, 8, 4, 3)),
    "sm_89": (TileConfig(128, 64, 128, 8, 4, 3), TileConfig(64, 64, 128, 8, 4, 3)),
    "interpreter": (TileConfig(32, 32, 32, 2, 1, 1),),
}


@dataclass(frozen=True)
class GroupedVariant:
    """One generated grouped FP8 GEMM: 2D-3D (groups of a's rows, one B per group) or 2D-2D
    (k_grouped: groups of the contraction dimension, one output per group)."""

    a_dtype: torch.dtype
    b_dtype: torch.dtype
    k_grouped: bool
    out_dtype: torch.dtype = torch.bfloat16
    fast_accum: bool = False
    k_block: int = 0  # scales per block of this many along K (MX 32, blockwise 128); 0: constant along K
    b_col_block: int = 1  # with k_block: B's scale blocks across N (blockwise weights: 128)
    block_scaled: bool = False  # MX blocks through the block-scaled MMA (Blackwell, and the interpreter)

    def __post_init__(self):
        for name in ("a_dtype", "b_dtype"):
            fp8_format_of(getattr(self, name))
        if self.a_dtype == self.b_dtype == torch.float8_e5m2:
            raise ValueError("grouped FP8 GEMM with two E5M2 operands: no tensor-core instruction takes it")
        if self.out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"grouped FP8 GEMM output dtype must be float32, bfloat16 or float16, got {self.out_dtype}")

    @property
    def name(self) -> str:
        form = "2d2d" if self.k_grouped else "2d3d"
        fast = "_fastacc" if self.fast_accum else ""
        blocks = f"_k{self.k_block}x{self.b_col_block}{'_mma' if self.block_scaled else ''}" if self.k_block else ""
        return f"fp8_grouped_gemm_{form}_{_SHORT[self.a_dtype]}{_SHORT[self.b_dtype]}{blocks}_{_SHORT[self.out_dtype]}{fast}"

    def constexprs(self) -> dict:
        return {
            "K_GROUPED": self.k_grouped,
            "FAST_ACCUM": self.fast_accum,
            "K_BLOCK": self.k_block,
            "B_COL_BLOCK": self.b_col_block,
            "BLOCK_SCALED_MMA": self.block_scaled,
        }

    def configs(self, target: str) -> tuple[TileConfig, ...]:
        """`target`'s grouped tile configs for this variant. K-block scales promote each window's
        product, a second tile beside the accumulator: they take BLOCK_K dividing the K block and
        at most 64 x 64 accumulator values per 4 warps (larger tiles spilled 16-1472 bytes on
        sm_90a / sm_100a)."""
        configs = GROUPED_CONFIGS[target]
        if target == "sm_90a" and self.k_grouped and not versions.has("sm90_grouped_wgrad_128x128"):
            configs = tuple(c for c in configs if c.block_m * c.block_n < 128 * 128)  # Triton < 3.7 spills them
        if not self.k_block:
            return configs
        if self.block_scaled:
            # Blackwell's block-scaled MMA takes 128-row tiles (Triton emulates it on smaller ones);
            # whole K tiles of MX blocks, one block in 2D-2D, whose groups may end at any block.
            configs = tuple(c for c in configs if c.block_m == 128 or target == "interpreter")
            return tuple(replace(c, block_k=self.k_block) for c in configs) if self.k_grouped else configs
        fits = [c for c in configs if target == "interpreter" or c.block_m * c.block_n <= 1024 * c.num_warps]
        return tuple(replace(c, block_k=math.gcd(c.block_k, self.k_block)) for c in fits)


# CUDA's grid limits: x up to 2**31 - 1 programs, y and z up to 65535.
GRID_LIMITS = (2**31 - 1, 65535, 65535)


def arch_of(capability: tuple[int, int], hip: bool = False) -> str:
    """The GPU target of a device's compute capability (`torch.cuda.get_device_capability`)."""
    major, minor = capability
    if hip:  # ROCm reports its gfx version as a capability (gfx942: 9.4); its FP8 formats differ (FNUZ)
        raise RuntimeError(
            f"fp8fx: ROCm GPUs are not supported (capability {major}.{minor} reported by a HIP build of torch); "
            "fp8fx's kernels and formats are NVIDIA's (sm_89, sm_90a, sm_100a)"
        )
    if major == 9:
        return "sm_90a"
    if major == 10:
        return "sm_100a"
    if (major, minor) == (8, 9) or major == 12:  # Ada; consumer Blackwell uses the same mma.sync path
        return "sm_89"
    raise RuntimeError(f"fp8fx: GPU capability {major}.{minor} has no FP8 tensor cores (needs sm_89, sm_90 or sm_100)")


def device_target(device: torch.device) -> str:
    """`arch_of` for a CUDA device; "interpreter" for CPU tensors (run by Triton's interpreter)."""
    if device.type != "cuda":
        return "interpreter"
    return arch_of(torch.cuda.get_device_capability(device), hip=torch.version.hip is not None)


def gemm_family(target: str, variant: GemmVariant) -> str:
    """The kernel family that runs `variant`'s GEMM on `target`: MX GEMMs run "mx" (block-scaled
    MMAs) where it has tile configs (Blackwell, and the interpreter that tests it); everything else
    the target's default (`DEFAULT_FAMILY`)."""
    if variant.mx and (target, "mx") in CONFIGS:
        return "mx"
    return DEFAULT_FAMILY[target]


# Split-K's partial-sum kernels that spill (bytes, Triton 3.9): excluded from `configs_for(partial=True)`.
# The sm_100a pointer kernel (the fallback there: Blackwell runs tma, mx) with 128 x 64 tiles: 16.
_PARTIAL_SPILLS = {("sm_100a", "pointer", 128, 64)}


def configs_for(target: str, variant: GemmVariant, family: str | None = None, partial: bool = False) -> tuple[TileConfig, ...]:
    """Configs of `target` usable for `variant`: with K-block scales, BLOCK_K must divide the K-block.
    `partial`: for split-K's partial sums, which run no epilogue (the reduction kernel does), so
    the epilogue's limit on tile sizes does not apply."""
    family = family or DEFAULT_FAMILY[target]
    configs = CONFIGS[target, family]
    e = variant.epilogue
    if partial:
        configs = tuple(c for c in configs if (target, family, c.block_m, c.block_n) not in _PARTIAL_SPILLS)
    elif target != "interpreter" and (e.mul != "none" or e.residual or (e.activation != "none" and e.aux != "none")):
        # Epilogues that load full tiles of other tensors, or keep a value beside its activation,
        # hold a second tile in registers beside the accumulator: at most 32 accumulator values per
        # thread keeps them from spilling (bias + GELU + pre-activation aux spilled 8-20 bytes at
        # 128x64 on sm_89 and 128x128 on sm_100a with the pointer kernel).
        configs = tuple(
            c for c in configs if c.block_m * c.block_n <= 32 * 32 * c.num_warps * c.constexprs().get("EPILOGUE_SUBTILE", 1)
        )
    k_block = variant.k_block
    if k_block and family != "mx":  # (block-scaled MMAs take the K-blocks' scales within a tile)
        configs = tuple(replace(c, block_k=math.gcd(c.block_k, k_block)) for c in configs)
    return configs
