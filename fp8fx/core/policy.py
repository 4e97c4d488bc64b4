"""Precision policy: frozen dataclasses, strict YAML decoding, rule resolution.

A policy says, per matmul site, whether each of its three GEMMs (output, grad_input,
grad_weight) runs in FP8 and how. Rules are ordered; the first rule whose `match` (module-FQN
glob, or `re:` regex) and `op` fit a site wins; what a rule leaves unset comes from `defaults`.
Every value is checked where it is given: a YAML file error names the file, line and key path.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from fp8fx.core.formats import FormatRecipe, Fp8Format
from fp8fx.core.patterns import POLICY_KINDS
from fp8fx.core.recipes import (
    GEMM_ROLES,
    RECIPES,
    AmaxComputeAlgo,
    Granularity,
    Hadamard,
    Level,
    Precision,
    ScaleRounding,
    Scaling,
)

# TransformerEngine's names for the same three GEMMs.
TE_GEMM_ALIASES = {"fprop": "output", "dgrad": "grad_input", "wgrad": "grad_weight"}
OP_KINDS = POLICY_KINDS  # the op kinds `ops` and rules can name


class PolicyError(ValueError):
    """A policy value is wrong. `key_path` names it (`rules[2].format`); `line` is 1-based."""

    def __init__(self, key_path: str, message: str, source: str | None = None, line: int | None = None):
        self.key_path, self.message, self.source, self.line = key_path, message, source, line
        where = f"{source}:{line}: " if source and line else (f"{source}: " if source else "")
        super().__init__(f"{where}{key_path}: {message}")


def _enum(enum_type: type[Enum], value: Any, key_path: str) -> Any:
    if isinstance(value, enum_type):
        return value
    allowed = "|".join(e.value for e in enum_type)
    if isinstance(value, str):
        for spelling in (value.lower(), value.upper()):  # levels are upper case (O1), everything else lower
            try:
                return enum_type(spelling)
            except ValueError:
                pass
    raise PolicyError(key_path, f"expected {allowed}, got {value!r}")


@dataclass(frozen=True)
class GemmPrecisions:
    """Precision of each of a site's GEMMs (TE's `override_linear_precision`, inverted)."""

    output: Precision = Precision.FP8
    grad_input: Precision = Precision.FP8
    grad_weight: Precision = Precision.FP8

    def __post_init__(self) -> None:
        for role in GEMM_ROLES:
            object.__setattr__(self, role, _enum(Precision, getattr(self, role), f"gemms.{role}"))

    def __getitem__(self, role: str) -> Precision:
        return getattr(self, role)


@dataclass(frozen=True)
class FastAccum:
    """Per GEMM, whether Hopper's FP8 tensor cores keep the whole K loop in their reduced-precision
    accumulator (fast) or promote partial sums to fp32 every 128 of K (TE's split accumulator).
    TransformerEngine's defaults: fast for fprop, promoted for dgrad and wgrad (whose K, for wgrad
    the token count, is long). `torch._scaled_mm`'s `use_fast_accum`."""

    output: bool = True
    grad_input: bool = False
    grad_weight: bool = False

    def __post_init__(self) -> None:
        for role in GEMM_ROLES:
            _bool(getattr(self, role), f"fast_accum.{role}")

    def __getitem__(self, role: str) -> bool:
        return getattr(self, role)


