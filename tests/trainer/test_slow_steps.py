"""The slow-step rule (issue 35, point 4) with injected step times and load: no warning while
steps are steady, one when a step takes ``factor`` x the median of the first steps while the
load average is above the CPU count, never twice. No clock is read here."""

from __future__ import annotations

import pytest

from nemo_d3s.trainer.slow_steps import Machine, SlowStepWatch, should_warn, suggested_threads


def _warn(times, load=5.0, cpus=2, *, baseline=3, factor=3.0, warned=False):
    return should_warn(
        times, load, cpus, baseline_steps=baseline, factor=factor, already_warned=warned
    )


def test_steady_steps_never_warn_even_on_a_loaded_machine():
    assert not any(_warn([22.0, 21.0, 23.0, 22.5, 24.0][: i + 1]) for i in range(5))


def test_a_step_k_times_the_median_of_the_first_steps_on_a_loaded_machine_warns():
    # median(30, 20, 22) = 22; 3 x 22 = 66
    assert _warn([30.0, 20.0, 22.0, 66.0])
    assert _warn([30.0, 20.0, 22.0, 25.0, 812.0])
    assert not _warn([30.0, 20.0, 22.0, 65.9])  # just under 3 x the median


def test_no_warning_while_the_load_is_not_above_the_cores():
    assert not _warn([22.0, 22.0, 22.0, 900.0], load=2.0, cpus=2)  # load == cores
    assert _warn([22.0, 22.0, 22.0, 900.0], load=2.01, cpus=2)


def test_no_warning_before_the_baseline_is_complete_or_when_turned_off():
    assert not _warn([22.0, 900.0])  # only 1 of the 3 baseline steps before it
    assert not _warn([22.0, 22.0, 900.0])  # 900 is the third baseline step itself
    assert not _warn([22.0, 22.0, 22.0, 900.0], factor=0.0)


def test_never_twice():
    assert not _warn([22.0, 22.0, 22.0, 900.0], warned=True)


def _machine(load=9.8, cpus=2, usable=2, threads=2):
    return Machine(load_1min=load, cpu_count=cpus, usable_cpus=usable, torch_threads=threads)


def test_the_watch_warns_once_with_the_numbers_it_saw_and_the_fix():
    reads = []

    def read():  # quiet while the baseline is taken, then 9.8 on 2 CPUs
        reads.append(1)
        return _machine(load=1.0 if len(reads) <= 3 else 9.8)

    w = SlowStepWatch(factor=3.0, baseline_steps=3, read_machine=read)
    said = [w.observe(s, t) for s, t in enumerate([20.0, 22.0, 24.0, 23.0, 812.0, 980.0], 1)]
    assert said[:4] == [None] * 4 and said[5] is None
    msg = said[4]
    for part in (
        "step 5 took 812.0 s",
        "36.9x the median of the first 3 steps (22.0 s)",
        "load average 9.8",
        "2 CPUs",
        "may use 2",
        "torch runs 2 threads",
        "OMP_NUM_THREADS=1",
        "torch.set_num_threads(1)",
        "logging.slow_step_factor=0",
    ):
        assert part in msg, (part, msg)
    # the load is read for each baseline step, then only for a step that is slow already,
    # and never after the warning
    assert len(reads) == 4


def test_a_machine_overloaded_from_the_first_step_warns_at_once():
    """Under load 8-30 the main job's first two steps took 724 s and 2,371 s: its baseline was
    slow too, so no later step was ever 3x slower and the warning never came."""
    w = SlowStepWatch(factor=3.0, baseline_steps=3, read_machine=lambda: _machine(load=9.8))
    msg = w.observe(1, 724.0)
    assert msg is not None and "step 1 took 724.0 s" in msg and "from the start" in msg
    assert "OMP_NUM_THREADS=1" in msg
    assert w.observe(2, 2371.0) is None  # once
    # torch's threads leave CPUs free: the load is not this run's to fix
    w = SlowStepWatch(factor=3.0, baseline_steps=3, read_machine=lambda: _machine(threads=1))
    assert [w.observe(s, 724.0) for s in (1, 2, 3)] == [None] * 3


def test_a_step_slowed_by_its_rewards_says_so_and_advises_no_threads():
    """The warning blamed other work and the threads when the step's time went into rewards."""
    w = SlowStepWatch(factor=3.0, baseline_steps=2, read_machine=lambda: _machine(threads=1))
    for s in (1, 2):
        assert w.observe(s, 20.0, {"rollout": 15.0, "reward": 1.0}) is None
    msg = w.observe(3, 200.0, {"rollout": 16.0, "reward": 180.0})
    assert "180.0 s of it went into rewards (1.0 s in the first steps)" in msg
    assert "OMP_NUM_THREADS" not in msg and "other work competes" not in msg


def test_no_thread_count_the_run_already_uses_is_advised():
    """9 of 16 CPUs held by others, torch at 1 thread: "OMP_NUM_THREADS=1" was advised, the
    count the run already used."""
    w = SlowStepWatch(factor=3.0, baseline_steps=1, read_machine=lambda: _machine(17.0, 16, 16, 1))
    w.observe(1, 10.0)
    msg = w.observe(2, 40.0)
    assert "OMP_NUM_THREADS" not in msg and "already uses 1 thread(s)" in msg
    assert "quieter machine" in msg


def test_the_watch_keeps_watching_while_the_load_is_low():
    loads = iter([1.0, 1.0, 9.0])
    w = SlowStepWatch(factor=3.0, baseline_steps=1, read_machine=lambda: _machine(next(loads)))
    assert w.observe(1, 10.0) is None
    assert w.observe(2, 40.0) is None  # slow, but the machine is not overloaded: no warning
    assert w.observe(3, 40.0) is not None  # slow and overloaded
    assert w.observe(4, 40.0) is None


@pytest.mark.parametrize(
    "machine, want",
    [
        (_machine(load=9.8, cpus=2, usable=2, threads=2), 1),  # others hold 7.8 > 2 cores
        (_machine(load=20.0, cpus=16, usable=16, threads=16), 12),  # others hold 4
        (_machine(load=20.0, cpus=16, usable=8, threads=16), 8),  # at most the affinity mask
        (_machine(load=17.0, cpus=16, usable=16, threads=1), 1),  # others hold 16
    ],
)
def test_suggested_threads_are_the_cores_others_leave_free(machine, want):
    assert suggested_threads(machine) == want


@pytest.mark.parametrize(
    "override, ok",
    [
        ("logging.slow_step_factor=0", True),
        ("logging.slow_step_factor=1.5", True),
        ("logging.slow_step_factor=1", False),  # every step would be "slow"
        ("logging.slow_step_factor=-2", False),
        ("logging.slow_step_baseline=0", False),
    ],
)
def test_the_thresholds_are_checked_settings(override, ok):
    from nemo_d3s.config import ConfigError, validate

    from .conftest import compose

    cfg = compose(["experiment=smoke", override])
    if ok:
        validate(cfg)
    else:
        with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
            validate(cfg)
