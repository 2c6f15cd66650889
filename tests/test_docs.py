"""The docs stay navigable: every relative link resolves, every raw data file is cited, and
docs/results.md stays a short statement of the current state."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    *sorted((ROOT / "docs").rglob("*.md")),
]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def relative_links(doc):
    for target in LINK.findall(doc.read_text()):
        if not re.match(r"[a-z]+:", target):
            yield target


def test_relative_links_resolve():
    broken = [
        f"{doc.relative_to(ROOT)}: {target}"
        for doc in DOCS
        for target in relative_links(doc)
        if not (doc.parent / target).exists()
    ]
    assert not broken


def test_every_data_file_is_cited():
    cited = {
        (doc.parent / target).resolve()
        for doc in DOCS
        for target in relative_links(doc)
    }
    data = ROOT / "docs" / "data"
    uncited = [
        path.name
        for path in sorted(data.iterdir())
        if path.name != "README.md" and path.resolve() not in cited
    ]
    assert not uncited


def test_results_stay_short():
    assert (ROOT / "docs" / "results.md").stat().st_size < 15_000
