"""GenerationWait (distributed/generation_wait.py) and agreed_generation on gloo ranks: a rank
waits for the others' generations on the job's store with a liveness check instead of one
collective limited by the group's timeout. A generation longer than that timeout passes while
its rank beats; a rank that neither finishes nor beats (its engine dead, its process stopped)
fails the others after the timeout; a live rank that never finishes fails them after the
generation-scaled limit; every rank learns every rank's outcome; a failure raises on all."""

from __future__ import annotations

import time

import pytest
import torch.distributed

from _launch import run_ranks
from _limits import WAIT_S

from nemo_d3s.distributed.generation_wait import GenerationWait, Outcome, generation_limit_s


def _wait(name, base_s):
    return GenerationWait.of_group(name, None, base_s)


def _outcomes(rank):
    """Three generations: the last rank's first one lasts 4x the timeout (it beats); the
    flags of each generation reach every rank; the store keeps no key of finished ones."""
    from nemo_d3s.backends.base import GenerationInterrupted
    from nemo_d3s.backends.engine_wait import agreed_generation

    wait = _wait("t", base_s=1.0)
    out = []
    for gen in range(3):

        def call():
            if rank == 2 and gen == 0:
                time.sleep(4.0)
            if rank == 1 and gen == 1:
                raise GenerationInterrupted("cut")
            return f"rollouts {rank}.{gen}"

        result, outcome = agreed_generation(
            wait, lambda: True, call, stopping=(rank == 0 and gen == 2), limit_s=60.0
        )
        out.append((result, (outcome.stopping, outcome.interrupted, outcome.failed)))
    store = wait.store
    left = [store.check([f"{wait.prefix}/0/{k}"]) for k in ("flags", "arrived", "open")]
    # rank 0 hosts the store: a rank still polling it (a waiter's last read after the open
    # key appeared) fails if rank 0 has already returned and its process ended
    torch.distributed.barrier()
    return out, left


def test_every_rank_waits_out_a_long_generation_and_learns_every_outcome():
    results = run_ranks(_outcomes, 3, megatron=False, timeout=WAIT_S)
    for rank, (out, left) in enumerate(results):
        assert [Outcome(*o) for _, o in out] == [
            Outcome(),
            Outcome(interrupted=True),
            Outcome(stopping=True),
        ]
        assert out[0][0] == f"rollouts {rank}.0" and out[2][0] == f"rollouts {rank}.2"
        assert out[1][0] == (None if rank == 1 else f"rollouts {rank}.1")
        assert left == [False, False, False]  # removed when the next generation opened


def _stalled(rank, how):
    """Rank 1's generation outlives the others' patience: its engine is dead (no beats),
    or it beats but never finishes within the limit, or it fails."""
    from nemo_d3s.backends.engine_wait import agreed_generation
    from nemo_d3s.distributed.generation_wait import GenerationTimeout

    wait = _wait(how, base_s=1.5)
    alive = (lambda: False) if (rank == 1 and how == "dead") else (lambda: True)

    def call():
        if rank == 1:
            if how == "fails":
                raise ValueError("the engine refused a prompt")
            time.sleep(8.0)
        return "ok"

    try:
        agreed_generation(wait, alive, call, stopping=False, limit_s=3.0)
        result = "passed"
    except (GenerationTimeout, ValueError, RuntimeError) as e:
        result = f"{type(e).__name__}: {e}"
    torch.distributed.barrier()  # rank 0 holds the store: it stays until every rank decided
    return result


@pytest.mark.parametrize("how", ["dead", "hung", "fails"])
def test_a_rank_that_stops_answering_or_fails_fails_the_others(how):
    results = run_ranks(_stalled, 3, how, megatron=False, timeout=WAIT_S)
    others = [results[0], results[2]]
    if how == "dead":
        # the last rank still generating shows no life: the group's timeout, not the limit
        assert all("GenerationTimeout" in r and "neither finished nor beat" in r for r in others)
        assert all("1 of 3 ranks" in r for r in others), results
    elif how == "hung":
        assert all("GenerationTimeout" in r and "still generating after 3 s" in r for r in others)
    else:
        assert results[1] == "ValueError: the engine refused a prompt"
        assert all(
            r.startswith("RuntimeError: the generation failed on 1 other rank") for r in others
        )


def test_one_process_waits_for_nobody_and_the_limit_grows_with_the_generation():
    wait = GenerationWait("one", 1, 0, 60.0)
    assert wait.store is None
    assert wait.agree(stopping=True, interrupted=False, failed=True, limit_s=0) == Outcome(
        stopping=True, failed=1
    )
    # 128 rollouts x 15360 new tokens (the 70B long recipe's engine) at the floor rate
    assert generation_limit_s(1800, 128, 15360) == 1800 + 128 * 15360 / 80
    assert Outcome.of(3 + (2 << 20) + (1 << 40)) == Outcome(True, True, 1)


def _group_wait(rank):
    import datetime

    group = torch.distributed.new_group([0, 1], timeout=datetime.timedelta(seconds=123))
    try:
        GenerationWait.of_group("w", None)  # the world's wait: no group to read a timeout of
        refused = ""
    except ValueError as e:
        refused = str(e)
    return GenerationWait.of_group("g", group).base_s, refused


def test_a_groups_wait_defaults_to_that_groups_own_timeout():
    for base_s, refused in run_ranks(_group_wait, 2, megatron=False, timeout=WAIT_S):
        assert base_s == 123.0 and "needs base_s" in refused
