"""Every activation of the one table (`fp8fx.core.epilogue.ACTIVATIONS`) is implemented by the
generated kernel (run by Triton's interpreter) and by the reference op, as the table's torch function.

Runs only with TRITON_INTERPRET=1 set before import (tests/codegen/test_kernels.py starts it that way)."""

from __future__ import annotations

import pytest
import torch
from test_kernels import E4M3, close_as, fp8_operand

from fp8fx.codegen import launch
from fp8fx.core.epilogue import ACTIVATIONS, Epilogue
from fp8fx.ops import reference
from fp8fx.ops.args import Fp8GemmArgs

pytestmark = pytest.mark.skipif(not launch.interpreter_active(), reason="needs TRITON_INTERPRET=1 before import")


@pytest.mark.parametrize("where", ["activation", "gate"])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_every_activation_runs_in_the_kernel_and_the_reference(name, where):
    m, n, k = 24, 40, 64
    a, sa = fp8_operand((m, k), E4M3, (), seed=ACTIVATIONS[name].code)
    b, sb = fp8_operand((k, n), E4M3, (), seed=ACTIVATIONS[name].code + 1, column_major=True)
    y = torch.matmul(a.float(), b.float()).mul_(sa * sb)  # the dequantized product, as the reference computes it
    if where == "activation":
        ep, other = Epilogue(activation=name), None
        expected = ACTIVATIONS[name].reference(y.clone())
    else:  # gated product: act(other) * y
        ep, other = Epilogue(mul="gated", mul_activation=name), torch.randn(m, n, generator=torch.Generator().manual_seed(5)) * 4
        expected = ACTIVATIONS[name].reference(other.clone()) * y
    if name != "none":  # values on both sides of zero: the activation changes them
        assert not torch.allclose(expected, y if where == "activation" else other * y)
    gemm = Fp8GemmArgs(
        a, b, sa, sb, other=other, out_dtype=torch.float32, aux_dtype=torch.float32, epilogue=ep.spec(), gpu_kernel="scaled_mm"
    )
    ref, _, _ = reference.fp8_gemm(gemm)
    torch.testing.assert_close(ref, expected, rtol=0, atol=0)
    for family in ("pointer", "tma"):
        got, _, _ = launch.fp8_gemm(a, b, sa, sb, epilogue=ep, other=other, out_dtype=torch.float32, family=family)
        close_as(got, expected)
