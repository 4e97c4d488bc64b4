"""fp8fx: FP8 training and inference for PyTorch as a `torch.compile` backend.

    compiled = torch.compile(model, backend="fp8fx")
    compiled = torch.compile(model, backend=fp8fx.backend(policy="policy.yaml", inner="eager"))
    print(fp8fx.report(compiled))
"""

from fp8fx.compiler.backend import Fp8fxBackend, backend, report, stats
from fp8fx.compiler.prepare import prepare
from fp8fx.core.formats import FormatRecipe, Fp8Format
from fp8fx.core.policy import FastAccum, GemmPrecisions, Policy, PolicyError, Rule, SavedActivations, SavedRule, Settings
from fp8fx.core.policy_yaml import load_policy, policy_from_yaml
from fp8fx.core.recipes import Precision
from fp8fx.core.version import VERSION as __version__
from fp8fx.reporting.op_record import OpRecord
from fp8fx.reporting.records import Report
from fp8fx.tools.analyze import CoverageError, ModelFileError, analyze, assert_coverage, load_model_file
from fp8fx.tools.export import ExportError, ExportResult, export_onnx

__all__ = [
    "CoverageError",
    "ExportError",
    "ExportResult",
    "export_onnx",
    "ModelFileError",
    "analyze",
    "assert_coverage",
    "load_model_file",
    "Fp8Format",
    "Fp8fxBackend",
    "FormatRecipe",
    "FastAccum",
    "GemmPrecisions",
    "OpRecord",
    "Policy",
    "PolicyError",
    "Precision",
    "Report",
    "Rule",
    "SavedActivations",
    "SavedRule",
    "Settings",
    "backend",
    "load_policy",
    "policy_from_yaml",
    "prepare",
    "report",
    "stats",
]
