"""Command-line arguments of nemo-d3s-convert that argparse itself must refuse."""

from __future__ import annotations

import pytest

from nemo_d3s.convert.__main__ import build_parser


@pytest.mark.parametrize("atol", ["-1", "nan", "inf", "abc"])
def test_verify_refuses_a_tolerance_that_is_not_a_number_ge_0(atol, capsys):
    """--atol -1 used to print MISMATCH with a maximum error of 0."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["verify", "--hf", "a", "--ckpt", "b", "--atol", atol])
    assert e.value.code == 2
    assert f"argument --atol: {atol!r} is not a tolerance >= 0" in capsys.readouterr().err


def test_verify_accepts_zero_and_the_default():
    assert (
        build_parser().parse_args(["verify", "--hf", "a", "--ckpt", "b", "--atol", "0"]).atol == 0.0
    )
    assert build_parser().parse_args(["verify", "--hf", "a", "--ckpt", "b"]).atol == 1e-4
