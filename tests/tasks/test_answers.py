"""Answer extraction and math equivalence (hand-worked cases)."""

import threading

import pytest

from nemo_d3s.tasks.answers import (
    extract_answer,
    extract_boxed,
    extract_tagged,
    last_number,
    normalize_number,
)
from nemo_d3s.tasks.verifier import numbers_equal, verify_math


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the sum is 12.\nAnswer: 12", "12"),
        ("Answer: **42**.", "42"),
        ("Final answer: $-7$", "-7"),
        ("answer:\n\n  19", "19"),
        ("The result is \\boxed{8}. Answer: 9", "8"),  # boxed wins over the tag
        ("5-3 = 2", "2"),  # "5-3" is not "-3"
        ("x = -4", "-4"),
        ("I had 1,234 apples", "1234"),
        ("Answer: 4.0", "4"),
        ("Answer: +05", "5"),
        ("first 3 then 4", "4"),  # no tag: the last number
        ("Answer: 3 + 4 = 7", "7"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_number(text, expected):
    assert extract_answer(text, "number") == expected


@pytest.mark.parametrize(
    "text, kind, expected",
    [
        ("Answer: 94*4 - 61 - 6", "text", "94*4 - 61 - 6"),
        ("let me think\n\n76 - 6 - 22\n", "text", "76 - 6 - 22"),  # untagged: last line
        ("so \\boxed{\\frac{1}{2}}", "math", "\\frac{1}{2}"),
        ("\\boxed{\\left(1, \\frac{\\pi}{2}\\right)}", "math", "\\left(1, \\frac{\\pi}{2}\\right)"),
        ("it is 17 apples", "math", "17"),
        ("nothing", "math", None),
    ],
)
def test_extract_text_and_math(text, kind, expected):
    assert extract_answer(text, kind) == expected


def test_boxed_nesting_unclosed_and_last():
    assert extract_boxed("\\boxed{1} and \\boxed{\\sqrt{\\frac{a}{b}}}") == "\\sqrt{\\frac{a}{b}}"
    assert extract_boxed("\\boxed{12") is None
    assert extract_boxed("\\fbox{3}") == "3"
    assert extract_tagged("no tag") is None


def test_number_helpers():
    assert last_number("-1,200.5 and 3") == "3"
    assert last_number("total -1,200.5") == "-1200.5"
    assert normalize_number("+04.50") == "4.5" and normalize_number("-0") == "0"
    assert normalize_number("abc") is None and normalize_number(None) is None
    with pytest.raises(ValueError, match="kind"):
        extract_answer("1", "float")


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("1/2", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac{3}{4}", "0.75"),
        ("1,000", "1000"),
        ("42.0", "42"),
        ("50%", "50"),
        ("x+1", "1+x"),
        ("2x", "x*2"),
        ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),
        ("(1,2)", "(1, 2)"),
        ("$12$", "12"),
    ],
)
def test_verify_math_equivalent(pred, gold):
    assert verify_math(pred, gold)


@pytest.mark.parametrize(
    "pred, gold",
    [("3", "4"), ("0.51", "0.5"), ("x+2", "x+1"), ("abc", "4"), (None, "4"), ("", "4")],
)
def test_verify_math_different(pred, gold):
    assert not verify_math(pred, gold)


def test_numbers_equal_only_decides_plain_numbers():
    assert numbers_equal("3/4", "0.75") is True and numbers_equal("2", "3") is False
    assert numbers_equal("x", "1") is None


@pytest.mark.parametrize(
    "a, b, equal",
    [
        # integers exactly: 1e-6 x 1000001 = 1.000001 >= 1 accepted the neighbour
        ("1000001", "1000000", False),
        ("12000001", "12000000", False),
        ("1,000,000", "1000000.0", True),
        # rounded decimals of a fraction: |1/3 - 0.333333| = 1/3e6 = 3.3e-7 <= 1e-6
        ("0.333333", "1/3", True),
        ("2/3", "0.666667", True),
        ("1000000.333333", "3000001/3", True),  # 3.3e-7 <= min(1.000000333, 1e-4)
        # 1e-6 x 123456.79 = 0.12 would accept the other cent; the 1e-4 ceiling does not
        ("123456.78", "123456.79", False),
        ("1000000.5", "1000001", False),
        ("0.3333", "1/3", False),  # 3.3e-5 > 1e-6
    ],
)
def test_numbers_equal_hand_worked(a, b, equal):
    assert numbers_equal(a, b) is equal and numbers_equal(b, a) is equal
    assert verify_math(a, b) is equal


def test_verify_math_off_the_main_thread():
    # math-verify's signal-based timeout cannot run in worker threads; we must still verify.
    out = []
    t = threading.Thread(
        target=lambda: out.append((verify_math("\\frac{1}{2}", "0.5"), verify_math("x+1", "1+x")))
    )
    t.start()
    t.join()
    assert out == [(True, True)]
