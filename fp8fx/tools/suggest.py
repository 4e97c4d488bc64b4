"""A policy suggested from an analysis: keep high the GEMMs FP8 would slow down (predicted on a
target GPU) or hurt (SQNR below a threshold, measured on calibration data).

The suggestion is the analysed policy with one rule per flagged site (or per group of repeated
blocks flagged alike) put first, each copying the rule that matched the site before, so the sites
it names keep all their other settings. Analysing with the suggested policy reproduces the
decisions: flagged GEMMs high, every other GEMM as before."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, replace

import yaml

from fp8fx.core.policy import Policy, Rule
from fp8fx.core.recipes import Precision
from fp8fx.reporting.op_record import OpRecord, repeated_site
from fp8fx.reporting.records import Report

DEFAULT_MIN_SQNR_DB = 18.0  # below this a GEMM's FP8 result is noisier than training tolerates well


@dataclass
class Flag:
    op: OpRecord
    why: str


def _flags(report: Report, min_sqnr_db: float | None) -> dict[str, list[Flag]]:
    """Site -> its FP8 GEMMs to keep high, with the reason for each."""
    flagged: dict[str, list[Flag]] = {}
    for op in report.fp8_ops:
        reasons = []
        if op.slower:
            p = op.predicted
            reasons.append(
                f"{op.role} predicted {p.speedup:.2f}x on {report.target.name} ({p.fp8_us:.1f} us in FP8 vs "
                f"{p.bf16_us:.1f} us in BF16)"
            )
        sqnr = op.numerics.sqnr_db if op.numerics else None
        if min_sqnr_db is not None and sqnr is not None and sqnr < min_sqnr_db:
            reasons.append(f"{op.role} SQNR {sqnr:.1f} dB < {min_sqnr_db:g} dB")
        if reasons:
            flagged.setdefault(op.site, []).append(Flag(op, "; ".join(reasons)))
    return flagged


def _exact(site: str) -> str:
    return "re:" + re.escape(site) if any(c in site for c in "*?[") else site


def suggest_policy(
    report: Report, policy: Policy | None = None, min_sqnr_db: float | None = DEFAULT_MIN_SQNR_DB
) -> tuple[str, int]:
    """A commented policy YAML keeping the flagged GEMMs high, and the number of rules added.

    `report` comes from `fp8fx.analyze` with `policy`, with predictions (`Report.with_predictions`)
    and/or numerics (its `calibration`); `min_sqnr_db=None` ignores numerics."""
    basis = []
    if report.target is not None:
        basis.append(f"predicted times on {report.target.name} (kept high where FP8 is predicted slower than BF16)")
    if min_sqnr_db is not None and any(op.numerics for op in report.ops):
        basis.append(f"numerics measured on calibration data (kept high where SQNR < {min_sqnr_db:g} dB)")
    header = "from " + (" and ".join(basis) or "the analysis alone (no target or numerics: nothing to flag)")
    return policy_keeping_high(
        report.ops, _flags(report, min_sqnr_db), policy or Policy(), "fp8fx analyze --suggest-policy", header
    )


def policy_keeping_high(
    ops: list[OpRecord], flagged: dict[str, list[Flag]], policy: Policy, made_by: str, basis: str
) -> tuple[str, int]:
    """`policy` with rules, first, keeping the flagged GEMMs of each site high (see the module
    docstring), as commented YAML; and the number of rules added."""
    sites = {op.site: op for op in ops}
    roles_of = {site: {f.op.role for f in flags} for site, flags in flagged.items()}
    added: list[tuple[Rule, list[str]]] = []
    done: set[str] = set()
    for site, flags in flagged.items():
        if site in done:
            continue
        op = flags[0].op
        base = policy.resolve((op.site, op.fqn) if op.fqn != op.site else (op.site,), op.op).rule_index
        pattern = repeated_site(site)  # one rule for a site repeated across blocks
        group = [s for s in sites if fnmatch.fnmatchcase(s, pattern)]
        alike = all(
            roles_of.get(s) == roles_of[site]
            and policy.resolve((s, sites[s].fqn) if sites[s].fqn != s else (s,), sites[s].op).rule_index == base
            for s in group
        )
        match, members = (pattern, group) if alike and len(group) > 1 else (_exact(site), [site])
        done.update(members)
        template = policy.rules[base] if base is not None else Rule(match=match)
        gemms = {**(template.gemms or {}), **{role: Precision.HIGH for role in roles_of[site]}}
        rule = replace(template, match=match, gemms=gemms)
        why = [f"{site}: {f.why}" for f in flags]
        if len(members) > 1:
            why.append(f"(and the same in {len(members) - 1} more block(s) matching {match!r})")
        if base is not None:
            why.append(f"other settings copied from rules[{base}] ({policy.rules[base].match!r}), which matched before")
        added.append((rule, why))
    suggested = Policy(policy.defaults, (*(r for r, _ in added), *policy.rules), recipe=policy.recipe, shadow=policy.shadow)
    return _yaml(suggested, added, made_by, basis), len(added)


def _yaml(policy: Policy, added: list[tuple[Rule, list[str]]], made_by: str, basis: str) -> str:
    data = policy.to_dict()
    rules = data.pop("rules")
    shadow = data.pop("shadow", None)
    lines = [
        f"# fp8fx precision policy written by `{made_by}`,",
        f"# {basis}.",
        "# Check it with: fp8fx policy validate FILE; use it with: fp8fx analyze --policy FILE",
        yaml.safe_dump(data, sort_keys=False).rstrip(),
        "rules:" + (" []" if not rules else ""),
    ]
    for i, rule in enumerate(rules):
        if i < len(added):
            lines += [f"  # {line}" for line in added[i][1]]
        elif i == len(added):
            lines.append("  # the analysed policy's own rules")
        lines.append(_indent(yaml.safe_dump([rule], sort_keys=False).rstrip()))
    if shadow is not None:
        lines.append(yaml.safe_dump({"shadow": shadow}, sort_keys=False).rstrip())
    return "\n".join(lines) + "\n"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
