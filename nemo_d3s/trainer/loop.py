"""The training run: set-up, the step loop, evaluation, checkpoints, signals, export.

Run directory layout (the same for every run)::

    DIR/config.yaml                  the resolved config
    DIR/metrics.jsonl                one JSON object per step
    DIR/eval.jsonl                   one JSON object per evaluation
    DIR/checkpoints/step_XXXXXX/     the last ``trainer.keep_last`` checkpoints
    DIR/hf_export/                   the final policy as a Hugging Face folder
    DIR/tensorboard/                 when tensorboard is installed

Preemption: SIGTERM or SIGUSR1 set a flag; the current step finishes, a checkpoint is
written and the run returns normally (exit code 0). ``resume=true`` continues from the
latest checkpoint with the same model, optimizer, RNG streams, schedule position and data
order, so an interrupted + resumed run logs the same metrics as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from nemo_d3s.config import ConfigError, validate, validate_layout
from nemo_d3s.trainer.build import (
    backend_from_config,
    build_selector,
    generation_config,
    loss_config,
    plain,
    rollout_engine,
)
from nemo_d3s.trainer.checkpoint import CheckpointManager, TrainerState, latest_checkpoint
from nemo_d3s.trainer.data import PromptSource
from nemo_d3s.trainer.evaluate import evaluate
from nemo_d3s.trainer.metrics import MetricsLogger, truncate_jsonl
from nemo_d3s.trainer.step import StepContext, run_step
from nemo_d3s.trainer.tasks_adapter import TaskAdapter, build_task

__all__ = ["Trainer", "train"]

log = logging.getLogger("nemo_d3s.trainer")

_STOP_SIGNALS = ("SIGTERM", "SIGUSR1")


class Trainer:
    """Builds everything from a resolved config and runs it. ``cfg``: DictConfig of
    :class:`nemo_d3s.config.TrainConfig`."""

    def __init__(self, cfg: Any) -> None:
        validate(cfg)  # everything that does not need the parallel layout, before any model load
        self.cfg = cfg
        self.t = cfg.trainer
        self.out = Path(cfg.output_dir)
        self._stop_signal: Optional[str] = None
        # The policy builds the parallel layout (HF: the torchrun world; Megatron: its
        # model-parallel groups); the config is then checked against the real DP size.
        self.policy = backend_from_config(cfg)
        self.groups = self.policy.groups
        validate_layout(cfg, self.groups.dp_size)
        self.task = TaskAdapter(build_task(cfg.task.name, plain(cfg.task.params) or {}))
        self.eval_problems = self.task.eval_set(int(cfg.task.eval_size))
        self.engine = rollout_engine(self.policy, cfg)
        self.ckpt = CheckpointManager(str(self.out), self.groups, int(self.t.keep_last))
        self.ctx = StepContext(
            policy=self.policy,
            engine=self.engine,
            selector=build_selector(cfg, self.groups),
            task=self.task,
            prompts=PromptSource(self.task, int(self.t.prompts_per_step), int(cfg.seed), self.groups),
            gen=generation_config(cfg),
            num_generations=int(self.t.num_generations),
            loss_name=cfg.algorithm.loss,
            loss_cfg=loss_config(cfg),
            num_mini_batches=int(self.t.num_mini_batches),
            micro_batch_size=int(self.t.micro_batch_size),
            logprob_micro_batch_size=int(self.t.logprob_micro_batch_size),
            groups=self.groups,
            normalize_by=str(cfg.algorithm.normalize_by),
            rebalance=bool(self.t.dp_rebalance) and self.groups.data_parallel,
            tis_cap=None if cfg.algorithm.tis_cap is None else float(cfg.algorithm.tis_cap),
        )

    # ------------------------------------------------------------------ set-up helpers
    def _start_state(self) -> TrainerState:
        """Fresh state, or the latest checkpoint's when ``resume=true`` (files cut back to it)."""
        latest = latest_checkpoint(self.out / "checkpoints")
        if not self.cfg.resume:
            if latest is not None:
                raise ConfigError(
                    f"output_dir={str(self.out)!r} already holds checkpoints ({latest.name}); "
                    "pass resume=true to continue that run or choose another output_dir"
                )
            return self._start_state_fresh()
        if latest is None:
            log.info("resume=true but no checkpoint in %s; starting from step 0", self.out / "checkpoints")
            return self._start_state_fresh()
        state = self.ckpt.load(latest, self.policy)
        self.engine.sync_weights(self.policy)  # an engine with its own copy samples from the loaded weights
        if self.groups.is_main:
            for name in ("metrics.jsonl", "eval.jsonl"):
                truncate_jsonl(self.out / name, state.step)
        log.info("resumed from %s (step %d)", latest, state.step)
        return state

    def _start_state_fresh(self) -> TrainerState:
        if self.groups.is_main:
            for name in ("metrics.jsonl", "eval.jsonl"):
                truncate_jsonl(self.out / name, -1)
        return TrainerState()

    def _install_signal_handlers(self) -> Dict[int, Any]:
        """SIGTERM/SIGUSR1 -> stop after the current step (a second one stops at once).
        Returns the previous handlers, restored when the run ends."""

        def handler(signum, _frame):
            if self._stop_signal is not None:
                print(f"second {signal.Signals(signum).name}: stopping now, without a checkpoint "
                      "(resume=true continues from the last one)", file=sys.stderr, flush=True)
                raise SystemExit(128 + signum)
            self._stop_signal = signal.Signals(signum).name

        previous: Dict[int, Any] = {}
        for name in _STOP_SIGNALS:
            if hasattr(signal, name):
                sig = getattr(signal, name)
                try:
                    previous[sig] = signal.signal(sig, handler)
                except ValueError:  # not the main thread (e.g. inside a notebook worker)
                    pass
        return previous

    # ------------------------------------------------------------------ the run
    def _evaluate(self, state: TrainerState) -> Dict[str, Any]:
        res = evaluate(
            self.engine, self.task, self.eval_problems, self.groups,
            max_new_tokens=int(self.t.eval_max_new_tokens or self.t.max_new_tokens),
            batch_size=int(self.t.eval_batch_size), n_show=int(self.cfg.logging.log_samples),
        )
        samples = res.pop("samples")
        row = {"step": state.step, **res}
        self.logger.log_eval(row)
        for s in samples:
            self.logger.write(f"  sample (reward {s['reward']:.2f}): {s['prompt'][-120:]!r} -> {s['completion'][:200]!r}")
        return row

    def _write_config(self) -> None:
        """DIR/config.yaml; on resume, warn about keys that differ from the original run."""
        path = self.out / "config.yaml"
        new = OmegaConf.to_container(self.cfg, resolve=True)
        if self.cfg.resume and path.is_file():
            old = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
            changed = [k for k in _diff_keys(old, new) if k not in ("resume", "output_dir")]
            if changed:
                log.warning("resuming with a different config; changed keys: %s", ", ".join(changed))
        path.write_text(OmegaConf.to_yaml(OmegaConf.create(new)))

    def run(self) -> TrainerState:
        self.out.mkdir(parents=True, exist_ok=True)
        state = self._start_state()  # first: it refuses to overwrite another run's directory
        if self.groups.is_main:
            self._write_config()
        self.groups.barrier()
        T = int(self.t.steps)
        self.logger = MetricsLogger(
            str(self.out), enabled=self.groups.is_main, tensorboard=bool(self.cfg.logging.tensorboard),
            progress_bar=bool(self.cfg.logging.progress_bar), total_steps=T, start_step=state.step,
        )
        previous_handlers = self._install_signal_handlers()
        t_start, wall_before = time.perf_counter(), state.wall_time_total
        try:
            if state.step == 0 and self.t.eval_at_start:
                self._evaluate(state)
            while state.step < T:
                progress = state.step / max(1, T - 1)
                t0 = time.perf_counter()
                m = run_step(self.ctx, state.step, progress)
                state.step += 1
                self._accumulate(state, m)
                state.wall_time_total = wall_before + time.perf_counter() - t_start
                row = {"step": state.step, "progress": progress, **m, **self._totals(state),
                       "time_step": time.perf_counter() - t0, "wall_time": state.wall_time_total}
                self.logger.log_step(row)
                if m.get("skipped"):
                    why = "every group had equal rewards" if m.get("skip_all_equal") else "no token was kept"
                    self.logger.write(f"step {state.step}: update skipped ({why}); schedule advances")
                done = state.step == T
                if done or (self.t.eval_every and state.step % self.t.eval_every == 0):
                    self._evaluate(state)
                stop = self.groups.max(1.0 if self._stop_signal else 0.0) > 0
                if done or stop or (self.t.save_every and state.step % self.t.save_every == 0):
                    path = self.ckpt.save(self.policy, state)
                    if stop and not done:
                        self.logger.write(
                            f"received {self._stop_signal or 'a stop signal on another rank'}: checkpoint "
                            f"{path} written at step {state.step}; continue with resume=true"
                        )
                        state.extra["interrupted"] = True
                        return state
            if self.t.export_hf:
                self._export()
            self._summary(state)
            return state
        finally:
            for sig, h in previous_handlers.items():
                signal.signal(sig, h)
            self.logger.close()

    @staticmethod
    def _accumulate(state: TrainerState, m: Dict[str, float]) -> None:
        state.update_tokens_total += float(m.get("update_tokens", 0.0))
        state.rollout_tokens_total += float(m.get("rollout_tokens", 0.0))
        state.skipped_steps += int(m.get("skipped", 0.0))
        state.reward_errors_total += int(m.get("reward_errors", 0.0))

    @staticmethod
    def _totals(state: TrainerState) -> Dict[str, float]:
        return {
            "update_tokens_total": state.update_tokens_total,
            "rollout_tokens_total": state.rollout_tokens_total,
            "skipped_steps_total": float(state.skipped_steps),
            "reward_errors_total": float(state.reward_errors_total),
        }

    def _export(self) -> None:
        # A sharded policy sets collective_export = True and gathers inside save_pretrained.
        if self.groups.is_main or self.policy.collective_export:
            self.policy.save_pretrained(str(self.out / "hf_export"))
        self.groups.barrier()

    def _summary(self, state: TrainerState) -> None:
        if not self.groups.is_main:
            return
        from nemo_d3s.trainer.metrics import read_jsonl

        evals = read_jsonl(self.out / "eval.jsonl")
        summary = {
            "steps": state.step,
            "eval_reward_first": evals[0]["eval_reward_mean"] if evals else None,
            "eval_reward_last": evals[-1]["eval_reward_mean"] if evals else None,
            **self._totals(state),
            "wall_time": state.wall_time_total,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        self.logger.write("done: " + ", ".join(f"{k}={v}" for k, v in summary.items()))


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list:
    """Dotted keys whose values differ between two plain nested dicts."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def seed_everything(seed: int) -> None:
    """Python, numpy and torch global RNGs (a tiny random model's initial weights come from
    torch's). Process-wide state: set by :func:`train`, not by the Trainer constructor."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train(cfg: Any) -> TrainerState:
    """Run training for a resolved config: seed the process, build the Trainer, run it, and
    tear down the process group the policy created. Rank 0 speaks for the job; other ranks
    log warnings only."""
    seed_everything(int(cfg.seed))
    trainer = Trainer(cfg)
    logging.getLogger("nemo_d3s").setLevel(cfg.logging.level if trainer.groups.is_main else "WARNING")
    try:
        return trainer.run()
    finally:
        trainer.groups.shutdown()
