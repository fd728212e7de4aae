"""Math answer equivalence: numbers compared numerically, everything else through the
``math-verify`` package (LaTeX/sympy parsing, numeric and symbolic equality)."""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Optional

from nemo_d3s.tasks.answers import clean_segment, last_number, normalize_number

_REL_TOL = 1e-6
# The relative tolerance's absolute ceiling: 1e-6 of a large answer (12000000 -> 12) would
# accept a neighbouring integer or a different cent, while a decimal rendering of a fraction
# (0.333333 for 1/3: 3.3e-7 off) needs far less.
_ABS_TOL_MAX = 1e-4
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")


def _as_fraction(s: str) -> Optional[Fraction]:
    """A plain number ("1,000", "-2.5", "3/4", "50%") as an exact Fraction, else None. A trailing %
    is dropped, not divided: datasets answer "what percent" with 50, models write 50%."""
    t = s.strip().replace(",", "").replace(" ", "").removesuffix("%").removesuffix("\\%")
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(a: str, b: str) -> Optional[bool]:
    """True/False when both are plain numbers, else None. Two integers ("1,000", "12.0") must be
    equal exactly; otherwise |a - b| <= min(1e-6 x max(1, |a|, |b|), 1e-4): a rounded decimal of
    a fraction matches it (0.333333 and 1/3 are 3.3e-7 apart), numbers a unit, a cent or a
    thousandth apart never do, however large."""
    fa, fb = _as_fraction(a), _as_fraction(b)
    if fa is None or fb is None:
        return None
    if fa.denominator == 1 and fb.denominator == 1:
        return fa == fb
    return abs(fa - fb) <= min(_REL_TOL * max(1, abs(fa), abs(fb)), _ABS_TOL_MAX)


def _math_verify(pred: str, gold: str) -> Optional[bool]:
    """math-verify's verdict, or None when either side does not parse."""
    from math_verify import parse, verify

    # math-verify's timeouts use signal.alarm, which only works on the main thread; off it
    # they would raise, so there we run without a timeout.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None

    def parsed(s: str):
        # Bare expressions like "x+1" only parse as LaTeX inside math delimiters.
        wrapped = s if ("$" in s or "\\boxed" in s) else f"${s}$"
        return parse(wrapped, parsing_timeout=timeout) or parse(s, parsing_timeout=timeout)

    gold_p, pred_p = parsed(gold), parsed(pred)
    if not gold_p or not pred_p:
        return None
    return bool(verify(gold_p, pred_p, timeout_seconds=timeout))


def verify_math(pred: Optional[str], gold: str) -> bool:
    """Is the extracted answer ``pred`` equal to the reference ``gold``? Plain numbers exactly, then
    math-verify (LaTeX, symbolic), then the last numbers of both if a side does not parse."""
    if pred is None or not str(pred).strip():
        return False
    pred, gold = clean_segment(str(pred)), clean_segment(str(gold))
    quick = numbers_equal(pred, gold)
    if quick is not None:
        return quick
    verdict = _math_verify(pred, gold)
    if verdict is not None:
        return verdict
    pn, gn = normalize_number(last_number(pred)), normalize_number(last_number(gold))
    return pn is not None and gn is not None and numbers_equal(pn, gn) is True


def reference_is_checkable(gold: str) -> bool:
    """Can :func:`verify_math` ever score a response correct against this reference? Yes with a
    number or a symbolic expression (``x``, ``\\pi``, a choice letter); no for words
    (``seventy-two``, ``\\text{Monday}``), which math-verify reads as products of symbols no answer
    equals. Cheap (no sympy)."""
    g = clean_segment(str(gold))
    if not g:
        return False
    if any(ch.isdigit() for ch in g):
        return True
    return _WORD.search(_LATEX_COMMAND.sub(" ", g)) is None