@dataclass(frozen=True)
class Settings:
    """How FP8 GEMMs run, and which op kinds run in FP8 without a rule saying so."""

    format: FormatRecipe = FormatRecipe.HYBRID
    scaling: Scaling = Scaling.DYNAMIC
    granularity: Granularity = Granularity.TENSORWISE
    gemms: GemmPrecisions = field(default_factory=GemmPrecisions)
    # Batched matmuls (attention scores and values) multiply two activations; like TE and
    # DeepSeek-V3 we keep them high unless a rule turns them on. Grouped GEMMs (MoE experts) are
    # the linears of their layers, in FP8 like them.
    ops: tuple[str, ...] = ("mm", "addmm", "grouped_mm")
    power_of_two_scales: bool = False  # round scales down to powers of two (torchao's rowwise default)
    margin: int = 0  # scale = fp8_max / amax / 2**margin
    # delayed scaling only (TE's DelayedScaling knobs):
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = AmaxComputeAlgo.MAX
    interval: int = 1  # recompute the scale every `interval` steps
    fast_accum: FastAccum = field(default_factory=FastAccum)
    # granularity mx only: how the E8M0 block scales are rounded (floor|rceil; rceil when not given)
    scale_rounding: ScaleRounding | None = None
    # granularity nvfp4 only (TE's NVFP4 defaults when not given: true, wgrad): round gradients
    # (grad_output operands) to E2M1 stochastically; which GEMMs' operands take the Hadamard transform
    stochastic_rounding: bool | None = None
    hadamard: Hadamard | None = None

    def __post_init__(self) -> None:
        _bool(self.power_of_two_scales, "power_of_two_scales")
        _int(self.margin, "margin", 0, MAX_MARGIN)
        _int(self.amax_history_len, "amax_history_len", 1, MAX_AMAX_HISTORY)
        _int(self.interval, "interval", 1, MAX_INTERVAL)
        object.__setattr__(self, "amax_compute_algo", _enum(AmaxComputeAlgo, self.amax_compute_algo, "amax_compute_algo"))
        object.__setattr__(self, "format", _enum(FormatRecipe, self.format, "format"))
        object.__setattr__(self, "scaling", _enum(Scaling, self.scaling, "scaling"))
        object.__setattr__(self, "granularity", _enum(Granularity, self.granularity, "granularity"))
        object.__setattr__(self, "ops", _op_kinds(self.ops, "ops"))
        if isinstance(self.gemms, dict):
            object.__setattr__(self, "gemms", GemmPrecisions(**_gemm_overrides(self.gemms, "gemms")))
        elif not isinstance(self.gemms, GemmPrecisions):
            raise PolicyError("gemms", f"expected a mapping of {'|'.join(GEMM_ROLES)} to fp8|high, got {self.gemms!r}")
        if isinstance(self.fast_accum, dict):
            object.__setattr__(self, "fast_accum", FastAccum(**_fast_accum_overrides(self.fast_accum, "fast_accum")))
        elif not isinstance(self.fast_accum, FastAccum):
            raise PolicyError(
                "fast_accum", f"expected a mapping of {'|'.join(GEMM_ROLES)} to true|false, got {self.fast_accum!r}"
            )
        if self.scaling is Scaling.DELAYED and self.granularity is not Granularity.TENSORWISE:
            raise PolicyError(
                "scaling",
                f"delayed scaling keeps one scale per tensor; it needs granularity tensorwise, not {self.granularity.value}",
            )
        if self.scale_rounding is not None:
            object.__setattr__(self, "scale_rounding", _enum(ScaleRounding, self.scale_rounding, "scale_rounding"))
            if self.granularity is not Granularity.MX:
                raise PolicyError(
                    "scale_rounding", f"rounds MX's E8M0 block scales; it needs granularity mx, not {self.granularity.value}"
                )
        if self.granularity is Granularity.MX:
            if self.scale_rounding is None:
                object.__setattr__(self, "scale_rounding", ScaleRounding.RCEIL)
            if self.margin:
                raise PolicyError("margin", f"MX's E8M0 scales take no margin (granularity mx), got {self.margin}")
        self._check_nvfp4()

    def _check_nvfp4(self) -> None:
        """NVFP4 is a format and a granularity at once: both or neither; its own keys only with it."""
        nvfp4 = self.granularity is Granularity.NVFP4
        if (self.format is FormatRecipe.NVFP4) != nvfp4:
            key, value = ("format", self.format.value) if nvfp4 else ("granularity", self.granularity.value)
            raise PolicyError(key, f"NVFP4 needs format nvfp4 with granularity nvfp4 (or recipe: nvfp4), got {key} {value}")
        if self.stochastic_rounding is not None:
            _bool(self.stochastic_rounding, "stochastic_rounding")
        if self.hadamard is not None:
            object.__setattr__(self, "hadamard", _enum(Hadamard, self.hadamard, "hadamard"))
        for key in ("stochastic_rounding", "hadamard"):
            if getattr(self, key) is not None and not nvfp4:
                raise PolicyError(key, f"applies to NVFP4 casts; it needs granularity nvfp4, not {self.granularity.value}")
        if not nvfp4:
            return
        if self.stochastic_rounding is None:
            object.__setattr__(self, "stochastic_rounding", True)
        if self.hadamard is None:
            object.__setattr__(self, "hadamard", Hadamard.WGRAD)
        if self.margin:
            raise PolicyError("margin", f"NVFP4's scales take no margin (granularity nvfp4), got {self.margin}")
        if self.power_of_two_scales:
            raise PolicyError(
                "power_of_two_scales", "NVFP4's block scales are E4M3 values, not powers of two (granularity nvfp4)"
            )


