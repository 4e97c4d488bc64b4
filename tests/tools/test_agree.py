"""Analysis, compilation and export decide every GEMM alike.

One model (tests/assets/blocks.py: a ModuleList of identical blocks with several matmuls each,
sites `layers.i:mm#j` / `layers.i:bmm#j`, between the single-Linear modules `embed` and `head`),
one training step, and for each policy the rows of

- `fp8fx.analyze(..., train=True)` folded (`fold_repeated=True`: one block traced, the others
  copied) and unfolded, and `fp8fx analyze --train --format json` on the model file,
- `torch.compile` with `fp8fx.backend(policy, inner="eager")` (the reference) and `inner="inductor"`,
- `fp8fx.export_onnx` (inference: the forward `output` rows), read back from the ONNX file,

must hold the same (site, role) rows with the same decision. Export writes only what ONNX can
hold: the precision, the activation's and the weight's FP8 types, and how the weight is scaled
(activations are scaled per tensor, statically, whatever the policy: see README, Exporting).
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml
from typer.testing import CliRunner

import fp8fx
from fp8fx import Policy, Rule
from fp8fx.cli import app
from fp8fx.core.recipes import MX_BLOCK, RECIPES

MODEL_FILE = Path(__file__).parents[1] / "assets" / "blocks.py"
LOADED = fp8fx.load_model_file(MODEL_FILE, real_weights=True)

# Every field of a decision (OpRecord): what runs in FP8 and how.
FIELDS = (
    "precision", "reason_kind", "operands", "formats", "scaling", "granularity", "blocks", "power_of_two_scales", "margin",
    "amax_history_len", "amax_compute_algo", "interval", "fast_accum", "stochastic_rounding", "hadamard", "reason",
)  # fmt: skip
ONNX_FORMATS = {onnx.TensorProto.FLOAT8E4M3FN: "e4m3", onnx.TensorProto.FLOAT8E5M2: "e5m2"}

MIXED_YAML = r"""version: 1
recipe: tensorwise
defaults:
  gemms: {wgrad: high}
rules:
  - match: 're:layers\.\d+'
    op: [mm]
    gemms: {wgrad: fp8, dgrad: high}
  - match: "re:head"
    precision: high
  - match: "layers.0"
    format: e5m2
  - match: "*"
    op: [bmm]
    precision: high
