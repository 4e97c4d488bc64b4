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


# With -n, the files whose tests take 30-100 s each on one core run first, in this order (the rest
# keep pytest's order): a long test left for the end keeps one worker busy while the others idle.
RUN_FIRST = (
    "codegen/test_kernels.py",  # the interpreter groups, one process each
    "compiler/test_lowering.py",
    "compiler/test_reproducible.py",
    "compiler/test_state_at_prepare.py",
    "compiler/test_cache.py",
    "tools/test_fusion_counts.py",
    "integrations/test_integration_torchtitan.py",
    "reporting/test_uncaptured.py",
    "tools/test_analyze.py",
)


def _run_first_rank(item: pytest.Item) -> int:
    path = item.path.as_posix()
    return next((i for i, name in enumerate(RUN_FIRST) if path.endswith("tests/" + name)), len(RUN_FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: every worker collects, all sort alike
        items.sort(key=_run_first_rank)  # stable: a file's tests stay together and in order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """-n's default ("load") hands out the tests in chunks, so a long one can come last on one
    worker. Work stealing gives each worker half and lets an idle one take half of what another
    has left: with the long tests at the front, what is left at the end are short ones."""
    if config.getoption("dist") == "load":
        from xdist.scheduler import WorkStealingScheduling

        return WorkStealingScheduling(config, log)
    return None
