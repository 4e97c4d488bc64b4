"""Graph passes, each `(GraphModule, PassContext) -> PassResult`, run in order by `pipeline`."""

from fp8fx.passes.annotation import Decision, GemmAnnotation, ReasonKind
from fp8fx.passes.assign_precision import assign_precision
from fp8fx.passes.find_matmuls import Gemm, MatmulSite, find_matmuls
from fp8fx.passes.graph_utils import PassContext, PassResult
from fp8fx.passes.insert_casts import insert_casts
from fp8fx.passes.options import BackendOptions
from fp8fx.passes.pipeline import ANALYSIS_PASSES, REWRITE_PASSES, PassError, run_passes
from fp8fx.passes.verify import verify

__all__ = [
    "ANALYSIS_PASSES", "REWRITE_PASSES", "BackendOptions", "Decision", "Gemm", "GemmAnnotation", "MatmulSite", "PassContext",
    "PassError", "PassResult", "ReasonKind", "assign_precision", "find_matmuls", "insert_casts", "run_passes", "verify",
]
