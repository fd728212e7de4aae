"""docs/faults.md stays in sync with the tests: every table row names at least one test, and
every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "faults.md"
_REF = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")


def _rows():
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] not in ("fault tried", "---"):
            yield cells


def test_every_fault_row_names_an_existing_test():
    rows = list(_rows())
    assert len(rows) >= 25
    for fault, _what, tests in rows:
        refs = _REF.findall(tests)
        assert refs, f"row {fault!r} names no test"
        for path, name in refs:
            src = REPO / path
            assert src.is_file(), f"row {fault!r}: {path} does not exist"
            assert re.search(rf"^def {name}\(", src.read_text(), re.M), (
                f"row {fault!r}: {path} has no {name}"
            )


def test_readme_says_its_numbers_come_from_one_machine():
    text = (REPO / "README.md").read_text()
    assert "These numbers come from one machine" in text
