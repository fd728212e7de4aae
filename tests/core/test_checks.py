"""``core.checks``' plain-value rules: the one home of "an integer >= k, not a bool" and "a
finite number, not a bool" (the config sections, the tasks, the backends' settings and the
core functions call them; a source scan keeps copies from coming back)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from nemo_d3s.core.checks import check_count, is_count, is_integer, is_number, is_real

PKG = Path(__file__).resolve().parents[2] / "nemo_d3s"


def test_bools_are_not_counts_or_numbers():
    assert not is_integer(True) and not is_count(True, 0) and not is_count(False, 0)
    assert not is_real(True) and not is_number(False)


def test_counts():
    assert is_count(0) and is_count(3, 1) and is_count(np.int64(3), 1)
    assert not is_count(0, 1) and not is_count(2.0, 0) and not is_count("2", 0)
    check_count("k", 0)
    with pytest.raises(ValueError, match=r"k must be an int >= 1, got 0"):
        check_count("k", 0, 1)
    with pytest.raises(ValueError, match=r"k must be an int >= 0, got True"):
        check_count("k", True)


def test_numbers():
    assert is_number(1) and is_number(0.5) and is_number(np.float32(2.0))
    assert is_real(float("inf")) and not is_number(float("inf"))
    assert not is_number(float("nan")) and not is_number("1.0") and not is_number(None)


# formats/ and files.py sit below core/ (they may not import it) and keep their own checks.
_BELOW_CORE = ("formats/", "files.py", "files_staging.py", "errors.py")
_COPY = re.compile(r"isinstance\((\w+(?:\.\w+)?), bool\) or not isinstance\(\1,")


def test_the_not_a_bool_rule_is_not_copied_above_core():
    copies = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        if rel == "core/checks.py" or rel.startswith(_BELOW_CORE):
            continue
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if _COPY.search(line) or re.search(r"not isinstance\(\w+, bool\) and", line):
                copies.append(f"{rel}:{n}")
    assert copies == [], "use nemo_d3s.core.checks.is_count / is_number / is_real"
