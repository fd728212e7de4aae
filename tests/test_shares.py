"""The slow tier's shares (tests/_shares.py, ``--slow-share I/K``): a partition of the slow
tests, balanced by recorded time, the same on every worker and every run."""

import re
from pathlib import Path

import pytest
from _shares import SECONDS_FILE, UNRECORDED_S, load_seconds, parse_share, split
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent


def test_a_hand_worked_split():
    # longest first onto the lightest share: a(10)->0, b(7)->1, c(5)->1 (7 < 10),
    # d(4)->0 (10 < 12); with e (unrecorded: 60 s): e->0, then a, b, c, d all onto share 1
    seconds = {"a": 10, "b": 7, "c": 5, "d": 4}
    assert split(["d", "c", "b", "a"], seconds, 2) == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert split(["a", "b", "c", "d", "e"], seconds, 2) == {"e": 0, "a": 1, "b": 1, "c": 1, "d": 1}
    assert UNRECORDED_S == 60.0
    assert split(["a", "b"], seconds, 1) == {"a": 0, "b": 0}


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.text(min_size=1, max_size=6), st.floats(0, 500), min_size=1, max_size=40),
    st.integers(1, 7),
    st.randoms(use_true_random=False),
)
def test_every_test_is_in_one_share_and_the_shares_are_balanced(seconds, k, rng):
    nodes = list(seconds)
    owner = split(nodes, seconds, k)
    assert set(owner) == set(nodes) and all(0 <= s < k for s in owner.values())
    rng.shuffle(nodes)
    assert split(nodes, seconds, k) == owner  # the order of collection does not matter
    load = [sum(seconds[n] for n in nodes if owner[n] == s) for s in range(k)]
    # greedy list scheduling's bound: no share exceeds the mean by more than one test
    assert max(load) <= sum(load) / k + max(seconds.values()) + 1e-6


@pytest.mark.parametrize("text", ["", "1", "2/2", "-1/3", "a/b", "0/0", "1/2/3"])
def test_a_malformed_share_is_refused_naming_the_rule(text):
    with pytest.raises(ValueError, match="expected I/K with 0 <= I < K"):
        parse_share(text)
    assert parse_share("3/4") == (3, 4)


@pytest.mark.parametrize("body", ["[1, 2]", "{", '{"t::x": -1}', '{"t::x": "9"}', '{"t::x": true}'])
def test_a_malformed_record_is_an_error_naming_the_file(tmp_path, body):
    path = tmp_path / "seconds.json"
    path.write_text(body)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        load_seconds(path)


def test_every_recorded_test_exists():
    """A renamed or removed test leaves no record behind (its time would weigh on no share)."""
    for node in load_seconds():
        path, _, name = node.partition("::")
        function = re.sub(r"\[.*\]$", "", name)
        source = ROOT / path
        assert source.is_file(), f"{SECONDS_FILE.name}: {node}: no file {path}"
        assert f"def {function}(" in source.read_text(), f"{SECONDS_FILE.name}: {node}: no test"


class _Collected:
    """A plugin that keeps the node ids a session selected."""

    def pytest_collection_finish(self, session):
        self.nodes = {item.nodeid for item in session.items}


def _collected(*args):
    """The node ids ``pytest --collect-only ARGS`` selects, collected in this process (a
    nested session, as pytester's inline runs: no second interpreter to start)."""
    grab = _Collected()
    quiet = ["-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:benchmark"]
    rc = pytest.main(["--collect-only", "-q", *quiet, *args], plugins=[grab])
    assert rc in (0, 5), rc  # 5: nothing selected
    return grab.nodes


def test_the_option_runs_one_share_of_the_selected_slow_tests(capsys):
    files = [str(ROOT / "tests/test_examples.py"), str(ROOT / "tests/test_readme.py")]
    slow = _collected("-m", "slow", *files)
    everything = _collected(*files)
    assert len(slow) >= 4 and slow < everything
    seen = set()
    for i in range(3):
        share = _collected("--slow-share", f"{i}/3", *files)
        assert share >= everything - slow  # the tests not marked slow run in every share
        assert not (share & slow & seen)
        seen |= share & slow
    assert seen == slow
    capsys.readouterr()
    assert (
        pytest.main(["--collect-only", "-q", "-p", "no:xdist", "--slow-share", "4/3", files[0]])
        == 4
    )
    assert "expected I/K with 0 <= I < K" in capsys.readouterr().err
