"""FP8 element formats (and NVFP4's FP4, see fp8fx.core.fp4) and the saturating cast into FP8."""

from __future__ import annotations

from enum import Enum

import torch


class Fp8Format(str, Enum):
    """A low-precision element format of a GEMM operand: FP8 (OCP names; `fn` = finite-only E4M3)
    or NVFP4 (FP4 E2M1 elements with E4M3 block scales; graphs carry its values in E4M3 tensors,
    which hold every E2M1 value exactly: fp8fx.core.fp4)."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    NVFP4 = "nvfp4"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the graph's tensors of this format (NVFP4: its E4M3 carrier)."""
        return _DTYPES.get(self, torch.float8_e4m3fn)

    @property
    def max(self) -> float:
        """Largest finite magnitude: 448 for E4M3, 57344 for E5M2, 6 for NVFP4's E2M1."""
        return 6.0 if self is Fp8Format.NVFP4 else torch.finfo(self.dtype).max


_DTYPES = {Fp8Format.E4M3: torch.float8_e4m3fn, Fp8Format.E5M2: torch.float8_e5m2}
FP8_DTYPES = frozenset(_DTYPES.values())


class FormatRecipe(str, Enum):
    """Which format each operand gets. HYBRID: E4M3 forward operands, E5M2 gradients (TE's HYBRID).
    NVFP4: every operand NVFP4 (needs granularity nvfp4)."""

    HYBRID = "hybrid"
    E4M3 = "e4m3"
    E5M2 = "e5m2"
    NVFP4 = "nvfp4"

    def operand_format(self, operand_role: str) -> Fp8Format:
        """Format of an operand by its role: `input`, `weight` or `grad_output`."""
        if self is FormatRecipe.E4M3:
            return Fp8Format.E4M3
        if self is FormatRecipe.E5M2:
            return Fp8Format.E5M2
        if self is FormatRecipe.NVFP4:
            return Fp8Format.NVFP4
        return Fp8Format.E5M2 if operand_role == "grad_output" else Fp8Format.E4M3


def fp8_format_of(dtype: torch.dtype) -> Fp8Format:
    for fmt, d in _DTYPES.items():
        if d == dtype:
            return fmt
    raise ValueError(f"{dtype} is not an FP8 dtype fp8fx supports (float8_e4m3fn, float8_e5m2)")


def saturating_cast(x_scaled: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Round an already-scaled tensor to `fmt`, clamping to +-max first, in place: callers pass the
    product they just made (one 4-byte-per-value pass fewer, which on a CPU step is memory time).

    The clamp is explicit: older torch releases turn out-of-range values into NaN, and
    E5M2 would overflow to inf. NaN stays NaN (clamp propagates it)."""
    return x_scaled.clamp_(-fmt.max, fmt.max).to(fmt.dtype)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """`x.to(torch.float32)`, exactly, for FP8 tensors and faster on CPU.

    PyTorch converts FP8 element by element (the largest cost of an emulated GEMM after the GEMM
    itself; docs/results.md, "Benchmarks (CPU)"); fp16 -> fp32 is a vectorised
    conversion, so going through fp16 bits takes a fraction of that. E5M2 is fp16's top byte,
    NaN and infinities included. E4M3's bits shifted left by 7 (sign kept in place) are an fp16 of
    the same value times 2**-8, subnormals included, because E4M3's bias (7) is fp16's (15) minus
    8; E4M3 NaN (0x7f / 0xff) has no such image: a tensor holding one takes PyTorch's conversion."""
    if x.device.type != "cpu" or x.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.to(torch.float32)
    # int8 -> int16 sign-extends; the shift pushes the extension out (E5M2) or into bits 14 and 15.
    # (In-place shifts and masks: every pass that allocates costs memory time on a CPU step.)
    bits = x.view(torch.int8)
    half = bits.to(torch.int16)
    if x.dtype == torch.float8_e5m2:
        half <<= 8
        return half.view(torch.float16).to(torch.float32)
    # NaN is 0x7f (int8's largest value) or 0xff (uint8's): two reductions, no copy.
    if x.numel() and (int(bits.max()) == 0x7F or int(bits.view(torch.uint8).max()) == 0xFF):
        return x.to(torch.float32)
    half <<= 7
    half &= ~0x4000  # clear bit 14: only the sign stays set
    return half.view(torch.float16).to(torch.float32).mul_(256.0)
