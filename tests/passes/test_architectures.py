"""Report coverage over a sample of the architectures `transformers` ships (tiny configs, random
weights), measured as `bench/architectures.py` measures all of them: one training step compiled by
fp8fx, against the GEMMs a plain `aot_eager` compile captures and the GEMMs eager PyTorch
dispatches for the same step (an oracle that does not use the passes).

Three architectures always run (a decoder, a vision model with a patch convolution, an MoE with
grouped expert GEMMs in FP8); `FP8FX_ARCHITECTURES=N` more are drawn from the rest with
`FP8FX_ARCHITECTURES_SEED` (3 and 0 by default; `FP8FX_ARCHITECTURES=all` runs every one).
"""

from __future__ import annotations

import os
import random

import pytest
from helpers import bench_module

architectures = bench_module("architectures")

ALWAYS = ["llama", "vit", "mixtral"]
# Under torch.compile transformers' Mamba takes its associative-scan path (one bmm per layer);
# eager loops over time steps (one per step). The compiled graphs are what the report can count.
EAGER_DIFFERS = {"mamba"}
# What keeps GEMMs high in the fixed part of the sample: attention everywhere, the patch
# convolution (conv_patch is not in the default ops), the MoE router (N = experts).
ALWAYS_HIGH = {"llama": {"op_kind"}, "vit": {"op_kind", "conv"}, "mixtral": {"op_kind", "shape"}}
REASON_KINDS = {"policy", "op_kind", "shape", "dtype", "pattern", "unlinked", "shadow", "opaque", "conv"}


def sample() -> list[str]:
    rest = sorted(set(architectures.ARCHITECTURES) - set(ALWAYS))
    wanted = os.environ.get("FP8FX_ARCHITECTURES", "3")
    if wanted == "all":
        return ALWAYS + rest
    rng = random.Random(int(os.environ.get("FP8FX_ARCHITECTURES_SEED", "0")))
    return ALWAYS + sorted(rng.sample(rest, min(int(wanted), len(rest))))


@pytest.fixture(scope="module", autouse=True)
def _quiet_transformers():
    pytest.importorskip("transformers").logging.set_verbosity_error()


@pytest.mark.slow
@pytest.mark.parametrize("name", sample())
def test_every_gemm_of_an_architecture_has_a_row_with_a_decision(name):
    r = architectures.measure(name)

    assert r["rows"] == r["graph_ops"], f"{name}: {r['rows']} report rows, {r['graph_ops']} GEMMs in the aot_eager graphs"
    if name not in EAGER_DIFFERS:
        assert r["rows"] == r["oracle"], f"{name}: {r['rows']} report rows, {r['oracle']} GEMMs dispatched by eager"
    high = sum(n for ops in r["high"].values() for n in ops.values())
    assert r["fp8_gemms"] + high == r["rows"]
    assert set(r["high"]) <= REASON_KINDS
    if name in ALWAYS_HIGH:
        assert set(r["high"]) == ALWAYS_HIGH[name]
    assert 0 < r["fwd"] < 1 and 0 < r["bwd"] < 1  # the projections run in FP8; attention stays high everywhere
