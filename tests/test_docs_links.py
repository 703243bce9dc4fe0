"""README.md and docs/: every relative link resolves, anchors included, and the README stays a
front door (short, every console script in its table, nothing outside the repository)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+).*?\1", re.S)
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\S.*)?$", re.M)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without fenced blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _links(text: str) -> list[str]:
    prose = _prose(text)
    return INLINE_LINK.findall(prose) + REFERENCE_DEF.findall(prose)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = _slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _is_external(target: str) -> bool:
    return re.match(r"^[a-z][a-z0-9+.-]*:", target) is not None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page.read_text()):
        if _is_external(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(
                f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}"
            )
        elif not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {path_part or page.name}")
    assert not broken, (
        f"{page.relative_to(ROOT)} has links that do not resolve (fix the path or the heading, "
        "or link benchmarks/README.md instead of a report that was removed):\n  "
        + "\n  ".join(broken)
    )


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, over {README_MAX_LINES}: move measurements to "
        "benchmarks/ and reasons to docs/, and link them"
    )


def test_readme_lists_every_console_script() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[)", pyproject, re.M | re.S)
    assert section, "pyproject.toml has no [project.scripts] section"
    scripts = re.findall(r"^([\w-]+)\s*=", section.group(1), re.M)
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in scripts if f"| `{name}` |" not in readme]
    assert not missing, (
        f"console scripts missing from README.md's table: {missing}; add a row with their flags"
    )


def test_no_page_points_outside_the_repository() -> None:
    offenders = [
        str(page.relative_to(ROOT)) for page in PAGES if re.search(r"\.\./shared", page.read_text())
    ]
    assert not offenders, f"pages naming ../shared (the project stands alone): {offenders}"
