"""Run the passes in order; a failure names the pass and those that ran before it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import fx

from fp8fx.passes.assign_precision import assign_precision
from fp8fx.passes.find_matmuls import find_matmuls
from fp8fx.passes.fuse_epilogues import fuse_epilogues
from fp8fx.passes.graph_utils import PassContext, PassResult
from fp8fx.passes.insert_casts import insert_casts
from fp8fx.passes.insert_probes import insert_probes
from fp8fx.passes.lower_patch_convs import lower_patch_convs
from fp8fx.passes.saved_outputs import saved_outputs
from fp8fx.passes.verify import verify

Pass = Callable[[fx.GraphModule, PassContext], PassResult]

ANALYSIS_PASSES: tuple[Pass, ...] = (find_matmuls, assign_precision)
REWRITE_PASSES: tuple[Pass, ...] = (
    lower_patch_convs, *ANALYSIS_PASSES, insert_probes, insert_casts, fuse_epilogues, saved_outputs, verify
)  # fmt: skip


class PassError(RuntimeError):
    pass


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass] = REWRITE_PASSES) -> fx.GraphModule:
    done: list[str] = []
    for p in passes:
        try:
            gm = p(gm, ctx).graph_module
        except Exception as e:
            after = f" (after {', '.join(done)})" if done else ""
            raise PassError(f"fp8fx pass {p.__name__} failed{after}: {type(e).__name__}: {e}") from e
        done.append(p.__name__)
    return gm
