"""One GRPO/D3S training step: rollout -> reward -> advantages -> sample selection -> old
log-probs + entropy -> token selection -> compaction -> update -> metrics. Every decision
(degenerate batch, kept tokens, denominators) is agreed by all DP ranks.
"""

from __future__ import annotations

import logging
import time
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, Optional

from nemo_d3s.backends.base import GenerationConfig, Policy, RolloutEngine
from nemo_d3s.backends.engine_wait import agreed_generation
from nemo_d3s.core.checks import check_finite
from nemo_d3s.core.losses import LossConfig
from nemo_d3s.core.off_policy import importance_weights
from nemo_d3s.distributed.generation_wait import GenerationWait, generation_limit_s
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.distributed.selector import DistributedD3SSelector
from nemo_d3s.trainer.data import PromptSource
from nemo_d3s.trainer.faults import RunError, agreed_refit, fault_point, first_line
from nemo_d3s.trainer.pipeline import GenerationPipeline
from nemo_d3s.trainer.stats import (
    importance_metrics,
    mismatch_metrics,
    padding_metrics,
    rollout_metrics,
    routing_metrics,
    selection_metrics,
    token_metrics,
    update_metrics,
)
from nemo_d3s.trainer.tasks_adapter import RewardStopped, TaskAdapter
from nemo_d3s.trainer.update import compact, update_policy

__all__ = ["SKIP_REASONS", "StepContext", "StepInterrupted", "release_engine", "run_step"]

# A skipped step's flag -> the reason the loop's note gives.
SKIP_REASONS = {
    "skip_all_equal": "every group had equal rewards",
    "skip_zero_advantage": "every kept advantage was 0",
    "skip_no_tokens": "no token was kept",
    "skipped_nonfinite": "the gradient norm was not finite",
}

log = logging.getLogger("nemo_d3s.trainer")


class StepInterrupted(Exception):
    """A stop signal cut generation short on some rank: nothing was applied, so the loop
    checkpoints the state before the step and a resume redoes it.
    """


@dataclass
class StepContext:
    """Everything a step needs; built once by the loop."""

    policy: Policy
    engine: RolloutEngine
    selector: DistributedD3SSelector
    task: TaskAdapter
    prompts: PromptSource
    gen: GenerationConfig
    num_generations: int
    loss_name: str
    loss_cfg: LossConfig
    num_mini_batches: int
    micro_batch_size: int
    logprob_micro_batch_size: int
    groups: ParallelGroups
    rollouts: GenerationPipeline  # the step's batch: generated now (k = 0) or ahead
    micro_batch_tokens: int = 0  # trainer.micro_batch_tokens (0 = micro_batch_size rows)
    logprob_micro_batch_tokens: int = 0  # the scoring passes' budget (resolved: never null)
    normalize_by: str = "kept"  # algorithm.normalize_by: kept | eligible
    rebalance: bool = False  # trainer.dp_rebalance
    tis_cap: Optional[float] = None  # algorithm.tis_cap
    is_correction: str = "truncate"  # algorithm.is_correction
    is_level: str = "token"  # algorithm.is_level
    router_replay: bool = False  # algorithm.router_replay=rollout: the engine's routing
    timings: Dict[str, float] = field(default_factory=dict)
    # the trainer's stop-signal flag (this rank's; the step agrees on it over all ranks)
    stop_requested: Optional[Callable[[], bool]] = None
    # every rank's wait for the generations of all (one process: waits for nobody)
    engine_wait: GenerationWait = field(default_factory=lambda: GenerationWait("steps", 1, 0, 0))

    def stopping(self) -> bool:
        return self.stop_requested is not None and bool(self.stop_requested())

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """``time_<name>``: wall seconds; ``time_cpu_<name>``: this process's CPU seconds (all
        its threads), which a loaded machine inflates far less."""
        t0, c0 = time.perf_counter(), time.process_time()
        yield
        self.timings[f"time_{name}"] = time.perf_counter() - t0
        self.timings[f"time_cpu_{name}"] = time.process_time() - c0


def _check_step_inputs(upd) -> None:
    """The loss's data checks, once per step on the CPU (the loss itself runs with
    ``LossConfig.check_inputs=False``, so its micro-batch loop never syncs the device)."""
    check_finite("advantages (of the kept samples)", upd.advantages)
    for name in ("old_logprobs", "ref_logprobs"):
        t = getattr(upd, name)
        if t is not None:
            check_finite(f"{name} (on the selected tokens)", t, upd.token_keep)


