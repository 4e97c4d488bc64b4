"""The `fp8fx` command line: a thin layer over library functions; it alone prints."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from pathlib import Path

import typer
from typer.core import TyperGroup

_UsageError = typer.BadParameter.__base__  # click's (typer may bundle its own click)


@contextlib.contextmanager
def _usage_errors_in_one_line(ctx):
    try:
        yield
    except _UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # a command given nothing: its help
            raise
        typer.echo(f"error: {e.format_message()} (see {(e.ctx or ctx).command_path} --help)", err=True)
        raise typer.Exit(1) from None


class _OneLineErrors(TyperGroup):
    """Bad options and arguments give one error line and exit code 1, like every other bad input."""

    def parse_args(self, ctx, args):
        with _usage_errors_in_one_line(ctx):
            return super().parse_args(ctx, args)

    def invoke(self, ctx):
        with _usage_errors_in_one_line(ctx):
            return super().invoke(ctx)


app = typer.Typer(
    cls=_OneLineErrors,
    help="FP8 training and inference for PyTorch as a torch.compile backend.",
    no_args_is_help=True,
    add_completion=False,
)
policy_app = typer.Typer(help="Work with precision-policy YAML files.", no_args_is_help=True)
app.add_typer(policy_app, name="policy")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _output_file(path: Path | None, what: str) -> Path | None:
    """`path` if a file can be written there (checked before any work is done); one error line otherwise."""
    if path is None:
        return None
    if path.is_dir():
        _fail(f"{what}: {path} is a directory; give a file name")
    if not path.parent.is_dir():
        _fail(f"{what}: cannot write {path}: directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        _fail(f"{what}: cannot write {path}: permission denied")
    return path


def _write(path: Path, text: str) -> None:
    """Write `path` through a file beside it renamed at the end: a failure leaves no partial file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        _fail(f"cannot write {path}: {e.strerror or e}")


@contextlib.contextmanager
def _torch_logs(debug: bool):
    """PyTorch's own log lines (a failed fake-tensor call logs its traceback) only with --debug."""
    logger = logging.getLogger("torch")
    level = logger.level
    if not debug:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _chosen_policy(policy: Path | None, recipe: str | None, debug: bool):
    """The policy of --policy FILE or --recipe NAME (default: the built-in one); one error line if bad."""
    from fp8fx.core.policy import Policy, PolicyError
    from fp8fx.core.policy_yaml import load_policy

    if policy is not None and recipe is not None:
        _fail("give --policy or --recipe, not both")
    try:
        return load_policy(policy) if policy is not None else Policy.from_recipe(recipe) if recipe is not None else Policy()
    except PolicyError as e:
        if debug:
            raise
        _fail(str(e))