# Bounds that keep every setting meaningful: a margin past 32 only underflows scales, a history is
# kept per FP8 tensor (4 bytes an entry), and a step counter is int64 on the device.
MAX_MARGIN = 32
MAX_AMAX_HISTORY = 1 << 16
MAX_INTERVAL = 2**31 - 1


def _int(value: Any, key_path: str, minimum: int, maximum: int | None = None) -> None:
    if type(value) is not int or value < minimum or (maximum is not None and value > maximum):
        wanted = f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"
        raise PolicyError(key_path, f"expected {wanted}, got {value!r}")


def _bool(value: Any, key_path: str) -> None:
    if not isinstance(value, bool):
        raise PolicyError(key_path, f"expected true or false, got {value!r}")


def _op_kinds(value: Any, key_path: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise PolicyError(key_path, f"expected an op kind or a non-empty list of them ({'|'.join(OP_KINDS)}), got {value!r}")
    for i, op in enumerate(items):
        if op not in OP_KINDS:
            raise PolicyError(f"{key_path}[{i}]", f"expected {'|'.join(OP_KINDS)}, got {op!r}")
    return tuple(items)


def _name_matches(pattern: str, names: tuple[str, ...]) -> bool:
    """A module-FQN glob, or an `re:` regex, against any of `names`."""
    if pattern.startswith("re:"):
        return any(re.fullmatch(pattern[3:], n) for n in names)
    return any(fnmatch.fnmatchcase(n, pattern) for n in names)


def _check_match(pattern: Any) -> None:
    if not isinstance(pattern, str) or not pattern:
        raise PolicyError("match", f"expected a non-empty glob or 're:' regex, got {pattern!r}")
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as e:
            raise PolicyError("match", f"invalid regex {pattern[3:]!r}: {e}") from None


@dataclass(frozen=True)
class Rule:
    """Settings for the sites whose name or module FQN matches `match` (and whose op is in `op`).

    `precision: high` keeps all three GEMMs high; `precision: fp8` makes the site eligible even
    if its op kind is not in `defaults.ops`; `gemms` sets single GEMMs. Unset fields inherit."""

    match: str
    op: tuple[str, ...] | None = None
    precision: Precision | None = None
    format: FormatRecipe | None = None
    gemms: dict[str, Precision] | None = None
    fast_accum: dict[str, bool] | None = None
    granularity: Granularity | None = None
    power_of_two_scales: bool | None = None
    scaling: Scaling | None = None
    margin: int | None = None
    amax_history_len: int | None = None
    amax_compute_algo: AmaxComputeAlgo | None = None
    interval: int | None = None
    scale_rounding: ScaleRounding | None = None
    stochastic_rounding: bool | None = None
    hadamard: Hadamard | None = None

    def __post_init__(self) -> None:
        # The Settings a rule sets are checked by building Settings from them (and again, merged
        # with the defaults, by the Policy). A rule may set scale_rounding alone for mx defaults,
        # and the NVFP4 keys alone for nvfp4 defaults.
        given = {name: getattr(self, name) for name in _RULE_SETTINGS if getattr(self, name) is not None}
        base = Settings()
        if "scale_rounding" in given and "granularity" not in given:
            base = Settings(granularity=Granularity.MX)
        elif given.keys() & {"stochastic_rounding", "hadamard", "format", "granularity"} and _mentions_nvfp4(given):
            base = Settings(format=FormatRecipe.NVFP4, granularity=Granularity.NVFP4)
        checked = replace(base, **given)
        for name in given:
            object.__setattr__(self, name, getattr(checked, name))
        _check_match(self.match)
        if self.op is not None:
            object.__setattr__(self, "op", _op_kinds(self.op, "op"))
        if self.precision is not None:
            object.__setattr__(self, "precision", _enum(Precision, self.precision, "precision"))
        if self.gemms is not None:
            object.__setattr__(self, "gemms", _gemm_overrides(self.gemms, "gemms"))
        if self.fast_accum is not None:
            object.__setattr__(self, "fast_accum", _fast_accum_overrides(self.fast_accum, "fast_accum"))

    def matches(self, names: tuple[str, ...], op: str) -> bool:
        if self.op is not None and op not in self.op:
            return False
        return _name_matches(self.match, names)


def _mentions_nvfp4(given: dict[str, Any]) -> bool:
    """Whether a rule's settings are NVFP4 ones (checked alone on nvfp4 defaults)."""
    if "stochastic_rounding" in given or "hadamard" in given:
        return True
    return any(str(getattr(given.get(key), "value", given.get(key))).lower() == "nvfp4" for key in ("format", "granularity"))


def _gemm_overrides(value: Any, key_path: str) -> dict[str, Precision]:
    return _per_gemm(value, key_path, "fp8|high", lambda v, where: _enum(Precision, v, where))


def _per_gemm(value: Any, key_path: str, values: str, convert) -> dict[str, Any]:
    """A `{GEMM: value}` mapping of a policy (TE's names fprop/dgrad/wgrad accepted), each value
    checked by `convert(value, key path)`."""
    if not isinstance(value, dict) or not value:
        raise PolicyError(key_path, f"expected a mapping of {'|'.join(GEMM_ROLES)} to {values}, got {value!r}")
    return {_role_of(key, key_path): convert(v, f"{key_path}.{key}") for key, v in value.items()}


def _role_of(key: Any, key_path: str) -> str:
    role = TE_GEMM_ALIASES.get(key, key)
    if role not in GEMM_ROLES:
        names = "|".join(GEMM_ROLES + tuple(TE_GEMM_ALIASES))
        raise PolicyError(f"{key_path}.{key}", f"unknown GEMM {key!r}; expected {names}")
    return role


def _fast_accum_overrides(value: Any, key_path: str) -> dict[str, bool]:
    def checked(fast: Any, where: str) -> bool:
        _bool(fast, where)
        return fast

    return _per_gemm(value, key_path, "true|false", checked)


# Settings a rule may set directly (all but `gemms` and `fast_accum`, which merge, and `ops`).
_RULE_SETTINGS = (
    "format",
    "granularity",
    "power_of_two_scales",
    "scaling",
    "margin",
    "amax_history_len",
    "amax_compute_algo",
    "interval",
    "scale_rounding",
    "stochastic_rounding",
    "hadamard",
)


def recipe_settings(name: str, **overrides: Any) -> Settings:
    """The `Settings` a named recipe expands to, with `overrides` applied on top."""
    if not isinstance(name, str) or name not in RECIPES:
        raise PolicyError("recipe", f"unknown recipe {name!r}; expected one of {', '.join(RECIPES)}")
    settings = {**RECIPES[name], **overrides}
    if isinstance(overrides.get("gemms"), dict) and "gemms" in RECIPES[name]:  # merge, do not replace
        settings["gemms"] = {**RECIPES[name]["gemms"], **overrides["gemms"]}
    return Settings(**settings)


@dataclass(frozen=True)
class Resolution:
    """A policy's answer for one site: its settings and where they came from."""

    settings: Settings
    rule_index: int | None  # None: defaults
    forced_fp8: bool  # a rule said `precision: fp8`
    gemm_sources: dict[str, str]  # role -> "defaults.gemms.output" / "rules[1].gemms.grad_weight" / ...

    @property
    def source(self) -> str:
        return "defaults" if self.rule_index is None else f"rules[{self.rule_index}]"


@dataclass(frozen=True)
class Shadow:
    """Shadow high-precision checks: every `every` calls, each FP8 GEMM is also computed in high
    precision on the same inputs; a GEMM whose output SQNR stays below `tolerance_db` for
    `patience` consecutive checks is switched to high precision (a recompile)."""

    every: int = 100
    tolerance_db: float = 20.0
    patience: int = 3

    def __post_init__(self) -> None:
        _int(self.every, "every", 1)
        _int(self.patience, "patience", 1)
        if (
            isinstance(self.tolerance_db, bool)
            or not isinstance(self.tolerance_db, (int, float))
            or not math.isfinite(self.tolerance_db)
        ):
            raise PolicyError("tolerance_db", f"expected a number of decibels, got {self.tolerance_db!r}")


class SavedGranularity(str, Enum):
    """The scales of an activation kept in FP8 for backward: one per row (of the last dimension), or
    one per group of 128 along it (1x128, DeepSeek-V3's activation blocks)."""

    ROWWISE = "rowwise"
    GROUP_1X128 = "1x128"


SAVED_BLOCKS = {SavedGranularity.ROWWISE: (1, 0), SavedGranularity.GROUP_1X128: (1, 128)}  # fp8fx.core.scaling blocks
# What forward made a saved tensor for, by what reads it (fp8fx.passes.saved_activations.classify).
SAVED_KINDS = ("attention", "norm", "activation", "other")


def _saved_format(value: Any) -> Fp8Format:
    fmt = _enum(Fp8Format, value, "format")
    if fmt is Fp8Format.NVFP4:
        raise PolicyError("format", "saved activations are kept in e4m3 or e5m2, not nvfp4")
    return fmt


@dataclass(frozen=True)
class SavedRule:
    """How the saved tensors of the modules `match` names (and of the kinds in `kind`) are kept."""

    match: str
    kind: tuple[str, ...] | None = None
    precision: Precision | None = None
    format: Fp8Format | None = None
    granularity: SavedGranularity | None = None

    def __post_init__(self) -> None:
        _check_match(self.match)
        if self.format is not None:
            object.__setattr__(self, "format", _saved_format(self.format))
        if self.kind is not None:
            kinds = [self.kind] if isinstance(self.kind, str) else self.kind
            if not isinstance(kinds, (list, tuple)) or not kinds:
                raise PolicyError(
                    "kind", f"expected a kind or a non-empty list of them ({'|'.join(SAVED_KINDS)}), got {self.kind!r}"
                )
            for i, kind in enumerate(kinds):
                if kind not in SAVED_KINDS:
                    raise PolicyError(f"kind[{i}]", f"expected {'|'.join(SAVED_KINDS)}, got {kind!r}")
            object.__setattr__(self, "kind", tuple(kinds))
        if self.precision is not None:
            object.__setattr__(self, "precision", _enum(Precision, self.precision, "precision"))
        if self.granularity is not None:
            object.__setattr__(self, "granularity", _enum(SavedGranularity, self.granularity, "granularity"))


@dataclass(frozen=True)
class SavedActivations:
    """What forward keeps for backward besides FP8 GEMM operands (fp8fx.passes.saved_activations):
    in FP8 (`format`, with `granularity` scales) or in the precision it was made in. `precision`
    None takes the backend option `saved_activations` (high by default). Rules: first match wins,
    by module FQN and kind."""

    precision: Precision | None = None
    format: Fp8Format = Fp8Format.E4M3
    granularity: SavedGranularity = SavedGranularity.ROWWISE
    rules: tuple[SavedRule, ...] = ()

    def __post_init__(self) -> None:
        if self.precision is not None:
            object.__setattr__(self, "precision", _enum(Precision, self.precision, "precision"))
        object.__setattr__(self, "format", _saved_format(self.format))
        object.__setattr__(self, "granularity", _enum(SavedGranularity, self.granularity, "granularity"))
        object.__setattr__(self, "rules", tuple(self.rules))
        for i, rule in enumerate(self.rules):
            if not isinstance(rule, SavedRule):
                raise PolicyError(f"rules[{i}]", f"expected a SavedRule, got {type(rule).__name__}")

    def resolve(self, module: str, kind: str, default: Precision) -> tuple[Precision, Fp8Format, SavedGranularity, str]:
        """Precision, format, granularity and the policy entry they come from, for a tensor of
        `module` and `kind`."""
        base = self.precision or default
        for i, rule in enumerate(self.rules):
            if _name_matches(rule.match, (module,)) and (rule.kind is None or kind in rule.kind):
                source = f"saved_activations.rules[{i}] (match {rule.match!r})"
                return rule.precision or base, rule.format or self.format, rule.granularity or self.granularity, source
        return base, self.format, self.granularity, "saved_activations" if self.precision else "saved_activations default"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.format.value, "granularity": self.granularity.value}
        if self.precision is not None:
            out["precision"] = self.precision.value
        out["rules"] = [
            {
                "match": r.match,
                **({"kind": list(r.kind)} if r.kind else {}),
                **({"precision": r.precision.value} if r.precision else {}),
                **({"format": r.format.value} if r.format else {}),
                **({"granularity": r.granularity.value} if r.granularity else {}),
            }
            for r in self.rules
        ]
        return out


