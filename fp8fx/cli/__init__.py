"""The `fp8fx` command line: a thin layer over library functions; it alone prints."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

app = typer.Typer(help="FP8 training and inference for PyTorch as a torch.compile backend.", no_args_is_help=True, add_completion=False)
policy_app = typer.Typer(help="Work with precision-policy YAML files.", no_args_is_help=True)
app.add_typer(policy_app, name="policy")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


@app.command()
def demo(
    steps: int = typer.Option(10, min=1, help="Training steps."),
    inner: str = typer.Option("eager", help="Inner compiler after the FP8 passes: eager (compiles in a second) or inductor (about a minute on CPU)."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
) -> None:
    """Train a 2-block transformer with fp8fx on CPU beside an fp32 twin and print the precision report."""
    from fp8fx.compiler import INNER_COMPILERS
    from fp8fx.demo import run_demo

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
    from fp8fx.policy import PolicyError, load_policy

    try:
        policy = load_policy(file)
    except PolicyError as e:
        _fail(str(e))
    d = policy.defaults
    typer.echo(f"{file}: valid. defaults: format={d.format.value} scaling={d.scaling.value} granularity={d.granularity.value} ops={','.join(d.ops)}")
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


def main() -> None:
    app(prog_name="fp8fx")


if __name__ == "__main__":
    sys.exit(main())