"""

POLICIES = {
    "default": Policy(),
    **{f"recipe_{name}": Policy.from_recipe(name) for name in RECIPES},
    "yaml_mixed": fp8fx.policy_from_yaml(MIXED_YAML),
    "bmm_fp8": Policy(rules=(Rule(match="*", op=("bmm",), precision="fp8"),)),
    "bmm_fp8_blockwise": Policy(rules=(Rule(match="*", op=("bmm",), precision="fp8", granularity="blockwise"),)),
    "head_high": Policy.from_recipe("tensorwise", rules=(Rule(match="head", precision="high"),)),
    "layer_margin": Policy.from_recipe("delayed", rules=(Rule(match="layers.2", margin=24),)),
    # Rules naming sites (`fqn:op#i`) rather than modules:
    "site_high": Policy(rules=(Rule(match="layers.1:mm#1", precision="high"),)),
    "site_regex": Policy(rules=(Rule(match=r"re:layers\.(0|2):mm#0", format="e4m3", granularity="rowwise"),)),
    "site_bmm": Policy(rules=(Rule(match="layers.2:bmm#1", precision="fp8"),)),
    "site_delayed": Policy(rules=(Rule(match="layers.1:mm#2", scaling="delayed", amax_history_len=16),)),
    "site_glob_all_blocks": Policy(rules=(Rule(match="layers.*:mm#2", format="e4m3", gemms={"wgrad": "high"}),)),
}

# Always run: a few policies, each compiled once and shared by the tests (site_regex exports
# rowwise and tensorwise weights, yaml_mixed E5M2 ones and high sites, site_bmm an FP8 bmm that
# export refuses). Of the rest, a seeded sample runs too, marked slow: FP8FX_AGREE=N policies
# (default 2; `all` for the whole matrix), drawn with FP8FX_AGREE_SEED (default 0).
FAST = ["recipe_blockwise", "yaml_mixed", "site_high", "site_regex"]
FAST_EXPORT = ["yaml_mixed", "site_regex", "site_bmm"]
FAST_INDUCTOR = ["site_high", "site_regex"]


def _drawn() -> set[str]:
    count = os.environ.get("FP8FX_AGREE", "2")
    if count == "all":
        return set(POLICIES)
    rng = random.Random(int(os.environ.get("FP8FX_AGREE_SEED", "0")))
    return set(rng.sample(sorted(POLICIES), min(int(count), len(POLICIES))))


DRAWN = _drawn()


def sample(ids: list[str]) -> list:
    """The policies of `ids`, and those of the seeded sample marked slow."""
    return [
        pytest.param(name, marks=[] if name in ids else [pytest.mark.slow], id=name)
        for name in POLICIES
        if name in ids or name in DRAWN
    ]


# ------------------------------------------------------------------------------ rows and comparing


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def rows(ops) -> dict[tuple[str, str], dict]:
    """{(site, role): decision} of OpRecords or their JSON objects; one row per (site, role)."""
    out = {}
    for op in ops:
        op = op if isinstance(op, dict) else {f: getattr(op, f) for f in ("site", "role", *FIELDS)}
        key = (op["site"], op["role"])
        assert key not in out, f"two rows for {key}"
        out[key] = {f: _tupled(op[f]) for f in FIELDS}
    return out


def disagreements(got: dict, want: dict, what: str, fields=FIELDS) -> list[str]:
    """Lines naming each row `got` lacks or adds and each field it decides otherwise than `want`."""
    lines = [f"{what} has no row {key}" for key in sorted(want.keys() - got.keys())]
    lines += [f"{what} has an extra row {key}" for key in sorted(got.keys() - want.keys())]
    for key in sorted(want.keys() & got.keys()):
        differ = [f for f in fields if got[key][f] != want[key][f]]
        if differ:
            lines.append(f"{key[0]} {key[1]}: {what} " + ", ".join(f"{f}={got[key][f]!r}" for f in differ)
                         + "; compile " + ", ".join(f"{f}={want[key][f]!r}" for f in differ))  # fmt: skip
    return lines


def check(got: dict, want: dict, what: str, fields=FIELDS) -> None:
    found = disagreements(got, want, what, fields)
    assert not found, f"{len(found)} disagreement(s):\n" + "\n".join(found)


# ------------------------------------------------------------------------------ the routes


@functools.cache
def compiled(name: str, inner: str = "eager") -> dict:
    """Rows of one training step of the model compiled with `fp8fx.backend(policy, inner)`."""
    policy = POLICIES[name]
    model = LOADED.fresh_model()
    if policy.uses_delayed_scaling:
        fp8fx.prepare(model)
    compiled_model = torch.compile(model, backend=fp8fx.backend(policy=policy, inner=inner))
    compiled_model(*LOADED.make_inputs()).float().sum().backward()
    report = fp8fx.report(compiled_model)
    torch._dynamo.reset()
    assert report.superseded == [] and len({op.graph for op in report.ops}) == 1  # one training graph
    return rows(report.ops)


@functools.cache
def analysed(name: str, fold: bool) -> fp8fx.Report:
    return fp8fx.analyze(LOADED.fresh_model(), LOADED.make_inputs(), POLICIES[name], train=True, fold_repeated=fold)


def export_rows(result: fp8fx.ExportResult) -> dict[tuple[str, str], dict]:
    """{(site, "output"): what the ONNX file says}: precision, the FP8 types of the activation's
    QuantizeLinear and of the weight initializer, and the weight's DequantizeLinear scaling."""
    proto = onnx.load(result.path)
    inits = {i.name: i for i in proto.graph.initializer}
    constants = {n.output[0]: n.attribute[0].t for n in proto.graph.node if n.op_type == "Constant"}
    nodes = {n.name: n for n in proto.graph.node}
    out = {}
    for site in result.sites:
        found = [nodes[n] for n in site.onnx_nodes]
        row = {"precision": site.precision, "formats": None, "granularity": None, "weight_block": None}
        out[(site.site, "output")] = row
        if site.precision != "fp8":
            assert not [n.name for n in found if "QuantizeLinear" in n.op_type], f"{site.site} is high but quantized"
            continue
        [quantize] = [n for n in found if n.op_type == "QuantizeLinear"]  # the activation's, per tensor
        [weight] = [n for n in found if n.op_type == "DequantizeLinear" and n.input[0] in inits]
        zero_point = inits[quantize.input[2]] if quantize.input[2] in inits else constants[quantize.input[2]]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in weight.attribute}
        scale = inits[weight.input[1]]
        assert not inits[quantize.input[1]].dims, f"{site.site}: the activation's scale is not one static scale"
        row["formats"] = (ONNX_FORMATS[zero_point.data_type], ONNX_FORMATS[inits[weight.input[0]].data_type])
        if attrs.get("block_size") == MX_BLOCK and (np.frexp(onnx.numpy_helper.to_array(scale))[0] == 0.5).all():
            row["granularity"], row["weight_block"] = "mx", (MX_BLOCK, 1)  # E8M0 values: powers of two per 32 of K
        elif attrs.get("block_size"):  # K x N weight, `block_size` rows of K per scale (a block's scale repeats over its columns)
            row["granularity"], row["weight_block"] = "blockwise", attrs["block_size"]
        elif scale.dims:  # one scale per output channel: axis 1 of K x N
            assert attrs["axis"] == 1 and list(scale.dims) == [inits[weight.input[0]].dims[1]]
            row["granularity"], row["weight_block"] = "rowwise", (0, 1)
        else:
            row["granularity"], row["weight_block"] = "tensorwise", ()
    return out


