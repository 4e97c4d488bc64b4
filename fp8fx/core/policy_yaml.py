"""The YAML form of a policy: strict decoding that names the file, line and key path of every
error (`load_policy`, `policy_from_yaml`), and `as_policy` for the APIs that take a policy, a
path or nothing."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from fp8fx.core.policy import Policy, PolicyError, Rule, SavedActivations, SavedRule, Settings, Shadow, recipe_settings

_TOP_KEYS = {"version", "recipe", "defaults", "rules", "shadow", "level", "calibrate", "saved_activations"}
_SAVED_KEYS = {f.name for f in fields(SavedActivations)}
_SAVED_RULE_KEYS = {f.name for f in fields(SavedRule)}
_SHADOW_KEYS = {f.name for f in fields(Shadow)}
_SETTINGS_KEYS = {f.name for f in fields(Settings)}
_RULE_KEYS = {f.name for f in fields(Rule)}


def as_policy(policy: Policy | str | Path | None, caller: str) -> Policy:
    """A `Policy` from what an API accepts: a Policy, a path to a YAML file, or None (the defaults)."""
    if policy is None:
        return Policy()
    if isinstance(policy, (str, Path)):
        return load_policy(policy)
    if not isinstance(policy, Policy):
        raise TypeError(f"{caller}: policy must be a Policy, a path to a YAML file or None, got {type(policy).__name__}")
    return policy


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy YAML file; raises `PolicyError` naming file, line and key path."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PolicyError("<file>", f"cannot read policy file: {e.strerror}", str(path)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise PolicyError("<file>", f"not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start}", str(path), line) from None
    return policy_from_yaml(text, source=str(path))


def policy_from_yaml(text: str, source: str = "<policy>") -> Policy:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        raise PolicyError("<yaml>", f"not valid YAML: {problem}", source, mark.line + 1 if mark else None) from None
    if root is None:
        raise PolicyError("<root>", "the policy file is empty; it needs at least `version: 1`", source)
    return _Decoder(source).policy(root)


class _Decoder:
    """Walks the YAML node tree (not the plain data) so every error can name its line."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, node: yaml.Node, key_path: str, message: str) -> PolicyError:
        return PolicyError(key_path, message, self.source, node.start_mark.line + 1)

    def value(self, node: yaml.Node) -> Any:
        return yaml.safe_load(yaml.serialize(node))

    def mapping(self, node: yaml.Node, key_path: str, allowed: set[str]) -> dict[str, yaml.Node]:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, key_path, f"expected a mapping, got {_kind(node)}")
        out: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = self.value(key_node)
            child = f"{key_path}.{key}" if key_path != "<root>" else str(key)
            if key not in allowed:
                raise self.fail(key_node, child, f"unknown key; expected one of {', '.join(sorted(allowed))}")
            if key in out:
                raise self.fail(key_node, child, "key given twice")
            out[key] = value_node
        return out

    def checked(self, node: yaml.Node, key_path: str, build):
        """Run a dataclass constructor, re-raising its PolicyError with this node's path and line."""
        try:
            return build()
        except PolicyError as e:
            path = e.key_path if key_path == "<root>" else f"{key_path}.{e.key_path}"
            raise self.fail(_node_at(node, e.key_path), path, e.message) from None

    def check_keys(self, node: yaml.Node, key_path: str) -> None:
        """Every mapping key in the file is a plain name (YAML allows lists and mappings as keys)."""
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    raise self.fail(key_node, key_path, f"keys must be plain names, got {_kind(key_node)} as a key")
                self.check_keys(value_node, key_node.value if key_path == "<root>" else f"{key_path}.{key_node.value}")
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.check_keys(item, f"{key_path}[{i}]")

    def policy(self, root: yaml.Node) -> Policy:
        self.check_keys(root, "<root>")
        self.root = root
        top = self.mapping(root, "<root>", _TOP_KEYS)
        if "version" not in top:
            raise self.fail(root, "version", "missing; write `version: 1` at the top of the file")
        version = self.value(top["version"])
        if type(version) is not int or version != 1:
            raise self.fail(top["version"], "version", f"expected 1, got {version!r}")
        recipe = None
        if "recipe" in top:
            recipe = self.value(top["recipe"])
            self.checked(top["recipe"], "<root>", lambda: recipe_settings(recipe))
        defaults = self.settings(top.get("defaults"), "defaults", recipe)
        rules: list[Rule] = []
        if "rules" in top:
            rules_node = top["rules"]
            if not isinstance(rules_node, yaml.SequenceNode):
                raise self.fail(rules_node, "rules", f"expected a list of rules, got {_kind(rules_node)}")
            for i, rule_node in enumerate(rules_node.value):
                rules.append(self.rule(rule_node, f"rules[{i}]"))
        shadow = None
        if "shadow" in top:
            items = self.mapping(top["shadow"], "shadow", _SHADOW_KEYS)
            shadow = self.checked(top["shadow"], "shadow", lambda: Shadow(**{k: self.value(v) for k, v in items.items()}))
        level = self.value(top["level"]) if "level" in top else None
        calibrate = self.value(top["calibrate"]) if "calibrate" in top else False
        saved = self.saved_activations(top["saved_activations"]) if "saved_activations" in top else SavedActivations()
        return self.checked(
            root,
            "<root>",
            lambda: Policy(
                defaults=defaults,
                rules=tuple(rules),
                source=self.source,
                recipe=recipe,
                shadow=shadow,
                level=level,
                calibrate=calibrate,
                saved_activations=saved,
            ),
        )

    def settings(self, node: yaml.Node | None, key_path: str, recipe: str | None) -> Settings:
        """`defaults`: the recipe's settings (if any), with the keys given here on top."""
        items = self.mapping(node, key_path, _SETTINGS_KEYS) if node is not None else {}
        kwargs = {k: self.value(v) for k, v in items.items()}
        node = node if node is not None else self.root
        if recipe is None:
            return self.checked(node, key_path, lambda: Settings(**kwargs))
        return self.checked(node, key_path, lambda: recipe_settings(recipe, **kwargs))

    def saved_activations(self, node: yaml.Node) -> SavedActivations:
        items = self.mapping(node, "saved_activations", _SAVED_KEYS)
        kwargs = {k: self.value(v) for k, v in items.items() if k != "rules"}
        rules = []
        if "rules" in items:
            if not isinstance(items["rules"], yaml.SequenceNode):
                raise self.fail(
                    items["rules"], "saved_activations.rules", f"expected a list of rules, got {_kind(items['rules'])}"
                )
            for i, rule_node in enumerate(items["rules"].value):
                key_path = f"saved_activations.rules[{i}]"
                rule_items = self.mapping(rule_node, key_path, _SAVED_RULE_KEYS)
                if "match" not in rule_items:
                    raise self.fail(rule_node, f"{key_path}.match", "missing; every rule needs a `match` glob or 're:' regex")
                rule_kwargs = {k: self.value(v) for k, v in rule_items.items()}
                rules.append(self.checked(rule_node, key_path, lambda kw=rule_kwargs: SavedRule(**kw)))
        return self.checked(node, "saved_activations", lambda: SavedActivations(**kwargs, rules=tuple(rules)))

    def rule(self, node: yaml.Node, key_path: str) -> Rule:
        items = self.mapping(node, key_path, _RULE_KEYS)
        if "match" not in items:
            raise self.fail(node, f"{key_path}.match", "missing; every rule needs a `match` glob or 're:' regex")
        kwargs = {k: self.value(v) for k, v in items.items()}
        return self.checked(node, key_path, lambda: Rule(**kwargs))


def _node_at(node: yaml.Node, key_path: str) -> yaml.Node:
    """The deepest node along `key_path` ("gemms.bogus", "ops[1]") that exists, for its line."""
    for part in re.findall(r"[^.\[\]]+", key_path):
        if isinstance(node, yaml.MappingNode):
            child = next((v for k, v in node.value if k.value == part), None)
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            child = node.value[int(part)]
        else:
            child = None
        if child is None:
            break
        node = child
    return node


def _kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.ScalarNode):
        return f"{node.value!r}"
    return "a list" if isinstance(node, yaml.SequenceNode) else "a mapping"
