"""Import direction between packages, read from the source with `ast` (nothing is imported):
`fp8fx.core` imports nothing else of fp8fx; `fp8fx.codegen` imports only `fp8fx.core` and itself;
no module imports itself through others, nor a package of a higher layer (`LAYERS`); every
`fp8fx::` operator is defined in `fp8fx.ops`."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "fp8fx"


def fp8fx_imports(path: Path) -> set[str]:
    """Every fp8fx module `path` imports, at any depth (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            if node.module == "fp8fx":  # from fp8fx import core: the submodule
                found |= {f"fp8fx.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
    return {name for name in found if name == "fp8fx" or name.startswith("fp8fx.")}


def allowed(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("package,may_import", [("core", ("fp8fx.core",)), ("codegen", ("fp8fx.core", "fp8fx.codegen"))])
def test_package_imports_only_what_it_builds_on(package, may_import):
    files = sorted((PACKAGE / package).rglob("*.py"))
    assert files
    bad = {
        f"{path.relative_to(PACKAGE.parent)}: {name}"
        for path in files
        for name in fp8fx_imports(path)
        if not allowed(name, may_import)
    }
    assert not bad, "\n".join(sorted(bad))


# The packages from the bottom up (docs/architecture.md): a module imports only packages of its own
# layer or a lower one. Top-level modules count as packages of their own name; "fp8fx" is the
# package's `__init__.py` (the public API) and `__main__.py`.
LAYERS = (
    ("core",),
    ("codegen",),
    ("ops",),
    ("runtime",),
    ("passes",),
    ("reporting",),
    ("compiler",),
    ("tools",),
    ("distributed", "integrations"),
    ("cli",),
    ("fp8fx",),
)
LAYER = {package: i for i, packages in enumerate(LAYERS) for package in packages}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """`fp8fx.passes.verify` -> "passes"; `fp8fx` and `fp8fx.__main__` -> "fp8fx"."""
    parts = module.split(".")
    return "fp8fx" if len(parts) == 1 or parts[1] == "__main__" else parts[1]


def module_imports(path: Path, known: set[str]) -> dict[str, int]:
    """The fp8fx modules `path` imports (`from fp8fx.x import y` names module `fp8fx.x.y` where
    there is one), at any depth, each with the line of its first import."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names]
        else:
            continue
        for name in names:
            while name not in known and "." in name:  # `import fp8fx.x.y` where y is not a module
                name = name.rpartition(".")[0]
            if name in known and name not in found:
                found[name] = node.lineno
    return found


def import_graph() -> dict[str, dict[str, tuple[Path, int]]]:
    """module -> {module it imports: (file, line)} over all of fp8fx, function-level imports included."""
    files = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    known = set(files)
    graph = {}
    for module, path in files.items():
        found = module_imports(path, known)
        graph[module] = {name: (path, line) for name, line in found.items() if name != module}
    return graph


def find_cycle(graph: dict[str, dict]) -> list[str] | None:
    """One import cycle as its path (`a -> b -> a`), or None."""
    done, path, on_path = set(), [], {}

    def visit(module: str) -> list[str] | None:
        on_path[module] = len(path)
        path.append(module)
        for name in sorted(graph[module]):
            if name in on_path:
                return [*path[on_path[name] :], name]
            if name not in done:
                cycle = visit(name)
                if cycle:
                    return cycle
        path.pop()
        del on_path[module]
        done.add(module)
        return None

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for module in sorted(graph):
            if module not in done:
                cycle = visit(module)
                if cycle:
                    return cycle
    finally:
        sys.setrecursionlimit(limit)
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_from_a_higher_layer():
    graph = import_graph()
    assert set(LAYER) >= {package_of(m) for m in graph}, "a package missing from LAYERS"
    up = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {package_of(module)} (layer {LAYER[package_of(module)]}) imports {name} "
        f"({package_of(name)}, layer {LAYER[package_of(name)]})"
        for module, imports in sorted(graph.items())
        for name, (path, line) in sorted(imports.items())
        if LAYER[package_of(name)] > LAYER[package_of(module)]
    ]
    assert not up, "\n".join(up)


def test_every_fp8fx_operator_is_defined_in_ops():
    definition = re.compile(r"""(custom_op|torch\.library\.define|Library)\(\s*["']fp8fx::""")
    outside = [
        str(p.relative_to(PACKAGE.parent))
        for p in PACKAGE.rglob("*.py")
        if definition.search(p.read_text()) and p.parent.name != "ops"
    ]
    assert not outside, outside
    inside = [p.name for p in (PACKAGE / "ops").glob("*.py") if definition.search(p.read_text())]
    assert inside
