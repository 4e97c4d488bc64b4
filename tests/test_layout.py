"""Import direction between packages, read from the source with `ast` (nothing is imported):
`fp8fx.core` imports nothing else of fp8fx; `fp8fx.codegen` imports only `fp8fx.core` and itself;
every `fp8fx::` operator is defined in `fp8fx.ops`."""

from __future__ import annotations

import ast
import re
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
