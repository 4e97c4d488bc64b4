import os
import sys
from pathlib import Path

import pytest

# With CI set, Inductor refuses to lower an op it has a decomposition for as an ATen fallback
# (which without it runs silently, unfused), and AOTAutograd a custom op whose output aliases an
# input: every run of the suite is held to that. Set before torch reads it on import.
os.environ.setdefault("CI", "1")

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
