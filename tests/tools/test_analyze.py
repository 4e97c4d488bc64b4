"""`fp8fx analyze`, `fp8fx recipes`, `fp8fx policy init` on real model files (tests/assets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import meta_llama
from typer.testing import CliRunner

import fp8fx
from fp8fx.cli import app

ASSETS = Path(__file__).parents[1] / "assets"


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_analyze_mlp_table_on_the_meta_device():
    loaded = fp8fx.load_model_file(ASSETS / "mlp.py")
    assert loaded.shape_only and next(loaded.model.parameters()).device.type == "meta"  # no weights allocated
    result = run("analyze", ASSETS / "mlp.py")
    assert result.exit_code == 0, result.output
    assert "3/3 GEMMs" not in result.output and "2/3 GEMMs in FP8" in result.output
    assert "N=10 is not a multiple of 16" in result.output


@pytest.mark.parametrize("asset,train,fp8,total", [("mlp.py", True, 5, 8), ("transformer.py", False, 9, 13), ("gpt2.py", True, 27, 39)])
def test_analyze_json_counts_every_gemm(asset, train, fp8, total):
    result = run("analyze", ASSETS / asset, "--format", "json", *(["--train"] if train else []))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["summary"]
    assert (summary["fp8_gemms"], summary["gemms"]) == (fp8, total)


def test_analyze_with_a_policy_and_output_file(tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nrules:\n  - match: '0'\n    precision: high\n")
    out = tmp_path / "report.json"
    result = run("analyze", ASSETS / "mlp.py", "--policy", policy, "--format", "json", "-o", out)
    assert result.exit_code == 0, result.output
    ops = {op["site"]: op for op in json.loads(out.read_text())["ops"]}
    assert ops["0"]["precision"] == "high" and ops["0"]["reason_kind"] == "policy"


def test_fail_under_exits_1_and_names_the_biggest_high_gemms():
    assert run("analyze", ASSETS / "mlp.py", "--fail-under", "0.5").exit_code == 0
    result = run("analyze", ASSETS / "mlp.py", "--fail-under", "0.99")
    assert result.exit_code == 1 and "below the required 99.0%" in result.output and "4.output (shape" in result.output


def test_assert_coverage_library_call():
    loaded = fp8fx.load_model_file(ASSETS / "mlp.py")
    report = fp8fx.analyze(loaded.model, loaded.example_inputs)
    fp8fx.assert_coverage(report, 0.9)
    with pytest.raises(fp8fx.CoverageError, match="FP8 covers 9"):
        fp8fx.assert_coverage(report, 1.0)


@pytest.mark.parametrize(
    "asset,message",
    [
        ("no_inputs.py", "does not define example_inputs(); add `def example_inputs(): return (torch.randn(8, 128),)`"),
        ("import_error.py", "importing it raised NameError: name 'undefined_name' is not defined (line 5)"),
        ("missing.py", "missing.py: no such file"),
        ("buggy.py", "running the model raised"),
    ],
)
def test_bad_model_files_give_one_line_and_exit_1(asset, message):
    result = run("analyze", ASSETS / asset)
    assert result.exit_code == 1
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_debug_shows_the_traceback():
    result = run("analyze", ASSETS / "buggy.py", "--debug")
    assert result.exit_code == 1 and isinstance(result.exception, Exception)


def test_model_file_without_a_model(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import torch\ndef example_inputs():\n    return torch.randn(2, 2)\n")
    result = run("analyze", f)
    assert result.exit_code == 1 and "defines neither build_model() nor model" in result.output


def test_bad_format_and_both_policy_sources(tmp_path):
    assert "--format must be one of table, json, md, html" in run("analyze", ASSETS / "mlp.py", "--format", "xml").output
    assert "not both" in run("analyze", ASSETS / "mlp.py", "--policy", tmp_path / "p.yaml", "--recipe", "rowwise").output
    assert "unknown recipe 'fast'" in run("analyze", ASSETS / "mlp.py", "--recipe", "fast").output


def test_recipes_lists_every_recipe():
    result = run("recipes")
    assert result.exit_code == 0
    assert [line.split()[0] for line in result.output.splitlines()] == list(fp8fx.core.recipes.RECIPES)


@pytest.mark.parametrize("recipe", list(fp8fx.core.recipes.RECIPES))
def test_policy_init_writes_a_valid_policy(tmp_path, recipe):
    out = tmp_path / "policy.yaml"
    assert run("policy", "init", out, "--recipe", recipe).exit_code == 0
    policy = fp8fx.load_policy(out)
    assert policy.resolve(["lm_head"], "mm").rule_index == 0 and policy.rules[0].precision.value == "high"
    assert run("policy", "init", out).exit_code == 1  # no silent overwrite
    assert run("policy", "validate", out).exit_code == 0


def test_policy_init_rejects_unknown_recipe(tmp_path):
    result = run("policy", "init", tmp_path / "p.yaml", "--recipe", "nope")
    assert result.exit_code == 1 and "unknown recipe" in result.output and not (tmp_path / "p.yaml").exists()


def _records(report):
    return sorted((op.site, op.role, op.precision, op.reason_kind, op.flops, op.epilogue or "") for op in report.ops)


def test_folding_repeated_layers_gives_the_same_report():
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    folded = fp8fx.analyze(meta_llama(4), (ids,), train=True)
    whole = fp8fx.analyze(meta_llama(4), (ids,), train=True, fold_repeated=False)
    assert folded.folded == {"model.layers": 4} and whole.folded == {}
    assert _records(folded) == _records(whole) and len(folded.ops) == 95


def test_a_policy_that_tells_layers_apart_is_not_folded():
    policy = fp8fx.policy_from_yaml("version: 1\nrules:\n  - match: 'model.layers.0.*'\n    precision: high\n")
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    report = fp8fx.analyze(meta_llama(3), (ids,), policy)
    assert report.folded == {}
    high = {op.fqn for op in report.high_ops if op.reason_kind == "policy"}
    assert high and all(f.startswith("model.layers.0.") for f in high)


def test_a_7b_shaped_llama_is_analysed_forward_and_backward_in_under_a_minute():
    import time

    start = time.perf_counter()
    model = meta_llama(32, hidden=4096, inter=11008, heads=32, kv=32, vocab=32000)
    report = fp8fx.analyze(model, (torch.zeros(1, 2048, dtype=torch.long, device="meta"),), train=True)
    assert time.perf_counter() - start < 60
    assert report.folded == {"model.layers": 32}
    assert len(report.ops) == 32 * 23 + 3  # per layer: 7 linear sites x 3 GEMMs + fused attention (2); plus lm_head



def test_fp8_activations_shrink_what_is_saved_for_backward():
    # Many tokens, small weights: FP8 copies of activations replace fp32 ones (the weights' FP8
    # copies cost less than that saves).
    report = fp8fx.analyze(meta_llama(2), (torch.zeros(8, 512, dtype=torch.long, device="meta"),), train=True)
    s = report.summary()
    assert report.saved_bytes_high_precision == s["saved_for_backward_bytes"] + s["fp8_saved_activation_bytes"]
    assert 0.3 < s["saved_for_backward_bytes"] / report.saved_bytes_high_precision < 0.9
    assert "with every GEMM in high precision" in report.table()


def test_markdown_report_has_one_row_per_gemm():
    result = run("analyze", ASSETS / "mlp.py", "--train", "--format", "md")
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 8  # header + every GEMM
    assert rows[0].startswith("| graph | site |") and "- 5/8 GEMMs in FP8" in result.stdout
    assert all(row.count(" | ") == rows[0].count(" | ") for row in rows)  # no cell breaks the table


def test_numerics_from_calibration_data_in_json(tmp_path):
    result = run("analyze", ASSETS / "transformer.py", "--train", "--numerics", "--calibrate", "2", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["schema"] == "fp8fx.report/4" and data["summary"]["numerics_batches"] == 2
    linear = [op for op in data["ops"] if op["op"] in ("mm", "addmm")]
    fp8 = [op for op in linear if op["precision"] == "fp8"]
    assert fp8 and all(op["numerics"]["sqnr_db"] > 10 and len(op["numerics"]["operands"]) == 2 for op in fp8)
    assert all(set(op["numerics"]["what_if"]) == set(fp8fx.core.recipes.RECIPES) for op in linear)


def test_suggest_policy_from_numerics_writes_a_valid_policy(tmp_path):
    out = tmp_path / "suggested.yaml"
    result = run("analyze", ASSETS / "mlp.py", "--train", "--numerics", "--min-sqnr", "40", "--suggest-policy", out)
    assert result.exit_code == 0, result.output
    assert "rule(s) added" in result.output
    policy = fp8fx.load_policy(out)  # valid
    assert len(policy.rules) >= 1 and "SQNR" in out.read_text()
    again = run("analyze", ASSETS / "mlp.py", "--train", "--policy", out, "--format", "json")
    assert json.loads(again.stdout)["summary"]["fp8_gemms"] == 0  # every FP8 GEMM of a tiny MLP is below 40 dB


def test_html_report_is_written(tmp_path):
    out = tmp_path / "report.html"
    result = run("analyze", ASSETS / "mlp.py", "--train", "--numerics", "--format", "html", "-o", out)
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and 'id="plot-sqnr"' in page


@pytest.mark.parametrize(
    "args,message",
    [
        (["--suggest-policy", "x.yaml"], "--suggest-policy needs --target (speed) or --numerics"),
        (["--target", "gtx480"], "unknown"),
        (["--target", "fp8=abc"], "fp8"),
    ],
)
def test_analyze_option_errors(args, message):
    result = run("analyze", ASSETS / "mlp.py", *args)
    assert result.exit_code == 1 and message in result.output, result.output


def test_bad_calibration_data_is_one_clear_error():
    result = run("analyze", ASSETS / "bad_calibration.py", "--numerics")
    assert result.exit_code == 1
    assert "calibration_data() must give a tensor or a tuple of tensors, got str" in result.output
    assert "Traceback" not in result.output


def test_target_marks_slower_gemms_and_suggests_glob_rules(tmp_path):
    out = tmp_path / "suggested.yaml"
    result = run("analyze", ASSETS / "transformer.py", "--train", "--target", "h100", "--suggest-policy", out, "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    s = data["summary"]
    fp8 = [op for op in data["ops"] if op["precision"] == "fp8"]
    slower = [op for op in fp8 if op["predicted"]["speedup"] < 1]
    assert s["target"] == "h100-sxm" and s["slower_in_fp8"] == len(slower) > 0 and s["predicted_step_speedup"] < 1
    assert all(op["predicted"]["bf16_us"] > 0 for op in data["ops"])
    policy = fp8fx.load_policy(out)
    assert any("*" in rule.match for rule in policy.rules)  # one rule for a site repeated in both blocks
    assert "predicted" in out.read_text() and "x on h100-sxm" in out.read_text()
    again = json.loads(run("analyze", ASSETS / "transformer.py", "--train", "--policy", out, "--format", "json").stdout)
    kept_high = {(op["site"], op["role"]) for op in slower}
    for op in again["ops"]:
        before = next(o for o in data["ops"] if (o["site"], o["role"]) == (op["site"], op["role"]))
        assert op["precision"] == ("high" if (op["site"], op["role"]) in kept_high else before["precision"])


def test_table_marks_slower_gemms(tmp_path):
    out = tmp_path / "report.txt"
    result = run("analyze", ASSETS / "mlp.py", "--target", "h100", "-o", out)
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert "fp8/bf16 x" in text and "!" in text and "predicted on h100-sxm" in text


MIXTRAL_FILE = """
import torch
from transformers import MixtralConfig, MixtralForCausalLM


