"""The stages of a compile (`fp8fx.compiler.pipeline`) and the backend's options value
(`fp8fx.passes.options.BackendOptions`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import fx

import fp8fx
from fp8fx.compiler import pipeline
from fp8fx.passes import REWRITE_PASSES, BackendOptions, PassError, PassResult


def _fine(gm, ctx):
    return PassResult(gm, False)


def _broken(gm, ctx):
    raise ValueError("no graph for you")


def test_a_failing_pass_names_itself_its_stage_and_the_passes_before_it():
    gm = fx.symbolic_trace(torch.nn.ReLU())
    expected = r"^fp8fx pass _broken failed in stage demo \(after _fine\): ValueError: no graph for you$"
    with pytest.raises(PassError, match=expected):
        pipeline.Stage("demo", (_fine, _broken))(gm, None)


def test_a_pass_error_of_a_stage_run_inside_a_pass_keeps_its_own_names():
    gm = fx.symbolic_trace(torch.nn.ReLU())

    def runs_inner(gm, ctx):
        return PassResult(pipeline.Stage("inner", (_broken,))(gm, ctx), True)

    with pytest.raises(PassError, match=r"^fp8fx pass _broken failed in stage inner: "):
        pipeline.Stage("outer", (runs_inner,))(gm, None)


def test_the_stages_in_the_order_a_graph_meets_them():
    names = ["before_aot", "rewrite", "joint", "eager_joint", "after_partition", "eager_after_partition", "after_fusion"]
    assert [s.name for s in pipeline.STAGES] == names
    assert pipeline.JOINT.passes[0] is pipeline.EAGER_JOINT.passes[0] is pipeline.fp8_rewrite
    assert pipeline.REWRITE.passes == REWRITE_PASSES


def test_the_options_are_one_frozen_value_the_backend_reads():
    backend = fp8fx.backend(kernels="scaled_mm", cublas_devices=["cpu", "cuda"])
    assert backend.kernels == backend.options.kernels == "scaled_mm"
    assert backend.options.cublas_devices == ("cpu", "cuda") and backend.epilogues_to_inductor
    with pytest.raises(dataclasses.FrozenInstanceError):
        backend.options.kernels = "auto"
    with pytest.raises(AttributeError):
        backend.kernels = "auto"
    eager = dataclasses.replace(backend.options, inner="eager", epilogues_to_inductor=None)
    assert (eager.inner, eager.kernels, eager.epilogues_to_inductor) == ("eager", "scaled_mm", False)
    with pytest.raises(ValueError, match="fp8fx.backend: inner must be one of inductor, eager, got 'jit'"):
        backend.options.replace(inner="jit")
    with pytest.raises(TypeError, match="cublas_devices must be a tuple of device types"):
        BackendOptions(cublas_devices="cpu")


def test_the_architecture_page_draws_the_pipeline_from_the_stages():
    """docs/architecture.md's pipeline table lists every stage and its passes in `STAGES`'s order."""
    import re
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    table = page.split("## The compile pipeline on one screen")[1].split("\n## ")[0]
    rows = re.findall(r"^\| (`\w+`)?[^|]*\| `(\w+)` \|", table, re.MULTILINE)
    listed, stage = [], None
    for stage_cell, name in rows:
        stage = stage_cell.strip("`") or stage
        listed.append((stage, name))
    assert listed == [(s.name, p.__name__) for s in pipeline.STAGES for p in s.passes]
