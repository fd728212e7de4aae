"""The training run: set-up, the step loop, evaluation, checkpoints, signals, export.

Writes ``DIR/config.yaml``, ``train.log``, ``metrics.jsonl``, ``eval.jsonl``,
``checkpoints/step_XXXXXX/``, ``hf_export/`` and, after a stop signal, ``interrupted.json``
(the command line then exits 75). ``resume=true`` continues with the same model, optimizer,
RNG streams, schedule and data order, so an interrupted + resumed run logs the same metrics.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

from nemo_d3s.config import validate, validate_layout
from nemo_d3s.distributed.generation_wait import GenerationWait
from nemo_d3s.trainer.build import (
    backend_from_config,
    check_runtime,
    build_selector,
    generation_config,
    loss_config,
    plain,
    rollout_engine,
)
from nemo_d3s.trainer import records
from nemo_d3s.trainer.checkpoint import (
    CheckpointManager,
    TrainerState,
    job_world,
    export_failure,
    looks_like_write_failure,
)
from nemo_d3s.backends.base import GenerationInterrupted
from nemo_d3s.trainer.data import PromptSource
from nemo_d3s.trainer.evaluate import evaluate
from nemo_d3s.trainer.faults import RunError, broadcast_world, fault_point
from nemo_d3s.trainer.metrics import MetricsLogger
from nemo_d3s.trainer.pipeline import GenerationPipeline
from nemo_d3s.trainer.prompt_check import check_prompt_lengths
from nemo_d3s.trainer.run_start import RunStart, agree_on_config, check_output_dir
from nemo_d3s.trainer.launcher import watch_launcher
from nemo_d3s.trainer.runlog import RunLog
from nemo_d3s.trainer.slow_steps import SlowStepWatch
from nemo_d3s.trainer.signals import StopSignals, children_ignore_as_started
from nemo_d3s.trainer.stats import budget_metrics
from nemo_d3s.trainer.step import (
    SKIP_REASONS,
    StepContext,
    StepInterrupted,
    release_engine,
    run_step,
)
from nemo_d3s.trainer.tasks_adapter import task_adapter
from nemo_d3s.tasks.base import out_of_range_rewards

__all__ = ["Trainer", "train"]

log = logging.getLogger("nemo_d3s.trainer")


class Trainer:
    """Builds everything from a resolved :class:`nemo_d3s.config.TrainConfig` and runs it.
    ``runlog``: the handler holding the records made before the run folder is taken (else
    ``run`` installs its own).
    """

    def __init__(self, cfg: Any, runlog: Optional[RunLog] = None) -> None:
        self.runlog = runlog
        validate(cfg)  # everything that does not need the parallel layout, before any model load
        check_runtime(cfg)  # and what this machine must provide (vLLM, a GPU)
        self.cfg = cfg
        self.t = cfg.trainer
        self.out = Path(cfg.output_dir)
        # The reward workers start first (from this thread: they die with it), importing and
        # building their task while the model loads.
        self.task = task_adapter(
            cfg.task.name,
            plain(cfg.task.params) or {},
            float(cfg.trainer.reward_timeout_s),
            int(cfg.trainer.reward_workers),
        )
        try:
            self._build(cfg)
        except BaseException:
            self.task.close()
            raise

    def _build(self, cfg: Any) -> None:
        # a first stop signal also cuts a reward call that runs on (or hangs) short
        self.stop = StopSignals(on_first=lambda: self.task.request_stop())
        # The policy builds the parallel layout (HF: the torchrun world; Megatron: its
        # model-parallel groups); the config is then checked against the real DP size.
        self.policy = backend_from_config(cfg)
        self.groups = self.policy.groups
        validate_layout(cfg, self.groups.dp_size)
        agree_on_config(cfg, job_world()[2])  # resume=true: each rank merged config.yaml itself
        self.eval_problems = self.task.eval_set(int(cfg.task.eval_size))
        with children_ignore_as_started():  # its processes stay deaf to sbatch's SIGUSR1
            self.engine = rollout_engine(self.policy, cfg)
        self.engine.should_stop = self._generation_should_stop
        # every rank waits for the others' generations with a liveness check, not inside one
        # collective limited by the groups' timeout (distributed/generation_wait.py)
        self.engine_wait = GenerationWait.of_group(
            "trainer", None, 60.0 * float(self.t.dist_timeout_minutes)
        )
        self.ckpt = CheckpointManager(str(self.out), self.groups, int(self.t.keep_last))
        prompts = PromptSource(self.task, int(self.t.prompts_per_step), int(cfg.seed), self.groups)
        self.rollouts = GenerationPipeline(
            self.engine,
            prompts,
            generation_config(cfg),
            int(self.t.num_generations),
            int(cfg.rollout.max_staleness),
            self.groups,
            int(self.t.steps),
            stop_requested=self._stop_requested,
            wait=self.engine_wait,  # the step boundaries' waits too (k >= 1)
        )
        self.start = RunStart(cfg, self.groups, self.ckpt)  # fresh, resume or refuse, and why
        self.ctx = StepContext(
            policy=self.policy,
            engine=self.engine,
            selector=build_selector(cfg, self.groups),
            task=self.task,
            prompts=prompts,
            gen=generation_config(cfg),
            num_generations=int(self.t.num_generations),
            loss_name=cfg.algorithm.loss,
            loss_cfg=loss_config(cfg),
            num_mini_batches=int(self.t.num_mini_batches),
            micro_batch_size=int(self.t.micro_batch_size),
            logprob_micro_batch_size=int(self.t.logprob_micro_batch_size),
            micro_batch_tokens=int(self.t.micro_batch_tokens),
            logprob_micro_batch_tokens=int(
                self.t.micro_batch_tokens
                if self.t.logprob_micro_batch_tokens is None
                else self.t.logprob_micro_batch_tokens
            ),
            groups=self.groups,
            rollouts=self.rollouts,
            normalize_by=str(cfg.algorithm.normalize_by),
            rebalance=bool(self.t.dp_rebalance) and self.groups.data_parallel,
            tis_cap=None if cfg.algorithm.tis_cap is None else float(cfg.algorithm.tis_cap),
            is_correction=str(cfg.algorithm.is_correction),
            is_level=str(cfg.algorithm.is_level),
            router_replay=str(cfg.algorithm.router_replay) == "rollout",
            stop_requested=self._stop_requested,
            engine_wait=self.engine_wait,
        )

    def _stop_requested(self) -> bool:
        """A stop signal reached this process, or the engine's processes first (they ended
        without a fault: nothing more can be generated, the run checkpoints and exits 75)."""
        return self.stop.requested or self.engine.stopped

    def _generation_should_stop(self) -> bool:
        """The engine asks between decode steps: a stop signal is honoured within a token."""
        fault_point("engine.decode")
        return self._stop_requested()

    # ------------------------------------------------------------------ the run
    def _evaluate(self, state: TrainerState) -> Optional[Dict[str, Any]]:
        """The eval row, or None when a stop signal interrupted the evaluation."""
        with self.logger.clock_paused():  # the bar's s/step and ETA: training steps only
            res = evaluate(
                self.engine,
                self.task,
                self.eval_problems,
                self.groups,
                max_new_tokens=int(self.t.eval_max_new_tokens or self.t.max_new_tokens),
                batch_size=int(self.t.eval_batch_size),
                n_show=int(self.cfg.logging.log_samples),
                should_stop=self._stop_requested,
                on_batch=self.logger.eval_progress,
                wait=self.engine_wait,
            )
        if res.get("stopped"):
            self.logger.close_eval_progress()
            return None
        samples = res.pop("samples")
        row = {"step": state.step, **res}
        self.logger.log_eval(row)
        for s in samples:
            self.logger.write(
                f"  sample (reward {s['reward']:.2f}): {s['prompt'][-120:]!r} -> "
                f"{s['completion'][:200]!r}"
            )
        return row

    def run(self) -> TrainerState:
        # Checks that write nothing come first: prompt lengths against the model's context.
        if check_prompt_lengths(self.cfg, self.policy, self.task.task):
            self.eval_problems = self.task.eval_set(int(self.cfg.task.eval_size))
        own_log = self.runlog is None
        if own_log:
            self.runlog = RunLog()
        try:
            self.start.take()  # one run per directory, all the run
            return self._run_locked()
        finally:
            self.task.close()
            self.start.release()
            if own_log:
                self.runlog.close()

    def _run_locked(self) -> TrainerState:
        state = self.start.begin(self.policy)  # first: it refuses another run's directory
        if self.start.resumed_from is not None:
            self.engine.sync_weights(self.policy)  # an engine with its own copy of the weights
        # the folder is this run's now: train.log gets the records held since start-up
        self.runlog.open(self.out, rank=self.groups.global_rank)
        self.slow = SlowStepWatch(
            factor=float(self.cfg.logging.slow_step_factor),
            baseline_steps=int(self.cfg.logging.slow_step_baseline),
        )
        T = int(self.t.steps)
        self.logger = MetricsLogger(
            str(self.out),
            enabled=self.groups.is_main,
            tensorboard=bool(self.cfg.logging.tensorboard),
            progress_bar=bool(self.cfg.logging.progress_bar),
            total_steps=T,
            start_step=state.step,
        )
        self.logger.write(f"run directory: {self.out.resolve()}")
        self.stop.install()
        try:
            return self._train(state)
        finally:
            self.rollouts.close()
            self.stop.restore()
            self.logger.close()

    def _train(self, state: TrainerState) -> TrainerState:
        """The step loop until ``trainer.steps`` (records, evaluation and checkpoint when due; a
        stop signal ends it at a checkpoint), then the export and ``summary.json``.
        """
        T = int(self.t.steps)
        t_start, wall_before = time.perf_counter(), state.wall_time_total
        oor_before = int(state.extra.get("reward_out_of_range", 0))  # over resumed segments
        pending = state.extra.pop("pending_eval", None)
        if state.step == 0 and self.t.eval_at_start and self.start.resumed_from is None:
            pending = 0  # (a resume from step 0 evaluates again only if the checkpoint says so)
        # Until the first step trains, a resumed run's checkpoint is still its state: a stop
        # keeps it as it is (no second save in a pre-emption's grace time; saving it again
        # from a pipeline not started yet would drop the batches generated ahead it holds).
        loaded = self.start.resumed_from
        if pending is not None and pending == state.step:
            if self._evaluate(state) is None:
                return self._interrupted(state, pending_eval=True, saved=loaded)
        pending, held = self.rollouts.load_pending(loaded)
        try:
            self.rollouts.start(state.step, pending, held, self.policy)
        except GenerationInterrupted:  # a stop during the refit of a resumed boundary
            return self._interrupted(state, pending_eval=False, saved=loaded)
        while state.step < T:
            progress = state.step / max(1, T - 1)
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                m = run_step(self.ctx, state.step, progress)
            except StepInterrupted:  # before a resumed run's first update: its checkpoint
                return self._interrupted(state, pending_eval=False, saved=loaded)
            loaded = None  # an update since: a stop saves again
            state.step += 1
            records.accumulate(state, m)
            state.wall_time_total = wall_before + time.perf_counter() - t_start
            m["time_cpu_step"] = time.process_time() - c0
            self._record_step(state, m, progress, t0, oor_before)
            fault_point("loop.step_done")
            done = state.step == T
            due = done or bool(self.t.eval_every and state.step % self.t.eval_every == 0)
            try:
                eval_stopped = self._publish(state, evaluate=due)
            except GenerationInterrupted:  # a stop signal (agreed) while rollouts were due
                return self._interrupted(state, pending_eval=due)
            # (an evaluation stopped on one rank stopped on every rank: evaluate agrees)
            stop = eval_stopped or self.groups.max(1.0 if self._stop_requested() else 0.0) > 0
            if stop and (eval_stopped or not done):
                return self._interrupted(state, pending_eval=eval_stopped)
            # save_every=0: no checkpoint on schedule, not even the last ("no checkpoints" as
            # documented); a stop signal still writes one.
            every = int(self.t.save_every)
            if every and (done or state.step % every == 0):
                # the save may need the memory the engine holds (with k > 0 the pipeline's
                # worker is generating on it)
                if self.rollouts.synchronous:
                    release_engine(self.engine, stopping=stop)
                self.logger.sync()
                self.ckpt.save(self.policy, state, self.rollouts.pending_writer(state.step))
        if self.t.export_hf:
            self._export(state)
        self._summary(state)
        return state

    def _publish(self, state: TrainerState, *, evaluate: bool) -> bool:
        """Weights version ``state.step`` to the rollouts (``pipeline.publish``), evaluated
        where the engine holds it if ``evaluate``; whether a stop signal cut that short."""
        rows: list = []

        def between() -> bool:
            if evaluate:
                rows.append(self._evaluate(state))
            return bool(rows) and rows[0] is None  # a stop signal cut the evaluation short

        self.rollouts.publish(state.step, self.policy, between)
        return bool(rows) and rows[0] is None

    def _record_step(
        self, state: TrainerState, m: Dict[str, float], progress: float, t0: float, oor: int
    ) -> None:
        """The step's metrics row, a note when its update was skipped, and the reward checks
        (``records``); ``oor``: out-of-range rewards counted before this run segment."""
        row = {
            "step": state.step,
            "progress": progress,
            **m,
            **budget_metrics(m),
            **records.totals(state),
            "time_step": time.perf_counter() - t0,
            "wall_time": state.wall_time_total,
        }
        self.logger.log_step(row)
        if self.groups.is_main:  # rank 0 watches its machine (every rank shares the step time)
            parts = {k[5:]: v for k, v in m.items() if k.startswith("time_")}
            slow = self.slow.observe(state.step, row["time_step"], parts)
            if slow:
                log.warning(slow)
        if m.get("skipped"):
            why = next(w for k, w in SKIP_REASONS.items() if m.get(k))
            self.logger.write(f"step {state.step}: update skipped ({why}); schedule advances")
        n_rollouts = int(self.t.prompts_per_step) * int(self.t.num_generations)
        max_failed = int(self.t.max_failed_reward_steps)
        records.check_reward_failures(state, m, n_rollouts, max_failed, self.task.name)
        records.check_constant_reward(state, m, is_main=self.groups.is_main)
        state.extra["reward_out_of_range"] = oor + out_of_range_rewards(self.task.task)

    def _interrupted(
        self, state: TrainerState, *, pending_eval: bool, saved: Optional[Path] = None
    ) -> TrainerState:
        """A stop signal: checkpoint now (with the evaluation it cut short still to do), or
        keep ``saved``, a checkpoint of this very state, and return; ``resume=true``
        continues exactly here."""
        if pending_eval:
            state.extra["pending_eval"] = state.step
        # The engine is released first (an engine that ignores the signal, as SIGUSR1 under
        # the sbatch script, is awake after a generation and its memory is the save's) and
        # then not called again: no refit, no generation (trainer/step.py). One that the job's
        # signal took down holds nothing (step.release_engine). With k > 0 the pipeline's
        # worker owns the engine and stops on the signal (pipeline.py).
        if self.rollouts.synchronous:
            release_engine(self.engine, stopping=True)
        if saved is None:
            self.logger.sync()
            saved = self.ckpt.save(self.policy, state, self.rollouts.pending_writer(state.step))
        path = saved
        self.stop.saved = True  # a second signal from here on would only lose the exit code 75
        state.extra.pop("pending_eval", None)
        why = self.stop.name or (
            "the rollout engine's stop (its processes ended)" if self.engine.stopped else None
        )
        if self.groups.is_main:
            marker = {
                "step": state.step,
                "signal": why or "another rank's",
                "checkpoint": str(path),
            }
            records.write_interrupted_marker(self.out, marker)
        self.logger.write(
            f"received {why or 'a stop signal on another rank'}: checkpoint "
            f"{path} written at step {state.step}; continue with resume=true"
        )
        state.extra["interrupted"] = True
        return state

    def _export(self, state: TrainerState) -> None:
        """``DIR/hf_export``; a failed write is one RunError on every rank, raised after
        ``summary.json`` is written (the last checkpoint is complete).
        """
        folder = self.out / "hf_export"
        failure = None
        # A sharded policy sets collective_export = True and gathers inside save_pretrained.
        if self.groups.is_main or self.policy.collective_export:
            try:
                self.policy.save_pretrained(str(folder))
            except Exception as e:
                if not looks_like_write_failure(e):
                    raise
                failure = export_failure(folder, e)
        failure = broadcast_world(failure if self.groups.is_main else None)  # also the barrier
        if failure is not None:
            self._summary(state)
            raise RunError(failure)

    def _summary(self, state: TrainerState) -> None:
        if not self.groups.is_main:
            return
        summary = records.summary(state, self.out, self.task.task)
        self.logger.write(
            "done: "
            + ", ".join(f"{k}={v}" for k, v in summary.items())
            + f"; run directory: {self.out.resolve()}"
        )


def seed_everything(seed: int) -> None:
    """Python, numpy and torch global RNGs (a tiny random model's initial weights come from
    torch's). Process-wide state: set by :func:`train`, not by the Trainer constructor."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train(cfg: Any) -> TrainerState:
    """Seed the process, build the Trainer, run it and tear down the policy's process group. Rank 0
    speaks for the job; other ranks log warnings only.
    """
    seed_everything(int(cfg.seed))
    check_output_dir(
        str(cfg.output_dir), create=False
    )  # before the model load: a bad path fails fast
    runlog = RunLog()  # holds the start-up's records until the run has taken its folder
    watch = watch_launcher()  # torchrun's agent gone: stop as on SIGTERM
    try:
        trainer = Trainer(cfg, runlog)
        logging.getLogger("nemo_d3s").setLevel(
            cfg.logging.level if trainer.groups.is_main else "WARNING"
        )
        try:
            return trainer.run()
        finally:
            trainer.groups.shutdown()
    finally:
        if watch is not None:
            watch.set()
        runlog.close()
