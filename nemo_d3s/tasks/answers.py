"""Pulling the final answer out of a free-form model response: the last ``\\boxed{...}``, else the
text after the last "Answer:" tag, else by the expected kind: ``"number"`` the last number,
``"math"`` the segment as written (math-verify compares it) or the last number, ``"text"`` the last
non-empty line."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Optional

ANSWER_KINDS = ("number", "math", "text")

# A minus sign only counts when it does not follow a word/number/bracket ("5-3" is not
# "-3"); thousands separators only in groups of three ("1,000" but not "3,4").
_NUMBER = re.compile(r"(?:(?<![\w)\].])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_TAG = re.compile(r"(?:final\s+)?answer\s*(?:is)?\s*[:=]", re.IGNORECASE)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (nested braces respected), or None."""
    starts = [m.end() for m in _BOX.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def extract_tagged(text: str) -> Optional[str]:
    """The rest of the line after the last "Answer:" ("Final answer:", "answer is:", ...),
    or the next non-empty line when the tag ends its line; None without a tag."""
    matches = list(_TAG.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :]
    for line in rest.splitlines():
        cleaned = clean_segment(line)
        if cleaned:
            return cleaned
    return None


def clean_segment(segment: str) -> str:
    """Strip markdown emphasis, code ticks, TeX math delimiters and trailing punctuation."""
    s = segment
    for delim in ("\\(", "\\)", "\\[", "\\]"):
        s = s.replace(delim, " ")
    # Twice, so "**42**." and "$42$." both come out as "42".
    for _ in range(2):
        s = s.strip().strip("*`$").strip().rstrip(".,;")
    return s.strip()


def last_number(text: str) -> Optional[str]:
    """The last number in ``text`` with thousands separators removed, e.g. "-1,200.5" ->
    "-1200.5"; None when there is none."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def normalize_number(s: Optional[str]) -> Optional[str]:
    """Canonical text of a number: "+04.50" -> "4.5", "-0" -> "0", "1,000" -> "1000";
    None when ``s`` is not a number."""
    if s is None:
        return None
    try:
        d = Decimal(s.strip().replace(",", ""))
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_answer(text: str, kind: str = "number") -> Optional[str]:
    """The final answer in ``text`` as a string (see the module docstring), or None."""
    if kind not in ANSWER_KINDS:
        raise ValueError(f"kind must be one of {ANSWER_KINDS}, got {kind!r}")
    if text is None:
        return None
    boxed = extract_boxed(text)
    segment = clean_segment(boxed) if boxed is not None else extract_tagged(text)
    if kind == "number":
        num = last_number(segment) if segment else None
        return normalize_number(num if num is not None else last_number(text))
    if segment:
        return segment
    if kind == "math":
        return last_number(text)
    lines = [clean_segment(line) for line in text.splitlines()]
    lines = [line for line in lines if line]
    return lines[-1] if lines else None
