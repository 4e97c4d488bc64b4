"""Matrix weights that no compiled graph read, by the module that owns them, and why.

Their products ran outside fp8fx, in high precision (eager code Dynamo skipped, a loop over
data-dependent indices such as `transformers`' `eager` experts), so no FP8 share counts them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn

from fp8fx.reporting.op_record import repeated_site

# Modules whose weight is read by a gather, not a matmul: not reading it in a graph loses no GEMM.
_LOOKUPS = (nn.Embedding, nn.EmbeddingBag)

EAGER_EXPERTS = (
    "transformers' eager experts loop runs outside the graph (its loop over the experts the routing hit is data-dependent)"
)
EAGER_EXPERTS_FIX = 'set experts_implementation="grouped_mm" so fp8fx runs them as FP8 grouped GEMMs'
UNKNOWN = (
    "their products ran outside fp8fx in high precision (eager code or a loop Dynamo does not trace), or the module has not run"
)


@dataclass(frozen=True)
class Uncaptured:
    """A module whose matrix weights no compiled graph read."""

    module: str  # FQN of the module that owns them
    kind: str  # its class
    weights: tuple[str, ...]  # their FQNs
    cause: str
    fix: str | None = None

    def renamed(self, prefix: str, new_prefix: str) -> Uncaptured:
        """The same finding in a copy of a block (`layers.0` -> `layers.3`)."""

        def swap(name: str) -> str:
            return new_prefix + name[len(prefix) :] if name == prefix or name.startswith(prefix + ".") else name

        return replace(self, module=swap(self.module), weights=tuple(swap(w) for w in self.weights))

    def text(self, copies: int = 1) -> str:
        """`model.layers.*.mlp.experts (MixtralExperts) x2: 2 weight parameters never read ...`"""
        n = len(self.weights)
        name = (repeated_site(self.module) if copies > 1 else self.module) or "<root>"  # weights of the model itself
        each = " each" if copies > 1 else ""
        text = (
            f"{name} ({self.kind}){f' x{copies}' if copies > 1 else ''}: {n} weight parameter{'s' * (n > 1)}{each} "
            f"never read by a compiled graph: {self.cause}"
        )
        return text + (f"; {self.fix}" if self.fix else "")


def _is_matrix(shape) -> bool:
    return sum(d > 1 for d in shape) >= 2  # a (1, 1, D) token or a norm's (D,) scale is read elementwise


def eager_experts(module: nn.Module) -> bool:
    """Whether `module` is `transformers`' experts running their `eager` loop: it keeps its model's
    config, and its expert matrices as its own parameters."""
    config = getattr(module, "config", None)
    own = module.parameters(recurse=False)
    return getattr(config, "_experts_implementation", None) == "eager" and any(_is_matrix(p.shape) for p in own)


def _cause(module: nn.Module) -> tuple[str, str | None]:
    return (EAGER_EXPERTS, EAGER_EXPERTS_FIX) if eager_experts(module) else (UNKNOWN, None)


def find_uncaptured(model: nn.Module, read: Callable[[str, nn.Parameter], bool]) -> list[Uncaptured]:
    """The modules of `model` owning matrix weights for which `read(name, parameter)` is False.

    A weight tied to an embedding counts under a module that multiplies by it (a tied LM head);
    one only an embedding owns is skipped."""
    owners: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
        params[id(p)] = p
    found: dict[str, list[str]] = {}
    for key, names in owners.items():
        p = params[key]
        users = [n for n in names if not isinstance(model.get_submodule(n.rpartition(".")[0]), _LOOKUPS)]
        if users and _is_matrix(p.shape) and not read(users[0], p):
            found.setdefault(users[0].rpartition(".")[0], []).append(users[0])
    out = []
    for module_name, weights in found.items():
        module = model.get_submodule(module_name)
        out.append(Uncaptured(module_name, type(module).__name__, tuple(weights), *_cause(module)))
    return out


def grouped(found: list[Uncaptured]) -> list[tuple[Uncaptured, int]]:
    """Findings alike but for their block number, once each with their count."""
    groups: dict[tuple, list[Uncaptured]] = {}
    for u in found:
        key = (repeated_site(u.module), u.kind, tuple(w.rpartition(".")[2] for w in u.weights), u.cause, u.fix)
        groups.setdefault(key, []).append(u)
    return [(members[0], len(members)) for members in groups.values()]
