"""Every relative link in README.md, docs/*.md and a top-level folder's README.md points to a file of this repository (and a
`#fragment` to a heading of the file it names): nothing points outside the checkout, where a
reader of the repository alone cannot follow it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("*/README.md"))]
FENCE = re.compile(r"^ *```.*?^ *```", flags=re.MULTILINE | re.DOTALL)
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", flags=re.MULTILINE)
CODE_PATH_OUTSIDE = re.compile(r"`(\.\./[^`\s]+)`")  # a path in code that leaves the checkout


def prose(markdown: str) -> str:
    """The document without its fenced code blocks (a shell example is not a link)."""
    return FENCE.sub("", markdown)


def relative_links(markdown: str) -> list[str]:
    text = prose(markdown)
    links = INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)
    return [link for link in links if not re.match(r"^(?:[a-z][a-z0-9+.-]*:|//)", link, flags=re.IGNORECASE)]


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors: the heading lower-cased, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", prose(markdown), flags=re.MULTILINE):
        text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
        anchors.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return anchors


def test_the_link_finder_sees_links_and_skips_urls_and_code() -> None:
    text = ("See [a](docs/A.md#part), ![img](static/x.png \"t\") and [b](https://example.com).\n"
            "[ref]: protocol/README.md\n```bash\ncat [x](not/a/link.md)\n```\n[c](#local)\n")
    assert relative_links(text) == ["docs/A.md#part", "static/x.png", "#local", "protocol/README.md"]
    assert heading_anchors("## Set-up: two commands\n## The `inference` worker\n") == {
        "set-up-two-commands", "the-inference-worker"}


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_into_the_repository(document: Path) -> None:
    markdown = document.read_text(encoding="utf-8")
    broken = []
    for link in relative_links(markdown):
        path_part, _, fragment = link.partition("#")
        target = (document.parent / path_part).resolve() if path_part else document
        if not target.is_relative_to(ROOT):
            broken.append(f"{link}: outside the repository")
        elif not target.exists():
            broken.append(f"{link}: no such file")
        elif fragment and target.suffix == ".md" and fragment not in heading_anchors(target.read_text(encoding="utf-8")):
            broken.append(f"{link}: no heading #{fragment} in {target.relative_to(ROOT)}")
    outside = [path for path in CODE_PATH_OUTSIDE.findall(prose(markdown))
               if not (document.parent / path).resolve().is_relative_to(ROOT)]
    broken += [f"`{path}`: names a file outside the repository" for path in outside]
    assert not broken, f"{document.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_links_the_architecture_document() -> None:
    assert "docs/ARCHITECTURE.md" in relative_links((ROOT / "README.md").read_text(encoding="utf-8"))
