"""``DIR/train.log``: every step's summary line and every evaluation's result, with the
progress bar on or off, in the run's own folder (also in a Hydra multirun sweep), and the
slow-step warning written there once (issue 35, points 3 and 4)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nemo_d3s.trainer.metrics import read_jsonl

from .conftest import FAST, cli, run_inprocess
from _limits import WAIT_S  # noqa: E402

STEP_LINE = re.compile(
    r"\] - step (\d+): reward=\S+ smp=\S+ tok=\S+ time=\S+ s "
    r"\(generated (\d+) in \S+ s, trained (\d+) in \S+ s\)$"
)
EVAL_LINE = re.compile(r"\] - eval step (\d+): reward ([0-9.]+) over (\d+) problems in \S+ s$")

# 3 steps, an evaluation at the start, after step 2 and at the end (step 3)
RUN = [*FAST, "trainer.steps=3", "trainer.eval_at_start=true", "trainer.eval_every=2"]


def _lines(path: Path, pattern: re.Pattern) -> list:
    return [m.groups() for m in map(pattern.search, path.read_text().splitlines()) if m]


def _check_log(out: Path, steps: int) -> None:
    log = out / "train.log"
    assert log.is_file(), f"no train.log in {out}: {sorted(p.name for p in out.iterdir())}"
    rows = read_jsonl(out / "metrics.jsonl")
    assert [tuple(int(x) for x in g) for g in _lines(log, STEP_LINE)] == [
        (r["step"], r["n_samples"], r["n_kept_samples"]) for r in rows
    ]
    assert [int(g[0]) for g in _lines(log, STEP_LINE)] == list(range(1, steps + 1))
    evals = read_jsonl(out / "eval.jsonl")
    assert evals, "the run evaluated"
    got = [(int(s), float(r), int(n)) for s, r, n in _lines(log, EVAL_LINE)]
    want = [(e["step"], round(e["eval_reward_mean"], 4), e["eval_n"]) for e in evals]
    assert got == want


@pytest.mark.parametrize("progress_bar", ["true", "false"])
def test_train_log_holds_every_step_and_every_evaluation(tmp_path, progress_bar):
    _, rows = run_inprocess(tmp_path, [*RUN, f"logging.progress_bar={progress_bar}"])
    assert len(rows) == 3
    _check_log(tmp_path, 3)
    assert [e["step"] for e in read_jsonl(tmp_path / "eval.jsonl")] == [0, 2, 3]


def test_a_resumed_run_appends_to_train_log(tmp_path):
    run_inprocess(tmp_path, [*RUN, "trainer.steps=2", "trainer.save_every=2"])
    first = (tmp_path / "train.log").read_text()
    run_inprocess(tmp_path, [*RUN, "trainer.save_every=2", "resume=true"])
    log = tmp_path / "train.log"
    assert log.read_text().startswith(first)  # nothing written is lost
    assert [int(g[0]) for g in _lines(log, STEP_LINE)] == [1, 2, 3]


def test_a_refused_run_writes_nothing_into_the_other_runs_log(tmp_path):
    from nemo_d3s.errors import ConfigError

    run_inprocess(tmp_path, RUN)
    before = (tmp_path / "train.log").read_bytes()
    with pytest.raises(ConfigError, match="already holds|earlier run's records"):
        run_inprocess(tmp_path, RUN)
    assert (tmp_path / "train.log").read_bytes() == before


def test_the_slow_step_warning_goes_to_train_log_once(tmp_path, monkeypatch):
    """The loop hands every step's time to the watch and writes what it says; the rule itself
    (with injected times and load) is tested in test_slow_steps.py."""
    from nemo_d3s.trainer import slow_steps

    seen = []

    def observe(self, step, seconds, parts=None):
        seen.append((step, seconds, parts))
        return "TEST-SLOW-STEP warning" if step == 2 else None

    monkeypatch.setattr(slow_steps.SlowStepWatch, "observe", observe)
    _, rows = run_inprocess(tmp_path, [*RUN, "logging.progress_bar=true"])
    assert [(step, t) for step, t, _ in seen] == [(r["step"], r["time_step"]) for r in rows]
    # the step's phases, as its row names them (the watch tells reward time from the rest)
    for (_, _, parts), r in zip(seen, rows):
        assert "reward" in parts and "rollout" in parts, parts
        # (time_generation / time_training are the PODS budgets, sums over phases:
        # stats.budget_metrics)
        budgets = {"time_step", "time_generation", "time_training"}
        assert set(parts) == {k[5:] for k in r if k.startswith("time_") and k not in budgets}
    text = (tmp_path / "train.log").read_text()
    assert text.count("TEST-SLOW-STEP warning") == 1
    assert "[WARNING] - TEST-SLOW-STEP warning" in text


@pytest.mark.slow  # a whole program run (or several): the slow tier
def test_multirun_jobs_each_keep_their_log_in_their_output_dir(tmp_path):
    """A sweep with the progress bar on (the default main job's setting): each job's
    train.log is in its own output_dir, both when Hydra picks it and when the sweep sets it."""
    args = ["-m", "experiment=smoke", *RUN, "logging.progress_bar=true", "seed=0,1"]
    res = cli([*args, f"hydra.sweep.dir={tmp_path / 'sweep'}"], timeout=WAIT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    for job in ("0", "1"):
        _check_log(tmp_path / "sweep" / job, 3)
    runs = tmp_path / "runs"
    res = cli(
        [*args, f"hydra.sweep.dir={tmp_path / 'sweep2'}", f"output_dir={runs}/s$" + "{seed}"],
        timeout=WAIT_S,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    for seed in ("0", "1"):
        _check_log(runs / f"s{seed}", 3)


def test_the_run_log_keeps_the_start_up_records_and_splits_the_ranks(tmp_path):
    """Records made before ``open`` (the model load) go first; rank r > 0 writes its warnings
    only, to train.rank<r>.log, and only when it has one; ``close`` detaches."""
    import logging

    from nemo_d3s.trainer.runlog import RunLog, file_only

    log = logging.getLogger("nemo_d3s.test_runlog")
    log.setLevel(logging.INFO)
    main, other = RunLog(), RunLog()
    try:
        log.info("start-up line")
        assert not (tmp_path / "train.log").exists()  # nothing before the folder is taken
        main.open(tmp_path, rank=0)
        other.open(tmp_path, rank=1)
        file_only(log, "a step line")
        assert not (tmp_path / "train.rank1.log").exists()  # no warning yet: no file
        log.warning("a warning")
    finally:
        main.close()
        other.close()
    log.info("after the run")
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert [ln.split("] - ", 1)[1] for ln in lines] == ["start-up line", "a step line", "a warning"]
    assert lines[2].endswith("[nemo_d3s.test_runlog][WARNING] - a warning")
    rank1 = (tmp_path / "train.rank1.log").read_text().splitlines()
    assert [ln.split("] - ", 1)[1] for ln in rank1] == ["a warning"]
    # a run's folder with other ranks' logs is still a run's folder (resume takes it)
    from nemo_d3s.trainer.run_start.folder import foreign_entries

    assert foreign_entries(tmp_path) == []


def test_a_script_without_logging_set_up_still_sees_warnings_on_stderr(monkeypatch, capsys):
    """Python prints a warning no handler takes to stderr (logging.lastResort); the run log's
    handler on the root logger must not swallow it (nor print it twice, nor print info)."""
    import logging

    from nemo_d3s.trainer.runlog import RunLog

    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's own, for this test
    log = logging.getLogger("nemo_d3s.test_runlog_stderr")
    log.setLevel(logging.INFO)
    a, b = RunLog(), RunLog()
    try:
        log.warning("visible warning")
        log.info("quiet info")
    finally:
        a.close()
        b.close()
    err = capsys.readouterr().err
    assert err.count("visible warning") == 1 and "quiet info" not in err


def test_evaluation_reports_its_batches_to_the_progress_bar(tmp_path, monkeypatch):
    """4 problems in batches of 2: each evaluation reports 0, 1 and 2 of 2 batches done (the
    bar shows at once, before the first batch); train.log gets one line per evaluation."""
    from nemo_d3s.trainer.metrics import MetricsLogger

    calls = []
    real = MetricsLogger.eval_progress

    def eval_progress(self, done, total):
        calls.append((done, total))
        real(self, done, total)

    monkeypatch.setattr(MetricsLogger, "eval_progress", eval_progress)
    over = [*RUN, "logging.progress_bar=true", "trainer.eval_batch_size=2"]
    run_inprocess(tmp_path, over)
    assert calls == [(0, 2), (1, 2), (2, 2)] * 3  # steps 0, 2, 3
    text = (tmp_path / "train.log").read_text()
    assert len(_lines(tmp_path / "train.log", EVAL_LINE)) == 3 and "batch" not in text
