"""The policy example in README.md is a valid policy that means what its comments say."""

import re
from pathlib import Path

from fp8fx import policy_from_yaml


def test_readme_policy_example_loads():
    text = (Path(__file__).parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if b.startswith("version: 1"))
    policy = policy_from_yaml(block, "README.md")
    assert policy.recipe == "tensorwise" and len(policy.rules) == 3 and policy.shadow.patience == 3 and policy.level.value == "O2"
    res = policy.resolve(("layers.0.mlp.up",), "mm")
    assert res.settings.granularity.value == "rowwise" and res.settings.gemms["grad_weight"].value == "high"
    assert policy.resolve(("blocks.0:bmm#0",), "bmm").forced_fp8