@dataclass(frozen=True)
class Policy:
    """A full precision policy. Build it in Python or load it with `load_policy`."""

    defaults: Settings = field(default_factory=Settings)
    rules: tuple[Rule, ...] = ()
    source: str | None = None  # file it came from, for messages
    recipe: str | None = None  # the named recipe `defaults` was built from, if any
    shadow: Shadow | None = None  # shadow high-precision checks (off: None)
    level: Level | None = None  # MS-AMP precision level for data-parallel training (off: None)
    # Delayed scaling: whether a graph compiled without autograd (evaluation, torch.no_grad) records
    # amaxes and updates the scales too (a calibration run). Off, it reads them only, as
    # TransformerEngine updates them only with grad enabled, so evaluating does not move training.
    calibrate: bool = False
    saved_activations: SavedActivations = field(default_factory=SavedActivations)

    @classmethod
    def from_recipe(cls, name: str, rules: tuple[Rule, ...] = (), calibrate: bool = False, **overrides: Any) -> Policy:
        """`Policy.from_recipe("rowwise", rules=(...,))`: a recipe's defaults, plus rules."""
        return cls(defaults=recipe_settings(name, **overrides), rules=rules, recipe=name, calibrate=calibrate)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        _bool(self.calibrate, "calibrate")
        if not isinstance(self.saved_activations, SavedActivations):
            raise PolicyError("saved_activations", f"expected SavedActivations, got {type(self.saved_activations).__name__}")
        if self.level is not None:
            object.__setattr__(self, "level", _enum(Level, self.level, "level"))
        for i, rule in enumerate(self.rules):
            if not isinstance(rule, Rule):
                raise PolicyError(f"rules[{i}]", f"expected a Rule, got {type(rule).__name__}")
            try:  # the rule on top of the defaults must make sense too (delayed needs tensorwise, ...)
                self._apply(rule, i)
            except PolicyError as e:
                raise PolicyError(f"rules[{i}].{e.key_path}", e.message) from None
        if self.calibrate and not self.uses_delayed_scaling:
            raise PolicyError(
                "calibrate", "true needs delayed scaling (scaling: delayed), the only scaling that keeps scales between steps"
            )

    @property
    def uses_delayed_scaling(self) -> bool:
        return self.defaults.scaling is Scaling.DELAYED or any(r.scaling is Scaling.DELAYED for r in self.rules)

    def describe(self, res: Resolution) -> str:
        """Where a resolution came from, for reasons: "defaults" or "rules[1] (match 'lm_head')"."""
        return res.source if res.rule_index is None else f"{res.source} (match {self.rules[res.rule_index].match!r})"

    def resolve(self, names: tuple[str, ...], op: str) -> Resolution:
        """Settings for a site known by `names` (site name, module FQN) with op kind `op`."""
        for index, rule in enumerate(self.rules):
            if rule.matches(names, op):
                return self._apply(rule, index)
        sources = {role: f"defaults.gemms.{role}" for role in GEMM_ROLES}
        return Resolution(self.defaults, None, False, sources)

    def _apply(self, rule: Rule, index: int) -> Resolution:
        where = f"rules[{index}]"
        gemms = {role: self.defaults.gemms[role] for role in GEMM_ROLES}
        sources = {role: f"defaults.gemms.{role}" for role in GEMM_ROLES}
        if rule.precision is not None:
            gemms = {role: rule.precision for role in GEMM_ROLES}
            sources = {role: f"{where}.precision" for role in GEMM_ROLES}
        for role, prec in (rule.gemms or {}).items():
            gemms[role] = prec
            sources[role] = f"{where}.gemms.{role}"
        overrides = {name: getattr(rule, name) for name in _RULE_SETTINGS if getattr(rule, name) is not None}
        if overrides.get("granularity", Granularity.MX) is not Granularity.MX and "scale_rounding" not in overrides:
            overrides["scale_rounding"] = None  # the defaults' MX rounding does not carry to another granularity
        if overrides.get("granularity", Granularity.NVFP4) is not Granularity.NVFP4:
            for key in ("stochastic_rounding", "hadamard"):  # nor the NVFP4 keys to a granularity without them
                overrides.setdefault(key, None)
        fast_accum = replace(self.defaults.fast_accum, **(rule.fast_accum or {}))
        settings = replace(self.defaults, gemms=GemmPrecisions(**gemms), fast_accum=fast_accum, **overrides)
        return Resolution(settings, index, rule.precision is Precision.FP8, sources)

    def to_dict(self) -> dict[str, Any]:
        d = self.defaults
        out: dict[str, Any] = {"version": 1}
        if self.recipe:
            out["recipe"] = self.recipe
        out["defaults"] = {
            "format": d.format.value,
            "scaling": d.scaling.value,
            "granularity": d.granularity.value,
            "ops": list(d.ops),
            "gemms": {role: d.gemms[role].value for role in GEMM_ROLES},
            "fast_accum": {role: d.fast_accum[role] for role in GEMM_ROLES},
            "power_of_two_scales": d.power_of_two_scales,
            "margin": d.margin,
            "amax_history_len": d.amax_history_len,
            "amax_compute_algo": d.amax_compute_algo.value,
            "interval": d.interval,
        }
        if d.scale_rounding is not None:
            out["defaults"]["scale_rounding"] = d.scale_rounding.value
        if d.stochastic_rounding is not None:
            out["defaults"]["stochastic_rounding"] = d.stochastic_rounding
        if d.hadamard is not None:
            out["defaults"]["hadamard"] = d.hadamard.value
        out["rules"] = []
        for rule in self.rules:
            r: dict[str, Any] = {"match": rule.match}
            if rule.op is not None:
                r["op"] = list(rule.op)
            if rule.precision is not None:
                r["precision"] = rule.precision.value
            if rule.format is not None:
                r["format"] = rule.format.value
            if rule.gemms is not None:
                r["gemms"] = {k: v.value for k, v in rule.gemms.items()}
            if rule.fast_accum is not None:
                r["fast_accum"] = dict(rule.fast_accum)
            for name in _RULE_SETTINGS:
                value = getattr(rule, name)
                if value is not None:
                    r[name] = value.value if isinstance(value, Enum) else value
            out["rules"].append(r)
        if self.shadow is not None:
            out["shadow"] = {
                "every": self.shadow.every,
                "tolerance_db": self.shadow.tolerance_db,
                "patience": self.shadow.patience,
            }
        if self.level is not None:
            out["level"] = self.level.value
        if self.calibrate:
            out["calibrate"] = True
        if self.saved_activations != SavedActivations():
            out["saved_activations"] = self.saved_activations.to_dict()
        return out


# ---------------------------------------------------------------- YAML decoding
