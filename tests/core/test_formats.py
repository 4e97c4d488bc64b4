"""The exact FP8 -> fp32 upcast the CPU emulation uses (fp8fx.core.formats.upcast), and the
saturating cast."""

import pytest
import torch

from fp8fx.core.formats import Fp8Format, saturating_cast, upcast

ALL_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
IS_NAN = (ALL_E4M3.view(torch.uint8) & 0x7F) == 0x7F


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def test_every_finite_e4m3_code_upcasts_bit_exactly():
    finite = ALL_E4M3[~IS_NAN]
    assert finite.numel() == 254
    assert torch.equal(bits(upcast(finite)), bits(finite.to(torch.float32)))  # -0.0 and subnormals included


def test_nan_stays_nan():
    out = upcast(ALL_E4M3)
    assert out.dtype == torch.float32
    assert torch.equal(out.isnan(), IS_NAN)
    assert torch.equal(bits(out[~IS_NAN]), bits(ALL_E4M3[~IS_NAN].to(torch.float32)))


@pytest.mark.parametrize("seed", range(4))
def test_strided_views_keep_values(seed):
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.randint(1, 300, (2,), generator=g).tolist()
    codes = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN: the fast path
    x = codes.view(torch.float8_e4m3fn)
    for view in (x, x.t(), x[::2, 1:]):
        out = upcast(view)
        assert torch.equal(bits(out), bits(view.to(torch.float32)))


def test_every_e5m2_code_upcasts_bit_exactly():
    """E5M2 through fp16's bits: every code, infinities, NaN and -0.0 included."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2)
    out = upcast(codes)
    reference = codes.to(torch.float32)
    assert torch.equal(out.isnan(), reference.isnan()) and int(out.isnan().sum()) == 6
    assert torch.equal(bits(out[~out.isnan()]), bits(reference[~reference.isnan()]))
    assert torch.equal(bits(upcast(codes.reshape(16, 16).t())), bits(reference.reshape(16, 16).t()))


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2])
def test_saturating_cast_clamps_and_keeps_nan(fmt):
    x = torch.tensor([0.0, -1.5, 1e6, -1e6, float("inf"), float("-inf"), float("nan"), fmt.max * 1.01])
    out = saturating_cast(x.clone(), fmt).to(torch.float32)
    assert out[:2].tolist() == [0.0, -1.5]
    assert out[[2, 4, 7]].tolist() == [fmt.max] * 3 and out[[3, 5]].tolist() == [-fmt.max] * 2
    assert out[6].isnan()


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_other_inputs_match_torch(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    assert torch.equal(upcast(codes).nan_to_num(), codes.to(torch.float32).nan_to_num())
    assert upcast(codes[:0]).shape == (0,)


def test_a_tensor_that_is_not_fp8_takes_torchs_conversion():
    """The branch every non-CPU tensor takes (`x.to(torch.float32)`), run here on a CPU one."""
    x = torch.tensor([1.5, -2.0, 3.0e38], dtype=torch.bfloat16)
    assert torch.equal(bits(upcast(x)), bits(x.to(torch.float32)))