def release_engine(engine: RolloutEngine, *, stopping: bool) -> None:
    """``engine.release()`` before the trainer needs the memory; after a stop signal, only
    while the engine's processes live, and a failure is logged: the checkpoint comes first."""
    if not stopping:
        engine.release()
        return
    if not engine.alive():
        return
    try:
        engine.release()
    except Exception as e:
        log.warning(
            "after the stop signal the rollout engine could not be released (%s); the "
            "checkpoint is written anyway",
            first_line(e),
        )


def _refit_after_update(ctx: StepContext) -> None:
    """The refit after the update, none after a stop signal on any rank (agreed first: a
    model-parallel group refits together): the checkpoint comes first, the engine may be going
    down with the job (vLLM's EngineCore shuts down on SIGTERM and SIGINT, vllm 0.33
    ``v1/engine/core.py:1522-1543``) and the resumed run refits from the checkpoint. A refit
    the signal cuts short is the same stop (the update is applied: the loop checkpoints it);
    one that fails without a stop fails every rank."""
    if ctx.groups.max(1.0 if ctx.stopping() else 0.0) > 0:
        return

    def agree(failed: bool):  # on the job's store: a rank may wait for a long refit
        wait = ctx.engine_wait
        o = wait.agree(
            stopping=ctx.stopping(), interrupted=False, failed=failed, limit_s=wait.base_s
        )
        return o.stopping, o.failed

    with ctx.timed("weight_sync"):
        agreed_refit(lambda: ctx.engine.sync_weights(ctx.policy), agree)


