"""The README and docs/ as a reader meets them: the README stays short and every relative link in
them leads to a file that exists (docs/clusters.md is written alongside the Slurm launcher)."""
from __future__ import annotations

import re

import pytest

from tests.fixtures import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
COMING = {REPO / "docs" / "clusters.md"}  # linked before it is written


def test_the_readme_is_read_in_ten_minutes():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path = (page.parent / target).resolve()
        if not path.exists() and path not in COMING:
            broken.append(target)
    assert not broken, f"{page.name}: links to nothing: {broken}"
