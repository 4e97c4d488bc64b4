"""Inductor's caches take fp8fx's compiles: a second process with the same cache directory is
served from AOTAutograd's and the FX graph cache, skips the passes, and reports exactly what the
first one did, from the records kept beside the cache. Compiles whose graphs call back into their
process (the monitor) are not cached, and a hit without its records fails with one clear line.
The same Dynamo graph compiled for training and, under no_grad, for inference keeps two records."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

import fp8fx
from fp8fx.compiler.cache import RECORDS_DIR

CHILD = textwrap.dedent("""
    import json, sys, torch, fp8fx
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    if sys.argv[1] == "delayed":
        fp8fx.prepare(model)
    backend = fp8fx.backend(policy=fp8fx.Policy.from_recipe(sys.argv[1]), inner="inductor")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(32, 64)
    for _ in range(2):
        loss = compiled(x).square().mean()
        loss.backward()
    with torch.no_grad():  # the same Dynamo graph again, compiled for inference: its own records
        compiled(x)
    print(json.dumps({
        "report": fp8fx.report(backend).to_dict(), "loss": loss.item(), "grad": model[0].weight.grad.sum().item(),
        "aot_hits": counters["aot_autograd"]["autograd_cache_hit"], "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
        "states": {k: v.tolist() for k, v in model.state_dict().items() if k.startswith("fp8fx_state.")},
    }, default=str))
""")


def child(cache_dir, recipe: str) -> subprocess.CompletedProcess:
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", CHILD, recipe], env=env, capture_output=True, text=True, check=False)


def run_child(cache_dir, recipe: str) -> dict:
    out = child(cache_dir, recipe)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory):
    """`cold_run(recipe)`: (cache directory, result) of the first process to compile `recipe`'s
    model into an empty cache, run once per recipe in this module (each test copies the directory
    before it changes anything in it)."""
    runs: dict[str, tuple] = {}

    def run(recipe: str):
        if recipe not in runs:
            cache_dir = tmp_path_factory.mktemp(f"cold-{recipe}")
            runs[recipe] = cache_dir, run_child(cache_dir, recipe)
        return runs[recipe]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_a_second_process_is_served_from_the_cache_with_the_same_report(tmp_path, recipe, cold_run):
    cold_dir, cold = cold_run(recipe)
    shutil.copytree(cold_dir, tmp_path, dirs_exist_ok=True)
    warm = run_child(tmp_path, recipe)
    assert cold["aot_hits"] == 0 and warm["aot_hits"] == 2 and warm["fx_hits"] >= 3
    kinds = [op["graph_kind"] for op in cold["report"]["ops"]]
    assert kinds.count("training") == 5 and kinds.count("inference") == 2  # x needs no grad: no grad_input for layer 0
    assert warm["report"] == cold["report"]
    assert (warm["loss"], warm["grad"]) == (cold["loss"], cold["grad"])  # the same compiled code, bit for bit
    # Delayed scaling: the warm process makes its states from the records and updates them as the cold one did.
    assert warm["states"] == cold["states"] and len(cold["states"]) == (4 * 6 if recipe == "delayed" else 0)
    assert len(list((tmp_path / RECORDS_DIR).glob("*.json"))) == 2


@pytest.mark.slow
def test_a_cache_hit_without_its_records_names_the_file(tmp_path, cold_run):
    shutil.copytree(cold_run("tensorwise")[0], tmp_path, dirs_exist_ok=True)
    shutil.rmtree(tmp_path / RECORDS_DIR)
    out = child(tmp_path, "tensorwise")
    assert out.returncode != 0
    assert f"its report records ({tmp_path / RECORDS_DIR}" in out.stderr and "delete the cache directory" in out.stderr


def test_the_cache_key_follows_what_the_rewrite_depends_on():
    tensorwise = fp8fx.backend(policy=fp8fx.Policy.from_recipe("tensorwise"))
    assert tensorwise.cache_key() == fp8fx.backend(policy=fp8fx.Policy.from_recipe("tensorwise")).cache_key()
    others = [
        fp8fx.backend(policy=fp8fx.Policy.from_recipe("rowwise")),
        fp8fx.backend(policy=fp8fx.Policy.from_recipe("tensorwise"), fuse_epilogues=False),
        fp8fx.backend(policy=fp8fx.Policy.from_recipe("tensorwise"), kernels="scaled_mm"),
        fp8fx.backend(policy=fp8fx.Policy.from_recipe("tensorwise"), cublas_devices=("cpu", "cuda")),  # lowered otherwise
    ]
    keys = {tensorwise.cache_key(), *(b.cache_key() for b in others)}
    assert len(keys) == 5 and None not in keys
    # A monitored graph calls back into this process: it is never served from a cache.
    assert fp8fx.backend(monitor_every=10).cache_key() is None
