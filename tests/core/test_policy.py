"""Tests for fp8fx.core.policy: YAML loading, rule resolution, error reporting, and `fp8fx policy validate`."""

from __future__ import annotations

import itertools

import pytest
import torch
import yaml
from typer.testing import CliRunner

import fp8fx
from fp8fx.cli import app
from fp8fx.core.formats import FormatRecipe
from fp8fx.core.policy import GemmPrecisions, Policy, PolicyError, Rule, Settings
from fp8fx.core.recipes import GEMM_ROLES, Granularity, Precision, Scaling
from fp8fx.passes.annotation import annotation

FP8, HIGH = Precision.FP8, Precision.HIGH

GOOD_YAML = r"""version: 1
defaults:
  format: hybrid
  scaling: dynamic
  granularity: tensorwise
  ops: [mm, addmm]
  gemms: {wgrad: high}
rules:
  - match: "layers.*.mlp.*"
    op: [mm, addmm]
    gemms: {wgrad: fp8, dgrad: high}
  - match: 're:layers\.\d+\.attn\.(q|k|v)'
    format: e4m3
  - match: "re:lm_head"
    precision: high
  - match: "*attn*"
    op: bmm
    precision: fp8
    gemms: {fprop: high}
  - match: "layers.0.*"
    precision: high
    format: e5m2
"""

PY_POLICY = Policy(
    defaults=Settings(format="hybrid", scaling="dynamic", granularity="tensorwise", ops=["mm", "addmm"],
                      gemms=GemmPrecisions(grad_weight="high")),
    rules=(
        Rule(match="layers.*.mlp.*", op=["mm", "addmm"], gemms={"wgrad": "fp8", "dgrad": "high"}),
        Rule(match=r"re:layers\.\d+\.attn\.(q|k|v)", format="e4m3"),
        Rule(match="re:lm_head", precision="high"),
        Rule(match="*attn*", op="bmm", precision="fp8", gemms={"fprop": "high"}),
        Rule(match="layers.0.*", precision="high", format="e5m2"),
    ),
)

D = "defaults.gemms."
DEFAULT_SRC = {r: D + r for r in GEMM_ROLES}


def _src(index: int, out: str, gi: str, gw: str) -> dict[str, str]:
    """Sources per role; 'd' = defaults, otherwise a field of rules[index]."""
    return {role: D + role if s == "d" else f"rules[{index}].{s}" for role, s in zip(GEMM_ROLES, (out, gi, gw))}


# (names, op) -> (rule index, format, (output, grad_input, grad_weight), gemm sources, forced_fp8)
RESOLVE_CASES = [
    # glob; first match wins over rules[4] "layers.0.*"; gemms override single GEMMs, aliases map to roles
    (("layers.0.mlp.fc1",), "mm", 0, "hybrid", (FP8, HIGH, FP8), _src(0, "d", "gemms.grad_input", "gemms.grad_weight"), False),
    (("layers.7.mlp.fc2",), "addmm", 0, "hybrid", (FP8, HIGH, FP8), _src(0, "d", "gemms.grad_input", "gemms.grad_weight"), False),
    # op filter skips rules[0]; rules[4] precision high sets all three and its format
    (("layers.0.mlp.fc1",), "bmm", 4, "e5m2", (HIGH, HIGH, HIGH), _src(4, *["precision"] * 3), False),
    # no rule: everything from defaults (grad_weight high there)
    (("layers.3.mlp.fc2",), "bmm", None, "hybrid", (FP8, FP8, HIGH), DEFAULT_SRC, False),
    (("layers.2.mlp",), "mm", None, "hybrid", (FP8, FP8, HIGH), DEFAULT_SRC, False),
    # regex fullmatch; unset gemms inherit from defaults
    (("layers.1.attn.q",), "mm", 1, "e4m3", (FP8, FP8, HIGH), DEFAULT_SRC, False),
    (("layers.12.attn.v",), "bmm", 1, "e4m3", (FP8, FP8, HIGH), DEFAULT_SRC, False),
    # partial regex matches must not match
    (("layers.1.attn.qkv",), "mm", None, "hybrid", (FP8, FP8, HIGH), DEFAULT_SRC, False),
    (("lm_head_extra",), "mm", None, "hybrid", (FP8, FP8, HIGH), DEFAULT_SRC, False),
    (("model.lm_head",), "mm", None, "hybrid", (FP8, FP8, HIGH), DEFAULT_SRC, False),
    # precision fp8 forces the site; gemms (fprop alias) override the precision per GEMM
    (("layers.1.attn.qkv",), "bmm", 3, "hybrid", (HIGH, FP8, FP8), _src(3, "gemms.output", "precision", "precision"), True),
    # any of the names (site name, FQN) can match
    (("site_7", "lm_head"), "addmm", 2, "hybrid", (HIGH, HIGH, HIGH), _src(2, *["precision"] * 3), False),
]


