"""TensorBoard logging (the `tensorboard` package is part of the test extra, so this runs
in CI): every numeric metric of a step or eval row becomes a scalar at that step."""

from __future__ import annotations

from nemo_d3s.trainer.metrics import MetricsLogger


def test_scalars_reach_the_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(
        str(tmp_path),
        enabled=True,
        tensorboard=True,
        progress_bar=False,
        total_steps=2,
        start_step=0,
    )
    assert logger.tb is not None
    logger.log_step(
        {"step": 1, "reward_mean": 0.25, "kept_token_ratio": 0.1, "skipped": False, "note": "x"}
    )
    logger.log_step({"step": 2, "reward_mean": 0.75, "kept_token_ratio": 0.2, "skipped": False})
    logger.log_eval({"step": 2, "eval_reward_mean": 0.5, "eval_n": 8})
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "train/reward_mean",
        "train/kept_token_ratio",
        "eval/eval_reward_mean",
        "eval/eval_n",
    } <= tags
    assert (
        "train/skipped" not in tags and "train/note" not in tags
    )  # bools and strings are not scalars
    got = [(e.step, e.value) for e in acc.Scalars("train/reward_mean")]
    assert got == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/eval_reward_mean")] == [(2, 0.5)]


def test_disabled_tensorboard_writes_no_events(tmp_path):
    logger = MetricsLogger(
        str(tmp_path),
        enabled=True,
        tensorboard=False,
        progress_bar=False,
        total_steps=1,
        start_step=0,
    )
    logger.log_step({"step": 1, "reward_mean": 0.5})
    logger.close()
    assert logger.tb is None and not (tmp_path / "tensorboard").exists()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_without_a_progress_bar_each_step_is_one_log_line(tmp_path, caplog):
    """Slurm logs have no progress bar: the bar's fields and the step's seconds, one line a step."""
    import logging

    logger = MetricsLogger(
        str(tmp_path),
        enabled=True,
        tensorboard=False,
        progress_bar=False,
        total_steps=1,
        start_step=0,
    )
    with caplog.at_level(logging.INFO, logger="nemo_d3s.trainer"):
        logger.log_step(
            {
                "step": 7,
                "reward_mean": 0.5,
                "kept_sample_ratio": 0.25,
                "kept_token_ratio": 0.7,
                "time_step": 95.26,
            }
        )
    logger.close()
    assert "step 7: reward=0.500 smp=0.25 tok=0.70 time=95.3 s" in caplog.text