def as_exported(want: dict) -> dict:
    """Compile's forward rows as ONNX can hold them (see export_rows)."""
    out = {}
    for (site, role), d in want.items():
        if role != "output":
            continue
        block = d["blocks"][1] if d["blocks"] else None
        out[(site, role)] = {
            "precision": d["precision"],
            "formats": d["formats"],
            "granularity": d["granularity"],
            "weight_block": block[0] if d["granularity"] == "blockwise" else block,
        }
    return out


# ------------------------------------------------------------------------------ the tests


def test_the_model_names_sites_by_module_and_by_matmul():
    blocks = {f"layers.{i}:{op}" for i in range(len(LOADED.model.layers)) for op in ("bmm#0", "bmm#1", "mm#0", "mm#1", "mm#2")}
    assert {site for site, _ in compiled("site_high")} == {"embed", "head", *blocks}


@pytest.mark.parametrize("name", sample(FAST))
def test_unfolded_analysis_agrees_with_compile(name):
    report = analysed(name, fold=False)
    assert report.folded == {}
    check(rows(report.ops), compiled(name), "analyze(fold_repeated=False)")


@pytest.mark.parametrize("name", sample(FAST))
def test_folded_analysis_agrees_with_compile(name):
    check(rows(analysed(name, fold=True).ops), compiled(name), "analyze(fold_repeated=True)")


def test_folding_happens_where_the_policy_treats_blocks_alike():
    """The folded cases above test folding: it is on for a policy that treats the blocks alike
    (also by site name), off for one whose module-path rule names a block."""
    assert analysed("recipe_blockwise", fold=True).folded == {"layers": 3}
    assert analysed("site_glob_all_blocks", fold=True).folded == {"layers": 3}
    assert analysed("yaml_mixed", fold=True).folded == {}  # its rule `layers.0` names a block


@pytest.mark.parametrize("name", ["site_high", "yaml_mixed"])
def test_analyze_command_agrees_with_compile(name, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(POLICIES[name].to_dict(), sort_keys=False))
    result = CliRunner().invoke(app, ["analyze", str(MODEL_FILE), "--policy", str(policy), "--train", "--format", "json"])
    assert result.exit_code == 0, result.output
    ops = [op for op in json.loads(result.stdout)["ops"] if op["graph_state"] == "in_use"]
    check(rows(ops), compiled(name), "fp8fx analyze")


@pytest.mark.parametrize("name", sample(FAST_INDUCTOR))
def test_inductor_agrees_with_eager(name):
    check(compiled(name, "inductor"), compiled(name), "inner='inductor'")


@pytest.mark.parametrize("name", sample(FAST_EXPORT))
def test_export_agrees_with_compile(name, tmp_path):
    want = compiled(name)
    fp8_batched = [site for (site, role), d in want.items() if role == "output" and d["precision"] == "fp8" and ":bmm#" in site]
    if fp8_batched:  # ONNX QDQ export takes mm/addmm with a weight: it refuses an FP8 bmm, naming it
        named = "|".join(map(re.escape, fp8_batched))
        with pytest.raises(fp8fx.ExportError, match=rf"^site ({named}): FP8 bmm cannot be exported"):
            fp8fx.export_onnx(LOADED.fresh_model(), LOADED.make_inputs(), tmp_path / "model.onnx", POLICIES[name])
        return
    fp4 = sorted(
        site for (site, role), d in want.items() if role == "output" and d["precision"] == "fp8" and d["granularity"] == "nvfp4"
    )
    if fp4:  # ONNX has no FP4 QDQ that onnxruntime runs: export refuses an NVFP4 GEMM, naming it
        with pytest.raises(fp8fx.ExportError, match=rf"^site {re.escape(fp4[0])}: nvfp4 weight scales have no ONNX export"):
            fp8fx.export_onnx(LOADED.fresh_model(), LOADED.make_inputs(), tmp_path / "model.onnx", POLICIES[name])
        return
    result = fp8fx.export_onnx(LOADED.fresh_model(), LOADED.make_inputs(), tmp_path / "model.onnx", POLICIES[name])
    expected = as_exported(want)
    check(export_rows(result), expected, "export_onnx", ("precision", "formats", "granularity", "weight_block"))
    assert result.fp8_weights == sum(d["precision"] == "fp8" for d in expected.values())
