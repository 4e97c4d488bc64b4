"""The policy example in README.md is a valid policy that means what its comments say."""

import re
from pathlib import Path

from fp8fx import policy_from_yaml


def test_readme_policy_example_loads():
    text = (Path(__file__).parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL) if b.startswith("version: 1"))
    policy = policy_from_yaml(block, "README.md")
    assert policy.recipe == "tensorwise" and len(policy.rules) == 3 and policy.shadow.patience == 3 and policy.level.value == "O2"
    res = policy.resolve(("layers.0.mlp.up",), "mm")
    assert res.settings.granularity.value == "rowwise" and res.settings.gemms["grad_weight"].value == "high"
    assert policy.resolve(("blocks.0:bmm#0",), "bmm").forced_fp8


ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The Markdown outside fenced code blocks (a `#` or `[x](y)` in code is not a heading or link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6} +(.+?) *$", _prose(page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_relative_links_point_to_existing_files_and_headings():
    broken = []
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path) if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    readme = _prose((ROOT / "README.md").read_text())
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(readme) if t.startswith("docs/")}
    assert PAGES[1:], "docs/ holds no pages"
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


def test_readme_lists_every_backend_option():
    """The README's `fp8fx.backend(...)` block names exactly the options `BackendOptions` has."""
    from dataclasses import fields

    from fp8fx.passes.options import BackendOptions

    text = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if b.startswith("fp8fx.backend("))
    named = re.findall(r"^(?:fp8fx\.backend\()?\s*(\w+)=", block, re.MULTILINE)
    assert sorted(named) == sorted(f.name for f in fields(BackendOptions))