@app.command()
def demo(
    steps: int = typer.Option(10, min=1, help="Training steps."),
    inner: str = typer.Option(
        "eager", help="Inner compiler after the FP8 passes: eager (compiles in a second) or inductor (about a minute on CPU)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
) -> None:
    """Train a 2-block transformer with fp8fx on CPU beside an fp32 twin and print the precision report."""
    from fp8fx.compiler.backend import INNER_COMPILERS
    from fp8fx.tools.demo import run_demo

    if inner not in INNER_COMPILERS:
        _fail(f"--inner must be one of {', '.join(INNER_COMPILERS)}, got {inner!r}")
    result = run_demo(steps=steps, inner=inner)
    if json_out:
        typer.echo(result.report.to_json())
        return
    typer.echo("step  loss(fp8fx)  loss(fp32)")
    for i, (a, b) in enumerate(zip(result.losses, result.fp32_losses)):
        typer.echo(f"{i:4d}  {a:11.4f}  {b:10.4f}")
    typer.echo("")
    typer.echo(str(result.report))


@policy_app.command("validate")
def policy_validate(file: Path = typer.Argument(..., help="Policy YAML file.")) -> None:
    """Check a policy file; print its rules, or one error naming the line and key path."""
    from fp8fx.core.policy import PolicyError
    from fp8fx.core.policy_yaml import load_policy

    try:
        policy = load_policy(file)
    except PolicyError as e:
        _fail(str(e))
    d = policy.defaults
    typer.echo(
        f"{file}: valid. defaults: format={d.format.value} scaling={d.scaling.value} "
        f"granularity={d.granularity.value} ops={','.join(d.ops)}"
    )
    for i, rule in enumerate(policy.rules):
        parts = [f"match={rule.match!r}"]
        if rule.op:
            parts.append(f"op={','.join(rule.op)}")
        if rule.precision:
            parts.append(f"precision={rule.precision.value}")
        if rule.format:
            parts.append(f"format={rule.format.value}")
        if rule.gemms:
            parts.append("gemms=" + ",".join(f"{k}:{v.value}" for k, v in rule.gemms.items()))
        typer.echo(f"  rules[{i}]: " + " ".join(parts))


FORMATS = ("table", "json", "md", "html")


@app.command()
def analyze(
    model_file: Path = typer.Argument(
        ...,
        help="Python file defining build_model() (or model) and example_inputs(); optional loss_fn(output) for --train, "
        "calibration_data() for --numerics.",
    ),
    policy: Path | None = typer.Option(None, "--policy", help="Precision-policy YAML file."),
    recipe: str | None = typer.Option(None, "--recipe", help="A named recipe instead of a policy file (see `fp8fx recipes`)."),
    train: bool = typer.Option(False, "--train", help="Analyse the training step: forward and backward GEMMs."),
    target: str | None = typer.Option(
        None,
        "--target",
        help="Predict BF16 and FP8 time per GEMM and per step on a GPU: h100, h100-pcie, h200, h800, b200, b300, gb200, "
        "or a spec 'fp8=TFLOPS,bf16=TFLOPS,bw=TB/s,sms=N'.",
    ),
    numerics: bool = typer.Option(
        False,
        "--numerics",
        help="Run real tensors (weights initialised by build_model()) and add per-GEMM amax, scale, underflow %, "
        "saturation % and SQNR, with what-ifs for every recipe.",
    ),
    calibrate: int = typer.Option(
        2, "--calibrate", min=1, help="Batches for --numerics, from calibration_data() or else example_inputs()."
    ),
    fmt: str = typer.Option(
        "table", "--format", help="Output format: table, json, md (Markdown) or html (a self-contained page with plots)."
    ),
    output: Path | None = typer.Option(None, "-o", "--output", help="Write the report to this file instead of standard output."),
    suggest: Path | None = typer.Option(
        None,
        "--suggest-policy",
        help="Write a commented policy keeping high the GEMMs predicted slower in FP8 (--target) or below --min-sqnr "
        "(--numerics).",
    ),
    min_sqnr: float = typer.Option(
        18.0, "--min-sqnr", help="SQNR (dB) below which --suggest-policy keeps a GEMM high (with --numerics)."
    ),
    fail_under: float | None = typer.Option(
        None, "--fail-under", min=0.0, max=1.0, help="Exit 1 if FP8 covers less than this share (0-1) of GEMM FLOPs."
    ),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks."),
) -> None:
    """Decide every GEMM of a model as compiling would, and print the per-op precision report.

    A model made by build_model() is built on the meta device (shapes only, no weights) unless
    --numerics asks for real tensors."""
    from fp8fx.tools.analyze import CoverageError, ModelFileError, assert_coverage, error_summary, failing_module, load_model_file
    from fp8fx.tools.analyze import analyze as run_analysis

    if fmt not in FORMATS:
        _fail(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if suggest is not None and target is None and not numerics:
        _fail("--suggest-policy needs --target (speed) or --numerics (accuracy) to decide from")
    spec = None
    if target is not None:
        from fp8fx.reporting.costmodel import gpu

        try:
            spec = gpu(target)
        except ValueError as e:
            _fail(f"--target: {e}")
    chosen = _chosen_policy(policy, recipe, debug)
    output, suggest = _output_file(output, "--output"), _output_file(suggest, "--suggest-policy")
    loaded = None
    with _torch_logs(debug):
        try:
            loaded = load_model_file(model_file, real_weights=numerics)
            calibration = loaded.calibration(calibrate) if numerics else None
            with _progress() as progress:
                report = run_analysis(
                    loaded.model,
                    loaded.example_inputs,
                    chosen,
                    train=train,
                    loss_fn=loaded.loss_fn,
                    calibration=calibration,
                    progress=progress,
                )
            if spec is not None:
                report = report.with_predictions(spec)
        except ModelFileError as e:
            if debug:
                raise
            _fail(str(e))
        except Exception as e:  # noqa: BLE001 - an error inside the user's model: one line unless --debug
            if debug:
                raise
            module = failing_module(loaded.model, loaded.example_inputs) if loaded is not None else None
            _fail(
                f"{model_file}: running the model raised {error_summary(e, model_file)}"
                f"{f' in module {module}' if module else ''} (--debug for the traceback)"
            )
    if suggest is not None:
        from fp8fx.tools.suggest import suggest_policy

        text, rules = suggest_policy(report, chosen, min_sqnr if numerics else None)
        _write(suggest, text)
        typer.echo(f"suggested policy written to {suggest} ({rules} rule(s) added)", err=True)
    _emit(report, fmt, output)
    if fail_under is not None:
        try:
            assert_coverage(report, fail_under)
        except CoverageError as e:
            _fail(str(e))


def _emit(report, fmt: str, output: Path | None) -> None:
    if fmt == "table":
        from rich.console import Console

        from fp8fx.reporting.text import rich_report

        if output is None:
            Console(width=max(160, Console().width)).print(rich_report(report))
            return
        text = io.StringIO()
        Console(file=text, width=220, color_system=None).print(rich_report(report))
        _write(output, text.getvalue())
    else:
        if fmt == "html":
            from fp8fx.reporting.html import render_html

            text = render_html(report.to_dict())
        else:
            text = report.to_json() if fmt == "json" else report.markdown()
        if output is None:
            typer.echo(text)
            return
        _write(output, text + "\n")
    typer.echo(f"report written to {output}", err=True)


@contextlib.contextmanager
def _progress():
    """A progress bar on standard error while analysis batches run (only on a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        tasks: dict[str, int] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                label = {
                    "analysis": "tracing and deciding",
                    "baseline": "all-high baseline",
                    "numerics": "measuring numerics",
                }.get(stage, stage)
                tasks[stage] = bar.add_task(label, total=total)
            bar.update(tasks[stage], completed=done)

        yield update


@app.command()
def export(
    model_file: Path = typer.Argument(
        ..., help="Python file defining build_model() (or model) and example_inputs(); optional calibration_data()."
    ),
    onnx_path: Path = typer.Option(..., "--onnx", help="Where to write the ONNX model (nothing is written if a check fails)."),
    policy: Path | None = typer.Option(None, "--policy", help="Precision-policy YAML file."),
    recipe: str | None = typer.Option(None, "--recipe", help="A named recipe instead of a policy file (see `fp8fx recipes`)."),
    calibrate: int = typer.Option(
        1,
        "--calibrate",
        min=1,
        help="Batches whose activation amaxes set the static input scales: calibration_data(), or else example_inputs().",
    ),
    opset: int = typer.Option(
        21, "--opset", help="ONNX opset: 19 or newer for FP8 QDQ, 21 or newer for blockwise weight scales."
    ),
    dynamic: str = typer.Option(
        "", "--dynamic", help="Input dimensions kept dynamic, comma-separated: batch (dim 0), seq (dim 1)."
    ),
    no_verify: bool = typer.Option(
        False, "--no-verify", help="Skip onnx's checker, shape inference and the onnxruntime comparison."
    ),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks."),
) -> None:
    """Export the inference graph as standard ONNX FP8 (QuantizeLinear/DequantizeLinear), verified in onnxruntime.

    Sites the policy puts in FP8 get Q/DQ with FP8 weights; nothing is written if a check fails."""
    from fp8fx.tools.analyze import ModelFileError, load_model_file
    from fp8fx.tools.export import ExportError, export_onnx

    chosen = _chosen_policy(policy, recipe, debug)
    _output_file(onnx_path, "--onnx")
    try:
        with _torch_logs(debug):
            loaded = load_model_file(model_file, real_weights=True)
            calibration = loaded.calibration(calibrate)
            dims = tuple(d.strip() for d in dynamic.split(",") if d.strip())
            result = export_onnx(
                loaded.model,
                loaded.example_inputs,
                onnx_path,
                chosen,
                calibration,
                opset=opset,
                dynamic=dims,
                verify=not no_verify,
            )
    except (ModelFileError, ExportError) as e:
        if debug:
            raise
        _fail(str(e))
    fp8 = [s for s in result.sites if s.precision == "fp8"]
    typer.echo(
        f"wrote {result.path} (opset {result.opset}): {len(fp8)}/{len(result.sites)} GEMM sites in FP8, "
        f"{result.quantize_nodes} QuantizeLinear, {result.dequantize_nodes} DequantizeLinear, {result.fp8_weights} FP8 weights"
    )
    if result.verified:
        typer.echo(
            f"onnxruntime: max |difference| to fp8fx's emulation {result.max_abs_diff_vs_emulation:.3g}; SQNR "
            f"against the original model {result.sqnr_vs_original_db:.1f} dB"
        )
    else:
        typer.echo("not verified (--no-verify)")
    width = max(len(s.site) for s in result.sites)
    for s in result.sites:
        typer.echo(f"  {s.site.ljust(width)}  {s.precision:4s}  {', '.join(s.onnx_nodes) or '-'}")


@app.command()
def bisect(
    model_file: Path = typer.Argument(
        ...,
        help="Python file defining build_model() (or model) and example_inputs(); optional loss_fn(output), calibration_data().",
    ),
    steps: int = typer.Option(8, "--steps", min=1, help="Training steps replayed in fp32 and in FP8 (one batch each)."),
    policy: Path | None = typer.Option(None, "--policy", help="Precision-policy YAML file of the FP8 run."),
    recipe: str | None = typer.Option(None, "--recipe", help="A named recipe instead of a policy file (see `fp8fx recipes`)."),
    lr: float = typer.Option(1e-2, "--lr", help="SGD learning rate of the replayed steps."),
    close: float = typer.Option(
        0.1,
        "--close",
        min=0.0,
        max=1.0,
        help="A set of GEMMs closes the gap when the gap with them high is at most this share of the FP8 run's.",
    ),
    output: Path = typer.Option(Path("fp8fx-bisect.yaml"), "-o", "--output", help="Where to write the policy patch."),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks."),
) -> None:
    """Find the FP8 GEMMs that make training leave fp32, and write a policy keeping them high.

    A smallest set of site x output/grad_input/grad_weight whose high precision closes the loss gap."""
    from fp8fx.tools.analyze import ModelFileError, error_summary, load_model_file
    from fp8fx.tools.bisect import bisect as run_bisect

    chosen = _chosen_policy(policy, recipe, debug)
    _output_file(output, "--output")
    try:
        with _torch_logs(debug):
            loaded = load_model_file(model_file, real_weights=True)
            batches = loaded.calibration(steps)
            result = run_bisect(loaded.fresh_model, batches, chosen, loaded.loss_fn, lr=lr, close=close)
    except ModelFileError as e:
        if debug:
            raise
        _fail(str(e))
    except Exception as e:  # noqa: BLE001
        if debug:
            raise
        _fail(f"{model_file}: training the model raised {error_summary(e, model_file)} (--debug for the traceback)")
    typer.echo(f"FP8 loss gap to fp32 over {steps} steps: {100 * result.gap:.3g}% (mean relative); {result.runs} training runs")
    if not result.culprits:
        typer.echo("no set of GEMMs closes the gap further: nothing to keep high")
    else:
        typer.echo(f"keeping {len(result.culprits)} GEMM(s) high leaves {100 * result.remaining_gap:.3g}%:")
        for site, role in result.culprits:
            typer.echo(f"  {site}  {role}")
    _write(output, result.policy_yaml)
    typer.echo(f"policy patch written to {output}")


@app.command()
def recipes() -> None:
    """List the named recipes and the settings each one sets."""
    from fp8fx.core.recipes import RECIPES

    for name, settings in RECIPES.items():
        typer.echo(f"{name:14s} " + " ".join(f"{k}={v}" for k, v in settings.items()))


STARTER_POLICY = """\
# fp8fx precision policy. Check it with: fp8fx policy validate {path}
version: 1
recipe: {recipe}          # tensorwise | rowwise | rowwise_gw_hp | blockwise | delayed | megatron (fp8fx recipes)
defaults:                 # keys here override the recipe's
  gemms: {{output: fp8, grad_input: fp8, grad_weight: fp8}}
rules:                    # first match wins; match a site name or module path (glob, or re:...)
  - match: "lm_head"      # the output projection is sensitive: keep it in high precision
    precision: high
  - match: "*router*"     # MoE routers too
    precision: high
"""


@policy_app.command("init")
def policy_init(
    output: Path = typer.Argument(Path("fp8fx-policy.yaml"), help="Where to write the starter policy."),
    recipe: str = typer.Option("tensorwise", "--recipe", help="The recipe the policy starts from."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Write a commented starter policy file (validated before it is written)."""
    from fp8fx.core.policy import PolicyError
    from fp8fx.core.policy_yaml import policy_from_yaml

    _output_file(output, "policy init")
    if output.exists() and not force:
        _fail(f"{output} exists; pass --force to overwrite it")
    text = STARTER_POLICY.format(path=output, recipe=recipe)
    try:
        policy_from_yaml(text, source=str(output))
    except PolicyError as e:
        _fail(str(e))
    _write(output, text)
    typer.echo(f"wrote {output} (recipe {recipe})")


@app.command()
def selftest(
    out: Path | None = typer.Option(
        None, "--out", help="Where to write the JSON results (default: fp8fx-selftest-<device>.json in this directory)."
    ),
    no_table: bool = typer.Option(
        False, "--no-table", help="Do not write the measured dispatch table that kernels='auto' reads (GPU only)."
    ),
    quick: bool = typer.Option(False, "--quick", help="Time 12 GEMM shapes instead of bench/gemm_gpu.py's 53 (GPU only)."),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks."),
) -> None:
    """Check fp8fx's kernels on this machine's GPU against the CPU reference and time them.

    Every kernel variant of a small transformer's training step runs through
    the generated kernels and torch._scaled_mm; a compiled training step is
    compared with kernels='scaled_mm'; GEMMs and a block are timed against
    BF16. Writes one JSON file and the dispatch table. Without a GPU: offline
    builds and Triton's interpreter. Exit code 1 if a check failed."""
    from fp8fx.tools.selftest import SelftestError, check_output_path, default_output, gpu_status, run

    try:
        status = gpu_status()
        out = check_output_path(out if out is not None else default_output(status))  # before minutes of work
        if status.info is None:
            typer.echo(f"no GPU: {status.reason}; running the CPU checks only (offline builds, Triton's interpreter)")
        else:
            g = status.info
            typer.echo(f"GPU: {g['name']} (capability {g['capability']}, {g['target']}, {g['sms']} SMs, {g['memory_gib']} GiB)")
        with _progress() as progress:
            result = run(out=out, write_table=not no_table, quick=quick, progress=progress)
    except SelftestError as e:
        if debug:
            raise
        _fail(str(e))
    for line in _selftest_lines(result):
        typer.echo(line)
    if result.table_error:
        typer.echo(f"error: {result.table_error}", err=True)
    raise typer.Exit(0 if result.passed and not result.table_error else 1)


_CHECK_LABELS = {
    ("gemm", "gpu"): "GEMMs vs the CPU reference (generated kernel and torch._scaled_mm)",
    ("step", "gpu"): "training steps (SQNR vs the fp32 step, at most 1 dB short of kernels='scaled_mm')",
    ("build", "offline"): "offline builds (0 spills, FP8 tensor-core instruction)",
    ("gemm", "interpreter"): "GEMMs in Triton's interpreter vs the CPU reference",
    (
        "step",
        "interpreter",
    ): "training step in Triton's interpreter (SQNR vs the fp32 step, at most 1 dB short of kernels='scaled_mm')",
    ("interpreter", "interpreter"): "Triton's interpreter",
}


def _why_failed(c: dict) -> str:
    if c.get("error"):
        return c["error"]
    if c["kind"] == "build":
        return (
            f"{c['spill_bytes']} spill bytes, shared memory {c['shared_bytes']}/{c['shared_limit']}, FP8 MMA "
            f"{c['fp8_mma'] or 'missing'}"
        )
    if c["kind"] == "step":
        return (
            f"min SQNR vs fp32 {c['min_sqnr_db']} dB (kernels='scaled_mm': {c['baseline_min_sqnr_db']} dB), "
            f"a tensor {c['max_shortfall_db']} dB short of kernels='scaled_mm''s"
        )
    parts = []  # a GEMM: its failing outputs
    for name, v in c.items():
        if isinstance(v, dict) and v.get("passed") is False:
            detail = v.get("error") or (f"SQNR {v['sqnr_db']} dB" if "sqnr_db" in v else f"relative error {v.get('rel_err')}")
            parts.append(f"{name} {detail}")
    return ", ".join(parts)


def _selftest_lines(result) -> list[str]:
    """The summary of a self-test: one line per group of checks, each failure, timings, files."""
    data = result.data
    env = data["environment"]
    lines = [f"torch {env['torch']}, Triton {env['triton']}, CUDA {env['cuda']}, fp8fx {env['fp8fx']}"]
    lines += env["limits"]  # what this Triton lacks (fp8fx.codegen.versions)
    lines.append(
        "kernel variants in a training step "
        f"({', '.join(sorted({r for v in data['variants'] for r in v['recipes']}))}): {len(data['variants'])}"
    )
    for g in data["summary"]:
        label = _CHECK_LABELS.get((g["kind"], g["where"]), f"{g['kind']} ({g['where']})")
        db = f", min SQNR {g['min_sqnr_db']:.1f} dB" if g["min_sqnr_db"] is not None else ""
        lines.append(f"{label}: {g['passed']}/{g['total']} passed{db}")
    for c in data["checks"]:
        if not c["passed"]:
            what = " ".join(str(c[key]) for key in ("variant", "arch", "recipe", "kernels", "path") if c.get(key))
            shape = f" {c['m']}x{c['n']}x{c['k']}" if "m" in c else ""
            lines.append(f"  FAILED {c['kind']} {what}{shape}: {_why_failed(c)}")
    speed = data.get("speed")
    if speed:
        for s in speed["summary"]:
            t = s["median_tflops"]
            lines.append(
                f"{s['role']} FP8 GEMM ({s['variant']}), median TFLOP/s over {s['shapes']} shapes: generated {t['generated']}, "
                f"torch._scaled_mm {t['scaled_mm']}, BF16 torch.mm {t['bf16']}; generated faster on "
                f"{s['generated_faster']}/{s['compared']}"
            )
        b = speed["block"]
        lines.append(
            f"block training step (ms): fp8fx {b['fp8fx_auto_ms']}, fp8fx kernels='scaled_mm' "
            f"{b['fp8fx_scaled_mm_ms']}, BF16 torch.compile {b['bf16_ms']}"
        )
    lines.append(f"results written to {result.json_path}")
    if result.table_path:
        lines.append(f"dispatch table written to {result.table_path}: kernels='auto' now follows these measurements on this GPU")
    elif data["gpu"] is None:
        lines.append("no dispatch table written (no GPU)")
    failed, total = sum(not c["passed"] for c in data["checks"]), len(data["checks"])
    verdict = (
        f"all {total} checks passed"
        if data["passed"]
        else f"{failed} of {total} checks FAILED"
        if total
        else "FAILED: no check ran"
    )
    lines.append(f"{verdict} ({data['seconds']:.0f} s)")
    return lines


def main() -> None:
    app(prog_name="fp8fx")


if __name__ == "__main__":
    sys.exit(main())
