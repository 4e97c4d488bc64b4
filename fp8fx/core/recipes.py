"""FP8 recipes as data: the choices a policy makes per GEMM, how each granularity places its
scales on a GEMM's operands, and the named recipes (torchao, TransformerEngine, DeepSeek-V3,
Megatron) as the settings they expand to. A new granularity is a row of `GRANULARITIES` plus
its scale math (fp8fx.core.scaling)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

GEMM_ROLES = ("output", "grad_input", "grad_weight")


class Precision(str, Enum):
    FP8 = "fp8"
    HIGH = "high"


class Scaling(str, Enum):
    """dynamic: the scale comes from this tensor's amax (TE's current scaling). delayed: from an
    amax history of past steps (TE's DelayedScaling), kept as state in the model."""

    DYNAMIC = "dynamic"
    DELAYED = "delayed"


class AmaxComputeAlgo(str, Enum):
    MAX = "max"
    MOST_RECENT = "most_recent"


class Level(str, Enum):
    """MS-AMP's precision levels for data-parallel training (fp8fx.distributed): O1 reduces weight
    gradients in FP8 and computes with FP16 weights; O2 adds AdamW with an FP8 first and an FP16
    second moment; O3 adds FP8 weight all-gather and FP16 master weights (FSDP2 only)."""

    O1 = "O1"
    O2 = "O2"
    O3 = "O3"


class Granularity(str, Enum):
    """One scale per tensor; per row/column along the contraction dim (torchao's axiswise);
    DeepSeek-V3's blocks (1x128 activations and gradients, 128x128 weights); or OCP Microscaling
    (MX): one power-of-two (E8M0) scale per 32 elements along the contraction dim, every operand;
    or NVFP4's: one E4M3 scale per 16 elements along the contraction dim (16x16 blocks for
    weights) under one fp32 scale per tensor (format nvfp4 only)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"
    MX = "mx"
    NVFP4 = "nvfp4"


class ScaleRounding(str, Enum):
    """How an MX block's E8M0 scale is rounded (torchao's `ScaleCalculationMode`). floor: the OCP MX
    spec's `2**(floor(log2(amax)) - emax)` with emax the format's largest power of two (8 for E4M3),
    which can push a block's largest values past the format's max (they saturate). rceil: cuBLAS's
    and TransformerEngine's `2**ceil(log2(amax / fp8_max))`, the smallest power of two that does not
    saturate."""

    FLOOR = "floor"
    RCEIL = "rceil"


class Hadamard(str, Enum):
    """Which GEMMs' operands NVFP4 multiplies by a 16x16 random Hadamard transform along K before
    the cast (fp8fx.core.fp4): none, or the weight gradient's (TE's NVFP4 default), whose K is the
    token count and whose operands' outliers the transform spreads over their blocks."""

    NONE = "none"
    WGRAD = "wgrad"


BLOCK = 128  # DeepSeek-V3's tile
MX_BLOCK = 32  # OCP Microscaling's block
NVFP4_BLOCK = 16  # NVFP4's block (TE: 1x16 along K; 16x16 for weights)
# NVFP4 GEMMs need N and K in multiples of 32: a row of packed FP4 (two a byte) is then a multiple
# of 16 bytes, the TMA and cuBLASLt alignment of Blackwell's block-scaled GEMMs.
NVFP4_ALIGN = 32
ALIGN = 16  # FP8 tensor-core GEMMs need N and K in multiples of 16


@dataclass(frozen=True)
class GranularitySpec:
    """The scale blocks (see fp8fx.core.scaling: rows x cols of the last two dims, 0 = the whole
    dim) of a GEMM's left (M x K) and right (K x N) operand; always along the contraction dim K.
    A weight may take other blocks than an activation or a gradient on the same side. `align`: what
    the GEMM's N and K must be multiples of for an FP8 GEMM of this granularity."""

    left: tuple[int, ...]
    right: tuple[int, ...]
    weight_left: tuple[int, ...]
    weight_right: tuple[int, ...]
    align: int = ALIGN

    def blocks(self, roles: tuple[str, str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Blocks of the left and right operand, whose roles are `roles` (input | weight | grad_output)."""
        left = self.weight_left if roles[0] == "weight" else self.left
        right = self.weight_right if roles[1] == "weight" else self.right
        return left, right


GRANULARITIES: dict[Granularity, GranularitySpec] = {
    Granularity.TENSORWISE: GranularitySpec((), (), (), ()),
    Granularity.ROWWISE: GranularitySpec((1, 0), (0, 1), (1, 0), (0, 1)),
    Granularity.BLOCKWISE: GranularitySpec((1, BLOCK), (BLOCK, 1), (BLOCK, BLOCK), (BLOCK, BLOCK)),
    Granularity.MX: GranularitySpec((1, MX_BLOCK), (MX_BLOCK, 1), (1, MX_BLOCK), (MX_BLOCK, 1), align=MX_BLOCK),
    Granularity.NVFP4: GranularitySpec(
        (1, NVFP4_BLOCK), (NVFP4_BLOCK, 1), (NVFP4_BLOCK, NVFP4_BLOCK), (NVFP4_BLOCK, NVFP4_BLOCK), align=NVFP4_ALIGN
    ),
}


# Named recipes: what each expands to, and whose recipe it reproduces.
RECIPES: dict[str, dict[str, Any]] = {
    # torchao "tensorwise"; TE Float8CurrentScaling (HYBRID)
    "tensorwise": {"format": "hybrid", "granularity": "tensorwise"},
    # torchao "rowwise": E4M3 everywhere, axiswise scales rounded down to powers of two
    "rowwise": {"format": "e4m3", "granularity": "rowwise", "power_of_two_scales": True},
    # torchao "rowwise_with_gw_hp": rowwise, grad_weight GEMM in high precision
    "rowwise_gw_hp": {"format": "e4m3", "granularity": "rowwise", "power_of_two_scales": True, "gemms": {"grad_weight": "high"}},
    # DeepSeek-V3 / TE Float8BlockScaling: E4M3, 1x128 activation tiles, 128x128 weight blocks
    "blockwise": {"format": "e4m3", "granularity": "blockwise"},
    # torchao MXFP8 training (MXFP8TrainingOpConfig) / TE MXFP8BlockScaling: E4M3, 1x32 blocks along
    # K for every operand, E8M0 scales rounded with RCEIL
    "mxfp8": {"format": "e4m3", "granularity": "mx", "scale_rounding": "rceil"},
    # TE NVFP4BlockScaling: E2M1 data, E4M3 scales per 1x16 block along K (16x16 for weights) under
    # an fp32 per-tensor scale, stochastic rounding of gradients, random Hadamard transform on wgrad
    "nvfp4": {"format": "nvfp4", "granularity": "nvfp4", "stochastic_rounding": True, "hadamard": "wgrad"},
    # TE DelayedScaling defaults: HYBRID, amax history 1024, algo max, margin 0
    "delayed": {"format": "hybrid", "scaling": "delayed", "amax_history_len": 1024, "amax_compute_algo": "max"},
    # Megatron-LM defaults: amax history 1, most recent amax
    "megatron": {"format": "hybrid", "scaling": "delayed", "amax_history_len": 1, "amax_compute_algo": "most_recent"},
}
