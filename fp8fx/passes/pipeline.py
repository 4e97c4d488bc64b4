"""The FP8 rewrite's passes in order (`REWRITE_PASSES`), and `run_passes`, which runs the passes of
every stage of a compile: a failure names the pass, its stage and those that ran before it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from fp8fx.passes.assign_precision import assign_precision
from fp8fx.passes.find_matmuls import find_matmuls
from fp8fx.passes.fuse_epilogues import fuse_epilogues
from fp8fx.passes.graph_utils import PassContext, PassResult
from fp8fx.passes.insert_casts import insert_casts
from fp8fx.passes.insert_probes import insert_probes
from fp8fx.passes.lower_patch_convs import lower_patch_convs
from fp8fx.passes.prefer_bf16 import prefer_bf16
from fp8fx.passes.saved_outputs import saved_outputs
from fp8fx.passes.verify import verify

Pass = Callable[[fx.GraphModule, PassContext], PassResult]

ANALYSIS_PASSES: tuple[Pass, ...] = (find_matmuls, assign_precision)
REWRITE_PASSES: tuple[Pass, ...] = (
    lower_patch_convs,
    *ANALYSIS_PASSES,
    prefer_bf16,
    insert_probes,
    insert_casts,
    fuse_epilogues,
    saved_outputs,
    verify,
)


class PassError(RuntimeError):
    """A pass failed: the message names the pass, its stage and the passes that ran before it."""


def run_passes(gm: fx.GraphModule, ctx: Any, passes: Sequence[Pass] = REWRITE_PASSES, stage: str = "rewrite") -> fx.GraphModule:
    """Run `passes` on `gm` in order, each given `ctx`; returns the graph module the last one left.

    One convention for every stage of a compile (`fp8fx.compiler.pipeline`): a failure is raised as
    a `PassError` naming the pass, the `stage` and the passes before it; a `PassError` from a stage
    run inside a pass (the FP8 rewrite inside the joint stage) names its own and passes through."""
    done: list[str] = []
    for p in passes:
        try:
            gm = p(gm, ctx).graph_module
        except PassError:
            raise
        except Exception as e:
            after = f" (after {', '.join(done)})" if done else ""
            raise PassError(f"fp8fx pass {p.__name__} failed in stage {stage}{after}: {type(e).__name__}: {e}") from e
        done.append(p.__name__)
    return gm
