import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """FP8FX_INTERPRETER_SHARD="i/n" keeps every n-th test from the i-th, in collection order:
    tests/codegen/test_kernels.py splits a slow file over several processes this way."""
    shard = os.environ.get("FP8FX_INTERPRETER_SHARD")
    if not shard:
        return
    i, n = map(int, shard.split("/"))
    keep = items[i::n]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
