import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# With CI set, Inductor refuses to lower an op it has a decomposition for as an ATen fallback
# (which without it runs silently, unfused): every run of the suite is held to that.
os.environ.setdefault("CI", "1")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached frames leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# The Triton interpreter tests need TRITON_INTERPRET=1 before Triton is imported: test_kernels.py
# runs them in their own process.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["codegen/interpreter"]