def run_step(ctx: StepContext, step: int, progress: float) -> Dict[str, float]:
    """Train on the prompts of ``step`` (0-based) at schedule position ``progress`` in [0, 1].
    Returns global (all-rank) metrics; ``skipped`` = 1 when no update was possible."""
    ctx.timings = {}
    G = ctx.num_generations
    prompts = ctx.prompts.for_step(step)
    with ctx.timed("rollout"):
        # Every rank learns whether any rank's generation was cut short (an engine that a
        # stop signal took down returns its rollouts aborted: GenerationInterrupted) or a
        # stop signal is pending, before the step's first collective over the rollouts; a
        # rank waits for the others' generations with a liveness check (engine_wait.py).
        # With k > 0 the batch is the pipeline's, generated beside earlier steps.
        limit = generation_limit_s(ctx.engine_wait.base_s, len(prompts) * G, ctx.gen.max_new_tokens)
        ro, agreed = agreed_generation(
            ctx.engine_wait,
            ctx.engine.alive,
            lambda: ctx.rollouts.take(step, prompts),
            stopping=ctx.stopping(),
            limit_s=limit,
        )
        fault_point("step.generated")
        if agreed.interrupted:
            raise StepInterrupted(step)
        # scoring and the update need the memory: an engine with its own weights drops them
        # now (not after every generation: evaluation batches reuse them), after a stop
        # signal too (an engine that ignores SIGUSR1, as the sbatch script's, stays awake);
        # with k > 0 it is generating the next batches
        if ctx.rollouts.synchronous:
            release_engine(ctx.engine, stopping=agreed.stopping or ctx.stopping())
    interrupted = 0.0
    with ctx.timed("reward"):
        try:
            rewards, failures = ctx.task.score(prompts.problems, ro.response_texts, G)
        except RewardStopped:  # a stop signal cut a (slow or hung) reward call short
            rewards, interrupted = None, 1.0
        # Agreed like the generation's: a rank whose reward call was cut short stops them all.
        if ctx.groups.max(interrupted) > 0:
            raise StepInterrupted(step)
    group_ids = prompts.global_index.repeat_interleave(G)  # [B] global prompt index = group id

    stage = ctx.selector.select_samples(rewards, group_ids, progress)
    m = rollout_metrics(ctx.groups, stage, ro, failures)
    m.update(selection_metrics(stage))
    m.update(ctx.rollouts.step_metrics(step))
    if stage.all_degenerate:  # every group all-equal (on every rank): nothing to learn from
        return {**m, "skipped": 1.0, "skip_all_equal": 1.0, **ctx.timings}
    if stage.all_kept_zero:  # (every rank) an update would be the KL term alone
        return {**m, "skipped": 1.0, "skip_zero_advantage": 1.0, **ctx.timings}

    kept = ro.batch.select(stage.kept_rows)
    if ctx.router_replay:  # every forward of these rows routes as the engine did
        if ro.routed_experts is None:
            raise RunError(
                "algorithm.router_replay=rollout: the engine returned no routing (a dense "
                "model, or a sampler that does not record it: model.params.sampler=seeded does)"
            )
        kept = dataclasses.replace(kept, routed_experts=ro.routed_experts[stage.kept_rows])
    old_lp = entropy = None  # one on-policy update without token scores: no extra pass needed
    # The old-policy pass is skipped only for one on-policy update without token scores,
    # where the current log-probs (ratio 1) are the old ones.
    if ctx.selector.needs_entropy or ctx.num_mini_batches > 1 or not ctx.rollouts.on_policy:
        with ctx.timed("logprob"):
            scores = ctx.policy.score(
                kept,
                with_entropy=ctx.selector.needs_entropy,
                micro_batch_size=ctx.logprob_micro_batch_size,
                micro_batch_tokens=ctx.logprob_micro_batch_tokens,
            )
        old_lp, entropy = scores.logprobs, scores.entropy
        m.update(padding_metrics(ctx.groups, "logprob", scores.stats))
        if ro.routed_experts is not None and scores.routed_experts is not None:
            engine_experts = ro.routed_experts[stage.kept_rows]
            m.update(
                routing_metrics(
                    ctx.groups, engine_experts, scores.routed_experts, kept.response_mask
                )
            )
    tok = ctx.selector.select_tokens(stage, entropy, kept.response_mask, progress)
    m.update(token_metrics(ctx.groups, tok, kept, scored=old_lp is not None))
    if tok.metrics["n_kept_tokens"] == 0:  # whole-batch count: every rank agrees
        return {**m, "skipped": 1.0, "skip_no_tokens": 1.0, **ctx.timings}
    minibatch = group_ids[stage.kept_rows] % ctx.num_mini_batches  # layout-independent split
    is_weight, token_keep = None, tok.token_keep
    if ro.sampling_logprobs is not None and old_lp is not None:
        # the behaviour policy's log-probs against the trainer's at the current weights
        sampling = ro.sampling_logprobs[stage.kept_rows]
        m.update(mismatch_metrics(ctx.groups, old_lp, sampling, kept.response_mask))
        cap, mode = ctx.tis_cap, ctx.is_correction
        iw = importance_weights(
            old_lp, sampling, kept.response_mask, cap or 1.0, mode=mode, level=ctx.is_level
        )
        m.update(importance_metrics(ctx.groups, iw, kept.response_mask, token_keep, cap, mode))
        if cap is not None:
            is_weight, token_keep = iw.weight, token_keep & iw.keep
    upd = compact(
        kept,
        token_keep,
        old_lp,
        stage.kept_advantages,
        minibatch,
        num_mini_batches=ctx.num_mini_batches,
        aggregation=ctx.loss_cfg.aggregation,
        normalize_by=ctx.normalize_by,
        is_weight=is_weight,
        loss_name=ctx.loss_name,
    )
    if ctx.loss_cfg.kl_coef > 0:
        with ctx.timed("reference"):
            upd.ref_logprobs = ctx.policy.score(
                dataclasses.replace(upd.batch, routed_experts=None),  # its own routing
                with_entropy=False,
                reference=True,
                micro_batch_size=ctx.logprob_micro_batch_size,
                micro_batch_tokens=ctx.logprob_micro_batch_tokens,
            ).logprobs
    _check_step_inputs(upd)
    with ctx.timed("update"):
        report = update_policy(
            ctx.policy,
            upd,
            loss_name=ctx.loss_name,
            loss_cfg=ctx.loss_cfg,
            num_mini_batches=ctx.num_mini_batches,
            micro_batch_size=ctx.micro_batch_size,
            groups=ctx.groups,
            rebalance=ctx.rebalance,
            micro_batch_tokens=ctx.micro_batch_tokens,
        )
    fault_point("step.updated")
    if ctx.rollouts.synchronous:
        _refit_after_update(ctx)
    # (k > 0: the loop gives the engine the new weights between steps, pipeline.publish)
    m.update(update_metrics(ctx.groups, upd, report))
    # every mini-batch's gradient was non-finite: no weight moved (agreed: the norm is global)
    applied = m["optimizer_steps"] > 0
    return {**m, "skipped": 0.0 if applied else 1.0, **ctx.timings}
