import os
import sys
from pathlib import Path

import pytest

# With CI set, Inductor refuses to lower an op it has a decomposition for as an ATen fallback
# (which without it runs silently, unfused), and AOTAutograd a custom op whose output aliases an
# input: every run of the suite is held to that. Set before torch reads it on import.
os.environ.setdefault("CI", "1")
# Inductor's CPU kernels without SIMD: their C++ builds take about half the time of vectorised
# ones, which with fp8fx's casts compiled by Inductor is most of a fresh suite's time. The
# vectorised code of the lowered casts and GEMMs is checked by tests/compiler/test_lowering.py.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached frames leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# The Triton interpreter tests need TRITON_INTERPRET=1 before Triton is imported: test_kernels.py
# runs them in their own process.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["codegen/interpreter"]