@pytest.fixture(params=["yaml", "python", "roundtrip"])
def policy(request, tmp_path) -> Policy:
    if request.param == "python":
        return PY_POLICY
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD_YAML)
    loaded = fp8fx.load_policy(path)
    if request.param == "yaml":
        return loaded
    return fp8fx.policy_from_yaml(yaml.safe_dump(loaded.to_dict()))


def test_yaml_loads_into_dataclasses(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(GOOD_YAML)
    p = fp8fx.load_policy(path)
    assert p.source == str(path)
    assert p.defaults == Settings(FormatRecipe.HYBRID, Scaling.DYNAMIC, Granularity.TENSORWISE,
                                  GemmPrecisions(FP8, FP8, HIGH), ("mm", "addmm"))
    assert len(p.rules) == 5 and all(isinstance(r, Rule) for r in p.rules)
    assert p.rules[0] == Rule("layers.*.mlp.*", ("mm", "addmm"), None, None, {"grad_weight": FP8, "grad_input": HIGH})
    assert p.rules[3].op == ("bmm",) and p.rules[3].precision is FP8 and p.rules[3].gemms == {"output": HIGH}
    assert p.rules[4].format is FormatRecipe.E5M2
    # same values as the Python-built policy (source differs, so compare the parts)
    assert (p.defaults, p.rules) == (PY_POLICY.defaults, PY_POLICY.rules)


def test_to_dict_roundtrip():
    d = PY_POLICY.to_dict()
    assert d["version"] == 1 and d["defaults"]["gemms"] == {"output": "fp8", "grad_input": "fp8", "grad_weight": "high"}
    again = fp8fx.policy_from_yaml(yaml.safe_dump(d))
    assert (again.defaults, again.rules) == (PY_POLICY.defaults, PY_POLICY.rules)
    assert again.to_dict() == d


@pytest.mark.parametrize("names,op,index,fmt,gemms,sources,forced", RESOLVE_CASES)
def test_resolve(policy, names, op, index, fmt, gemms, sources, forced):
    res = policy.resolve(names, op)
    assert res.rule_index == index
    assert res.source == ("defaults" if index is None else f"rules[{index}]")
    assert res.settings.format is FormatRecipe(fmt)
    assert tuple(res.settings.gemms[r] for r in GEMM_ROLES) == gemms
    assert res.gemm_sources == sources
    assert res.forced_fp8 is forced
    # rules never change these; they always come from defaults
    assert (res.settings.scaling, res.settings.granularity, res.settings.ops) == (Scaling.DYNAMIC, Granularity.TENSORWISE, ("mm", "addmm"))


@pytest.mark.parametrize("alias,role,prec,base", [
    (a, r, p, b) for (a, r), p, b in itertools.product(
        list(fp8fx.core.policy.TE_GEMM_ALIASES.items()) + [(r, r) for r in GEMM_ROLES], ["fp8", "high"], [None, "high", "fp8"])
])
def test_single_gemm_override(alias, role, prec, base):
    """A one-GEMM override (TE alias or role name) on top of defaults or of `precision`."""
    p = Policy(rules=(Rule(match="x", precision=base, gemms={alias: prec}),))
    res = p.resolve(("x",), "mm")
    for r in GEMM_ROLES:
        if r == role:
            assert (res.settings.gemms[r], res.gemm_sources[r]) == (Precision(prec), f"rules[0].gemms.{role}")
        elif base is None:
            assert (res.settings.gemms[r], res.gemm_sources[r]) == (FP8, f"defaults.gemms.{r}")
        else:
            assert (res.settings.gemms[r], res.gemm_sources[r]) == (Precision(base), "rules[0].precision")


# (text, key_path, line, message fragment)
BAD_FILES = {
    "unknown_top_key": ("version: 1\nrulez: []\n", "rulez", 2, "unknown key; expected one of calibrate, defaults, level, recipe, rules, saved_activations, shadow, version"),
    "saved_unknown_key": ("version: 1\nsaved_activations:\n  dtype: e4m3\n", "saved_activations.dtype", 3,
                          "unknown key; expected one of format, granularity, precision, rules"),
    "saved_format": ("version: 1\nsaved_activations:\n  format: nvfp4\n", "saved_activations.format", 3,
                     "kept in e4m3 or e5m2, not nvfp4"),
    "saved_granularity": ("version: 1\nsaved_activations:\n  granularity: 1x32\n", "saved_activations.granularity", 3,
                          "expected rowwise|1x128, got '1x32'"),
    "saved_rule_kind": ("version: 1\nsaved_activations:\n  rules:\n    - match: '*'\n      kind: [norm, mlp]\n",
                        "saved_activations.rules[0].kind[1]", 5, "expected attention|norm|activation|other, got 'mlp'"),
    "saved_rule_match": ("version: 1\nsaved_activations:\n  rules:\n    - precision: fp8\n", "saved_activations.rules[0].match", 4,
                         "missing; every rule needs"),
    "saved_rule_precision": ("version: 1\nsaved_activations:\n  rules:\n    - match: x\n      precision: fp4\n",
                             "saved_activations.rules[0].precision", 5, "expected fp8|high, got 'fp4'"),
    "bad_level": ("version: 1\nrecipe: tensorwise\nlevel: O4\n", "level", 3, "expected O1|O2|O3, got 'O4'"),
    "calibrate_dynamic": ("version: 1\nrecipe: tensorwise\ncalibrate: true\n", "calibrate", 3, "true needs delayed scaling"),
    "calibrate_not_bool": ("version: 1\nrecipe: delayed\ncalibrate: 1\n", "calibrate", 3, "expected true or false"),
    "unknown_rule_key": ("version: 1\nrules:\n  - match: x\n    granularty: tensorwise\n", "rules[0].granularty", 4, "unknown key"),
    "enum_defaults": ("version: 1\ndefaults:\n  format: e4m3\n  granularity: row\n", "defaults.granularity", 4,
                      "expected tensorwise|rowwise|blockwise|mx|nvfp4, got 'row'"),
    "enum_rule": ("version: 1\nrules:\n  - match: a\n  - match: b\n    format: e3m4\n", "rules[1].format", 5,
                  "expected hybrid|e4m3|e5m2|nvfp4, got 'e3m4'"),
    "enum_gemm_value": ("version: 1\ndefaults:\n  gemms: {output: low}\n", "defaults.gemms.output", 3, "expected fp8|high, got 'low'"),
    "rules_is_mapping": ("version: 1\nrules: {match: x}\n", "rules", 2, "expected a list of rules, got a mapping"),
    "missing_version": ("defaults:\n  format: e4m3\n", "version", 1, "missing"),
    "version_2": ("defaults: {}\nversion: 2\n", "version", 2, "expected 1, got 2"),
    "version_string": ("version: '1'\n", "version", 1, "expected 1, got '1'"),
    "version_bool": ("version: true\n", "version", 1, "expected 1"),
    "rule_without_match": ("version: 1\nrules:\n  - match: a\n  - op: mm\n    precision: high\n", "rules[1].match", 4, "missing"),
    "invalid_regex": ("version: 1\nrules:\n  - op: mm\n    match: 're:('\n", "rules[0].match", 4, "invalid regex '('"),
    "unknown_gemm_flow": (
        "version: 1\nrules:\n  - match: x\n    gemms: {output: high, bogus: fp8}\n",
        "rules[0].gemms.bogus",
        4,
        "unknown GEMM 'bogus'; expected output|grad_input|grad_weight|fprop|dgrad|wgrad",
    ),
    "unknown_gemm_block": (
        "version: 1\nrules:\n  - match: x\n    gemms:\n      output: high\n      bogus: fp8\n",
        "rules[0].gemms.bogus",
        6,
        "unknown GEMM 'bogus'",
    ),
    "bad_op_flow": (
        "version: 1\nrules:\n  - match: x\n    op: [mm, conv]\n",
        "rules[0].op[1]",
        4,
        "expected mm|addmm|bmm|baddbmm|grouped_mm|conv_patch, got 'conv'",
    ),
    "bad_op_block": ("version: 1\ndefaults:\n  ops:\n    - mm\n    - conv\n", "defaults.ops[1]", 5, "got 'conv'"),
    "fast_accum_value": ("version: 1\ndefaults:\n  fast_accum: {dgrad: yes please}\n", "defaults.fast_accum.dgrad", 3, "expected true or false"),
    "fast_accum_role": ("version: 1\nrules:\n  - match: x\n    fast_accum:\n      xgrad: true\n", "rules[0].fast_accum.xgrad", 5, "unknown GEMM 'xgrad'"),
    "fast_accum_list": ("version: 1\ndefaults:\n  fast_accum: [fprop]\n", "defaults.fast_accum", 3, "expected a mapping"),
    "margin_too_large": ("version: 1\ndefaults:\n  margin: 200\n", "defaults.margin", 3, "expected an integer from 0 to 32, got 200"),
    "interval_too_large": ("version: 1\nrules:\n  - match: x\n    interval: 18446744073709551616\n", "rules[0].interval", 4, "from 1 to 2147483647"),
    "history_too_long": ("version: 1\ndefaults:\n  amax_history_len: 10000000000000\n", "defaults.amax_history_len", 3, "from 1 to 65536"),
    "recipe_list": ("version: 1\nrecipe: [tensorwise]\n", "recipe", 2, "unknown recipe ['tensorwise']"),
    "complex_key_root": ("version: 1\n? [a, b]\n: 1\n", "<root>", 2, "keys must be plain names, got a list as a key"),
    "complex_key_nested": ("version: 1\ndefaults:\n  fast_accum: {[a]: true}\n", "defaults.fast_accum", 3, "keys must be plain names"),
    "yaml_syntax": ("version: 1\ndefaults:\n  format: e4m3\n    scaling: dynamic\n", "<yaml>", 4, "not valid YAML"),
    "duplicate_key": ("version: 1\ndefaults:\n  format: e4m3\n  format: e5m2\n", "defaults.format", 4, "key given twice"),
}


@pytest.mark.parametrize("text,key_path,line,fragment", list(BAD_FILES.values()), ids=list(BAD_FILES))
def test_bad_file(tmp_path, text, key_path, line, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as info:
        fp8fx.load_policy(path)
    e = info.value
    assert (e.key_path, e.line, e.source) == (key_path, line, str(path))
    assert str(e).startswith(f"{path}:{line}: {key_path}: ")
    assert fragment in str(e) and "\n" not in str(e)


@pytest.mark.parametrize("kind", ["empty", "comment_only", "missing", "directory"])
def test_file_level_errors_have_no_line(tmp_path, kind):
    path = tmp_path / "p.yaml"
    if kind == "empty":
        path.write_text("")
    elif kind == "comment_only":
        path.write_text("# nothing here\n")
    elif kind == "directory":
        path.mkdir()
    key, fragment = ("<root>", "empty") if kind in ("empty", "comment_only") else ("<file>", "cannot read policy file")
    with pytest.raises(PolicyError) as info:
        fp8fx.load_policy(path)
    assert (info.value.key_path, info.value.line) == (key, None)
    assert str(info.value).startswith(f"{path}: {key}: ") and fragment in str(info.value)


@pytest.mark.parametrize("build,key_path", [
    (lambda: Rule(match="x", format="e3m4"), "format"),
    (lambda: Rule(match="x", precision="low"), "precision"),
    (lambda: Rule(match=""), "match"),
    (lambda: Rule(match="re:("), "match"),
    (lambda: Rule(match="x", op=[]), "op"),
    (lambda: Rule(match="x", gemms={"qgrad": "high"}), "gemms.qgrad"),
    (lambda: Settings(ops=[]), "ops"),
    (lambda: Settings(ops=["mm", "conv"]), "ops[1]"),
    (lambda: Settings(granularity="row"), "granularity"),
    (lambda: Settings(gemms="high"), "gemms"),
    (lambda: GemmPrecisions(output="low"), "gemms.output"),
    (lambda: Policy(rules=[{"match": "x"}]), "rules[0]"),
], ids=lambda v: v if isinstance(v, str) else "build")
def test_python_built_bad_values(build, key_path):
    with pytest.raises(PolicyError) as info:
        build()
    assert info.value.key_path == key_path and info.value.line is None
    assert str(info.value).startswith(f"{key_path}: ")


# ---------------------------------------------------------------- CLI


def _stderr(result) -> str:
    try:
        return result.stderr
    except (ValueError, AttributeError):  # older click with mixed output
        return result.output


def test_cli_validate_good(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(GOOD_YAML)
    result = CliRunner().invoke(app, ["policy", "validate", str(path)])
    assert result.exit_code == 0, result.output
    assert f"{path}: valid." in result.output
    assert "format=hybrid scaling=dynamic granularity=tensorwise ops=mm,addmm" in result.output
    assert "rules[3]: match='*attn*' op=bmm precision=fp8 gemms=output:high" in result.output


@pytest.mark.parametrize("text,expected", [
    ("version: 1\ndefaults:\n  granularity: row\n", "{path}:3: defaults.granularity: expected tensorwise|rowwise|blockwise|mx|nvfp4, got 'row'"),
    ("version: 1\nrules:\n  - match: x\n    granularty: tensorwise\n", "{path}:4: rules[0].granularty: unknown key"),
    (None, "{path}: <file>: cannot read policy file"),
])
def test_cli_validate_bad(tmp_path, text, expected):
    path = tmp_path / "p.yaml"
    if text is not None:
        path.write_text(text)
    result = CliRunner().invoke(app, ["policy", "validate", str(path)])
    assert result.exit_code == 1
    assert not isinstance(result.exception, PolicyError) and "Traceback" not in result.output
    err = _stderr(result).strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: " + expected.format(path=path))
    assert "valid." not in result.output


@pytest.mark.parametrize("spelling", ["O2", "o2"])
def test_precision_level_is_a_top_level_key(spelling):
    policy = fp8fx.policy_from_yaml(f"version: 1\nlevel: {spelling}\n")
    assert policy.level is fp8fx.core.recipes.Level.O2 and policy.to_dict()["level"] == "O2"
    assert fp8fx.policy_from_yaml("version: 1\n").level is None


def test_fast_accum_defaults_merge_and_reach_the_report():
    """TransformerEngine's defaults (fprop fast, dgrad and wgrad promoted), TE's names accepted, a
    rule merging per GEMM, and each FP8 GEMM's record saying which it got."""
    from helpers import GatedBlock, compile_captured

    assert fp8fx.Policy().defaults.fast_accum == fp8fx.FastAccum(output=True, grad_input=False, grad_weight=False)
    policy = fp8fx.policy_from_yaml("version: 1\ndefaults:\n  fast_accum: {dgrad: true}\nrules:\n  - match: up\n    fast_accum: {fprop: false}\n")
    assert policy.defaults.fast_accum == fp8fx.FastAccum(True, True, False)
    assert policy.resolve(("up", "up"), "mm").settings.fast_accum == fp8fx.FastAccum(False, True, False)
    assert policy.to_dict()["rules"][0]["fast_accum"] == {"output": False}
    cap = compile_captured(GatedBlock(), policy)
    cap.compiled(torch.randn(2, 8, 64, requires_grad=True)).sum().backward()
    ops = cap.report.fp8_ops
    assert {(op.site, op.role): op.fast_accum for op in ops} == {
        (op.site, op.role): {"output": op.site != "up", "grad_input": True, "grad_weight": False}[op.role] for op in ops
    }
    variants = [a.fusion.variant for g in cap.forward + cap.backward for n in g.graph.nodes if (a := annotation(n)) and a.fusion and a.fusion.variant]
    assert sorted(v.fast_accum for v in variants) == sorted(op.fast_accum for op in ops)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_scales_in_blocks_along_k_are_promoted_whatever_fast_accum_says(recipe):
    """Block scales along K promote every K-block's sum (cuBLAS refuses fast accumulation with
    128x128 blocks): the records say split accumulation even where the policy asks for fast."""
    from helpers import GatedBlock, compile_captured

    policy = fp8fx.Policy.from_recipe(recipe)
    assert policy.defaults.fast_accum.output
    cap = compile_captured(GatedBlock(d=128, hidden=256), policy)
    cap.compiled(torch.randn(2, 64, 128, requires_grad=True)).sum().backward()
    assert cap.report.fp8_ops and not any(op.fast_accum for op in cap.report.fp8_ops)


def test_a_file_that_is_not_utf8_names_the_byte_and_line(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_bytes(b"version: 1\n# caf\xe9\n")
    with pytest.raises(PolicyError) as info:
        fp8fx.load_policy(path)
    assert (info.value.key_path, info.value.line) == ("<file>", 2) and "not UTF-8 text: byte 0xe9" in str(info.value)


def test_calibrate_is_a_top_level_key():
    policy = fp8fx.policy_from_yaml("version: 1\nrecipe: delayed\ncalibrate: true\n")
    assert policy.calibrate and policy.to_dict()["calibrate"] is True
    assert fp8fx.policy_from_yaml(yaml.safe_dump(policy.to_dict())) == policy
    assert "calibrate" not in fp8fx.Policy.from_recipe("delayed").to_dict()  # off by default
