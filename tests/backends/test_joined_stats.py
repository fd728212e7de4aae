"""``wrappers.joined_stats``: the engine stats of rollouts generated in parts (per prompt, per
context-parallel rank) read as one call's, by hand: 2 rows of 10 tokens in 1 s, all finished,
and 6 rows of 12 tokens in 3 s, half finished, are 8 rows of 22 tokens in 4 s."""

from __future__ import annotations

import pytest

from nemo_d3s.backends.wrappers import joined_stats


def _stats(tokens, seconds, rows, finished):
    return {
        "gen_tokens": tokens,
        "gen_seconds": seconds,
        "gen_tokens_per_s": tokens / seconds,
        "response_len_mean": tokens / rows,
        "finished_frac": finished / rows,
    }


def test_counts_add_means_weigh_by_rows_and_the_rate_is_recomputed():
    got = joined_stats([(2, _stats(10, 1.0, 2, 2)), (6, _stats(12, 3.0, 6, 3))])
    assert got == pytest.approx(
        {
            "gen_tokens": 22.0,
            "gen_seconds": 4.0,
            "gen_tokens_per_s": 5.5,  # not 10 + 4
            "response_len_mean": 2.75,  # 22 / 8, not 5 + 2
            "finished_frac": 0.625,  # 5 of 8
        }
    )


def test_one_part_is_itself_and_no_part_is_empty():
    one = _stats(10, 1.0, 2, 1)
    assert joined_stats([(2, one)]) == pytest.approx(one)
    assert joined_stats([]) == {}
