"""The gloo rank launcher itself: results in rank order, a failing rank's error reaches
the caller, a hanging rank is killed at the timeout, set-up runs before the function, a run
whose gloo mesh failed to connect starts again once."""

import pytest
import torch
import torch.distributed as dist

from nemo_d3s.distributed.launch import run_on_gloo_ranks


def _sum_of_ranks(rank, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world": dist.get_world_size(), "sum": float(t) * scale}


def _fail_on_rank_1(rank):
    if rank == 1:
        raise ArithmeticError("rank 1 fails on purpose")
    return rank


def _hang_on_rank_0(rank):
    if rank == 0:
        import time

        time.sleep(60)
    return rank


def _setup(rank, tag):
    import os

    os.environ["NEMO_D3S_TEST_SETUP"] = f"{tag}{rank}"


def _read_setup(rank):
    import os

    return os.environ.get("NEMO_D3S_TEST_SETUP")


def test_results_come_back_in_rank_order():
    out = run_on_gloo_ranks(_sum_of_ranks, 3, 2.0, start_method="spawn")
    assert out == [{"rank": r, "world": 3, "sum": 6.0} for r in range(3)]  # (0 + 1 + 2) x 2


def test_rank_setup_runs_before_the_function():
    assert run_on_gloo_ranks(
        _read_setup, 2, rank_setup=_setup, setup_args=("r",), start_method="spawn"
    ) == ["r0", "r1"]


def test_a_failing_rank_raises_in_the_caller():
    with pytest.raises(Exception, match="rank 1 fails on purpose"):
        run_on_gloo_ranks(_fail_on_rank_1, 2, start_method="spawn")


def test_a_hanging_rank_times_out():
    with pytest.raises(TimeoutError, match="took over"):
        run_on_gloo_ranks(_hang_on_rank_0, 2, timeout=8, start_method="spawn")


def test_bad_arguments():
    with pytest.raises(ValueError, match="module-level"):
        run_on_gloo_ranks(lambda r: r, 2)
    with pytest.raises(ValueError, match="world_size"):
        run_on_gloo_ranks(_read_setup, 0)


def _return_opaque(rank):
    import fractions

    # picklable, but not plain data: loading it would make the unpickler import and call a class
    return {"rank": rank, "obj": fractions.Fraction(1, 3)}


def _return_nested(rank):
    return {"rank": rank, "t": torch.full((2,), float(rank)), "meta": [("a", 1.5, None, True)]}


def test_results_are_read_back_without_running_code():
    # plain data (tensors, numbers, strings, None, containers) comes back as it was
    out = run_on_gloo_ranks(_return_nested, 2)
    assert out[1]["meta"] == [("a", 1.5, None, True)] and torch.equal(out[1]["t"], torch.ones(2))
    # anything else is refused by torch.load(weights_only=True), naming the function and the rank
    with pytest.raises(
        TypeError, match=r"_return_opaque: rank 0.s result is not plain data.*Fraction"
    ):
        run_on_gloo_ranks(_return_opaque, 2)


def test_a_port_taken_after_it_was_chosen_does_not_stop_the_ranks(monkeypatch):
    """Seen under CI: the launcher chose a free port, another process took it, and rank 0's
    store failed to bind (EADDRINUSE). The ranks now join a store the launcher binds itself
    (port 0): with the old way's port held by someone else, the run still works."""
    import socket

    from nemo_d3s.distributed import launch

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        monkeypatch.setattr(launch, "free_port", lambda: taken.getsockname()[1])
        out = run_on_gloo_ranks(_sum_of_ranks, 2, 1.0, timeout=60)
    assert [r["sum"] for r in out] == [1.0, 1.0]


def _mesh_fails_once(rank, folder, message):
    """Rank 1 raises ``message`` on the first attempt (a marker file counts the attempts)."""
    import os

    marker = os.path.join(folder, f"attempt{rank}")
    attempts = int(open(marker).read()) + 1 if os.path.exists(marker) else 1
    with open(marker, "w") as f:
        f.write(str(attempts))
    if rank == 1 and attempts == 1:
        raise RuntimeError(message)
    return attempts


def test_a_gloo_mesh_that_fails_to_connect_is_started_again_once(tmp_path):
    mesh = "[enforce fail at gloo/transport/tcp/pair.cc] connectFullMesh: Connection closed by peer"
    with pytest.warns(UserWarning, match="failed to connect, starting them again"):
        out = run_on_gloo_ranks(_mesh_fails_once, 2, str(tmp_path), mesh, start_method="spawn")
    assert out == [2, 2]  # the second attempt's results
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(Exception, match="some other failure"):  # not retried
        run_on_gloo_ranks(
            _mesh_fails_once, 2, str(other), "some other failure", start_method="spawn"
        )
    assert (other / "attempt1").read_text() == "1"