def build_model():
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32, use_cache=False, experts_implementation="{impl}",
    ))


def example_inputs():
    return (torch.randint(0, 64, (1, 8)),)
"""


def _mixtral_file(tmp_path, impl: str) -> Path:
    path = tmp_path / f"mixtral_{impl}.py"
    path.write_text(MIXTRAL_FILE.format(impl=impl))
    return path


def test_eager_experts_are_analysed_on_real_tensors_and_reported_not_captured(tmp_path):
    from fp8fx.reporting.uncaptured import EAGER_EXPERTS_FIX

    loaded = fp8fx.load_model_file(_mixtral_file(tmp_path, "eager"))
    report = fp8fx.analyze(loaded.model, loaded.example_inputs, train=True)
    experts = "model.layers.0.mlp.experts"
    assert [(u.module, u.kind, u.fix) for u in report.uncaptured] == [(experts, "MixtralExperts", EAGER_EXPERTS_FIX)]
    assert report.traced_on_real_tensors == f"transformers' eager experts in module '{experts}' (MixtralExperts) loop over data-dependent indices"
    # What a compile of the same model says (test_uncaptured compiles it): every GEMM but the experts'.
    assert (len(report.fp8_ops), len(report.ops)) == (15, 20) and not any(".experts" in op.fqn for op in report.ops)
    with pytest.raises(fp8fx.CoverageError, match=experts):
        fp8fx.assert_coverage(report, 0.5)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_fail_under_fails_on_experts_no_graph_captured(tmp_path, impl):
    result = run("analyze", _mixtral_file(tmp_path, impl), "--format", "json", "--fail-under", "0.5")
    if impl == "eager":
        assert result.exit_code == 1, result.output
        assert "error: the GEMMs of model.layers.0.mlp.experts ran outside every compiled graph" in result.output
        assert 'set experts_implementation="grouped_mm"' in result.output
    else:
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["summary"]["uncaptured_modules"] == [] and report["summary"]["traced_on_real_tensors"] is None
        experts = [op for op in report["ops"] if op["fqn"] == "model.layers.0.mlp.experts"]
        assert len(experts) == 2 and all(op["op"] == "grouped_mm" and op["precision"] == "fp8" for op in experts)


class Routed(torch.nn.Module):
    """Each token through the matrix its router picks, in a loop over the picks made (data-dependent)."""

    def __init__(self, d=32, choices=16):
        super().__init__()
        self.router = torch.nn.Linear(d, choices)
        self.weight = torch.nn.Parameter(torch.randn(choices, d, d) / d**0.5)

    def forward(self, x):
        scores = self.router(x).softmax(-1)
        choice = scores.argmax(-1)
        out = torch.zeros_like(x)
        for i in choice.unique():
            rows = (choice == i).nonzero().squeeze(-1)
            out = out.index_add(0, rows, x[rows] @ self.weight[i].T)
        return out * scores.amax(-1, keepdim=True)


def test_a_data_dependent_loop_is_traced_on_real_tensors():
    with torch.device("meta"):
        model = Routed()
    report = fp8fx.analyze(model, (torch.randn(16, 32, device="meta"),), train=True)
    assert report.traced_on_real_tensors == "the shape-only trace stopped at DynamicOutputShapeException: aten._unique2.default"
    assert sorted(op.role for op in report.ops if op.fqn == "router") == ["grad_weight", "output"]
    assert report.uncaptured_weights == ["weight"]
    assert "not captured: <root> (Routed): 1 weight parameter never read by a compiled graph" in report.table()
    compiled = torch.compile(Routed(), backend=fp8fx.backend(inner="eager"))
    compiled(torch.randn(16, 32)).sum().backward()
    assert [r[:-1] for r in _records(fp8fx.report(compiled))] == [r[:-1] for r in _records(report)]  # epilogues: Inductor's in analyze
    assert fp8fx.report(compiled).uncaptured == report.uncaptured
