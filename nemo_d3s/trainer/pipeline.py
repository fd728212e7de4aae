"""Rollout batches on a schedule fixed by the step number.

Version v of the weights is the policy after v steps. Batch t, the rollouts step t trains on,
is generated with version max(0, t - k) (k = ``rollout.max_staleness``) whatever the timing,
so a run is reproducible from its seed and a resumed run trains on what an uninterrupted one
did. k = 0: the step generates its batch itself with the latest weights (the synchronous loop).

k >= 1: a worker thread generates on an engine holding its own copy of the weights
(``RolloutEngine.own_weights``; its ``generate`` never refits: ``pin_weights``). The engine
holds one version, so at the boundary before step v the trainer waits for batch v + k - 1 (the
last of version v - 1), refits version v on its own thread while the worker is idle (one refit
per version), runs what needs the idle engine (the evaluation), then releases batch v + k, which
the worker generates while step v trains; k = 1 waits for the batch step v trains on, a larger k
adds staleness but no overlap. Every rank agrees on each boundary's outcome (a stop signal, a
failed worker) before its first collective, on the job's store as the synchronous step does
(``backends/engine_wait.py``): a rank whose batch came first waits for the others' with a
liveness check, not inside a collective limited by the groups' timeout. The batches generated
ahead go into a checkpoint (:meth:`GenerationPipeline.pending_writer`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from nemo_d3s.backends.base import GenerationConfig, GenerationInterrupted, Policy, RolloutEngine
from nemo_d3s.backends.base import Rollouts
from nemo_d3s.backends.engine_wait import agreed_generation
from nemo_d3s.distributed.generation_wait import GenerationWait, generation_limit_s
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.trainer.data import PromptBatch, PromptSource, generate_groups
from nemo_d3s.trainer.faults import agreed_refit, fault_point
from nemo_d3s.trainer.worker_cuda import trainer_device, worker_stream
from nemo_d3s.trainer.pipeline_resume import agreed_pending, load_pending
from nemo_d3s.trainer.rollout_store import (
    HeldWeights,
    rollouts_file,
    save_held_weights,
    save_rollouts,
    weights_file,
)

__all__ = ["GeneratedBatch", "GenerationPipeline"]

log = logging.getLogger("nemo_d3s.trainer")

WORKER_NAME = "nemo_d3s-rollout-worker"
POLL_S = 0.05  # how often a waiting trainer looks at the stop flag and the worker's liveness
# How long ``close`` waits for a generation in flight that the engine cannot cut short (vLLM's
# generate runs to its end): after a stop signal the checkpoint is written and what is left of
# the signal's lead is the exit's and the requeue's; otherwise (the end of a run) nothing is
# in flight.
CLOSE_WAIT_S = 60.0
CLOSE_WAIT_STOPPING_S = 5.0


@dataclass
class GeneratedBatch:
    """One step's rollouts, the weights ``version`` they came from, the engine's seconds on
    them and the seconds the worker waited for those weights first (0 for a loaded batch)."""

    rollouts: Rollouts
    version: int
    gen_seconds: float = 0.0
    engine_wait_s: float = 0.0


class GenerationPipeline:
    """Batch t for step t, generated with weights version max(0, t - k) (module docstring).

    Call order: :meth:`start`, then per step :meth:`take` (inside the step) and
    :meth:`publish` (after it), :meth:`close` at the end; every method on the trainer's thread.
    ``wait``: the trainer's wait for the ranks' generations (None: one over every process of
    the job, the world's timeout as its base; one process: waits for nobody).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        prompts: PromptSource,
        gen: GenerationConfig,
        n_samples: int,
        max_staleness: int,
        groups: ParallelGroups,
        total_steps: int,
        stop_requested: Callable[[], bool] = lambda: False,
        wait: Optional[GenerationWait] = None,
    ) -> None:
        self.engine, self.prompts, self.gen, self.n = engine, prompts, gen, int(n_samples)
        self.k, self.groups, self.total_steps = int(max_staleness), groups, int(total_steps)
        self.stop_requested, self.wait = stop_requested, wait or _job_wait(groups)
        if self.k and not engine.own_weights:
            raise ValueError(
                f"rollout.max_staleness={self.k} needs an engine with its own copy of the "
                f"weights; {type(engine).__name__} samples from the policy's"
            )
        self._cv = threading.Condition()
        self._queue: Dict[int, PromptBatch] = {}  # released, not generated yet
        self._batches: Dict[int, GeneratedBatch] = {}  # generated, not taken yet
        self._generated: set = set()
        self._version = 0
        self._failure: Optional[Tuple[int, BaseException]] = None
        self._interrupted = False
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._waited: Dict[int, float] = {}  # trainer seconds waited, by the step it preceded
        self._waited_on: Dict[int, float] = {}  # trainer seconds waited, by batch
        self._taken: Dict[int, GeneratedBatch] = {}

    @property
    def synchronous(self) -> bool:
        """k = 0: each step generates its own batch with the latest weights."""
        return self.k == 0

    @property
    def on_policy(self) -> bool:
        """Whether a step's rollouts come from the weights it trains (the engine's numerics
        agreeing): then one update may skip the old-policy pass."""
        return self.synchronous and self.engine.on_policy

    def version_of(self, step: int) -> int:
        """The weights version batch ``step`` is generated with on the schedule."""
        return max(0, int(step) - self.k)

    # ------------------------------------------------------------------ the trainer's side
    def start(
        self,
        step: int,
        pending: Mapping[int, Tuple[Rollouts, int]] = {},
        held: Optional[HeldWeights] = None,
        policy: Optional[Policy] = None,
    ) -> None:
        """The trainer's weights are version ``step`` and the engine holds them. Batches step ..
        step + k - 1 come from ``pending`` (a resumed run's) or are generated now: a batch of
        version ``step`` - 1 from ``held`` (the weights a stop cut it short on; then ``policy``
        is refitted as at a boundary), else with version ``step``, the schedule's on a fresh
        start and a warned deviation after a resume without them. Collective (three all-reduces:
        ``pipeline_resume.agreed_pending``, then the need)."""
        if self.synchronous:
            return
        self._version = int(step)
        ahead = range(step, min(step + self.k, self.total_steps))
        pending = agreed_pending(ahead, pending, self.groups)
        missing = [j for j in ahead if j not in pending]
        due = {self.version_of(j) for j in missing} - {step}
        # 0: nothing missing but what the engine's weights give; 1: the rest from ``held``;
        # 2: no weights for them here. Every rank takes the most any rank needs.
        need = 0.0 if not due else 1.0 if held is not None and due == {held.version} else 2.0
        need = self.groups.max(need)
        if need >= 2:
            log.warning(
                "resumed at step %d without the rollouts of steps %s generated before the "
                "stop, nor the weights they were due from; they are generated now with the "
                "weights of step %d instead of %s, so these steps differ from an "
                "uninterrupted run",
                step,
                missing,
                step,
                sorted(self.version_of(j) for j in missing),
            )
        for j in ahead:
            if j in pending:
                ro, version = pending[j]
                self._batches[j] = GeneratedBatch(ro, int(version))
                self._generated.add(j)
        inner_stop = self.engine.should_stop
        # closing the pipeline cuts a generation short (within a token for the HF sampler)
        self.engine.should_stop = lambda: self._closed or (inner_stop is not None and inner_stop())
        self.engine.pin_weights()
        import torch

        device = trainer_device(torch)
        self._thread = threading.Thread(
            target=self._work, args=(device,), name=WORKER_NAME, daemon=True
        )
        self._thread.start()
        if need == 1:  # the boundary the stop cut short, with the weights of step - 1 again
            if held is not None and due:
                self.engine.sync_weights(held)
                self._version = held.version
            self._release(step, min(step + self.k, self.total_steps) - 1)
            self.publish(step, policy)
        else:
            self._release(step, min(step + self.k, self.total_steps - 1))

    def take(self, step: int, prompts: PromptBatch) -> Rollouts:
        """Step ``step``'s rollouts (k = 0: generated now from ``prompts``). Raises
        GenerationInterrupted after a stop signal, RuntimeError naming a failed worker."""
        if self.synchronous:
            return generate_groups(self.engine, prompts, self.n, self.gen)
        # agreed as at a boundary: the first k batches after a start were awaited by nobody
        # else, and the step's first collective would wait for a slower rank's batch 0 within
        # the groups' timeout (a batch a boundary awaited is here already: no wait)
        self._agreed_wait(step, step, stopping=False)
        with self._cv:
            batch = self._batches.pop(step)
        self._taken = {step: batch}
        return batch.rollouts

    def publish(
        self, version: int, policy: Policy, between: Callable[[], Optional[bool]] = lambda: None
    ) -> None:
        """The trainer's weights are ``version`` now; ``between()`` runs while the engine holds
        them and generates nothing (the evaluation; True: a stop signal cut it short, and no
        generation starts after it, nor after a stop signal here). k = 0: the step refitted,
        only ``between()``. Collective: GenerationInterrupted on every rank after a stop
        signal on any, RuntimeError on every rank after a failed worker on any."""
        if self.synchronous:
            between()
            return
        last = min(version + self.k, self.total_steps) - 1
        # a stop signal pending here skips the refit, as after a synchronous step's update: the
        # checkpoint comes first and holds every batch generated so far (the resumed run
        # refits from it)
        self._agreed_wait(version, last, stopping=self.stop_requested())
        self._refit(policy)  # the worker is idle: nothing released is left
        with self._cv:
            self._version = int(version)
        if between() or self.stop_requested():  # the run stops: its checkpoint comes next
            return
        self._release(version + self.k, min(version + self.k, self.total_steps - 1))

    def _agreed_wait(self, version: int, last: int, *, stopping: bool) -> None:
        """Wait for batch ``last`` while this rank beats, then learn every rank's outcome
        (``agreed_generation``, the synchronous step's), within the limit for batches
        ``version`` .. ``last``: every rank's same bound, however far its own worker got; the
        seconds waited go to ``version``'s. GenerationInterrupted on every rank after a stop
        signal on any (``stopping``: one pending, or one cutting the wait short); a failed
        worker raises on every rank; GenerationTimeout where a rank neither finishes nor beats,
        or never finishes."""
        rows = (self.prompts.hi - self.prompts.lo) * self.n * max(0, last - version + 1)
        limit = generation_limit_s(self.wait.base_s, rows, self.gen.max_new_tokens)
        waited, agreed = agreed_generation(
            self.wait,
            self.engine.alive,
            lambda: self._wait(last),
            stopping=stopping,
            limit_s=limit,
        )
        self._waited[version] = self._waited.get(version, 0.0) + (waited or 0.0)
        if agreed.stopping or agreed.interrupted:
            raise GenerationInterrupted("stop requested while waiting for rollouts")

    def _refit(self, policy: Policy) -> None:
        """The boundary's refit, its outcome agreed by every rank (a model-parallel group
        refits together). A refit a stop signal cuts short (an RPC into an engine going down
        with the job raises) is GenerationInterrupted on every rank: the update is applied and
        the loop checkpoints it; one that fails without a stop fails every rank."""

        def agree(failed: bool):
            g = self.groups
            return g.max(float(self.stop_requested())) > 0, g.max(float(failed)) > 0

        if agreed_refit(lambda: self.engine.sync_weights(policy), agree):
            raise GenerationInterrupted("stop requested during the refit")

    def step_metrics(self, step: int) -> Dict[str, float]:
        """``rollout_staleness`` of step ``step``'s batch and the pipeline's timings: the
        trainer's wait for rollouts before and in the step, the worker's wait for the weights,
        the engine's seconds and the share of them the trainer did not wait through ({} for
        k = 0)."""
        batch = self._taken.get(step)
        if batch is None:
            return {}
        out = {
            "rollout_staleness": float(step - batch.version),
            "time_wait_for_rollouts": self._waited.pop(step, 0.0),
            "time_engine_wait_for_weights": batch.engine_wait_s,
        }
        if batch.gen_seconds > 0:
            waited = min(self._waited_on.pop(step, 0.0), batch.gen_seconds)
            out["time_generation"] = batch.gen_seconds
            out["time_overlap_share"] = 1.0 - waited / batch.gen_seconds
        return out

    def close(self) -> None:
        """Stop the worker: a generation in flight is cut short where the engine can (the HF
        sampler, within a token); one it cannot (vLLM) is waited for at most
        ``CLOSE_WAIT_STOPPING_S`` after a stop signal (``CLOSE_WAIT_S`` otherwise), then left to
        end with the process (warned)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            wait_s = CLOSE_WAIT_STOPPING_S if self.stop_requested() else CLOSE_WAIT_S
            self._thread.join(timeout=wait_s)
            if self._thread.is_alive():
                log.warning(
                    "the rollout worker is still inside a generation %.0f s after the pipeline "
                    "closed (its engine cannot cut it short); it ends with the process",
                    wait_s,
                )

    # ------------------------------------------------------------------ checkpoints
    def pending_writer(self, step: int) -> Optional[Callable[[Path], List[str]]]:
        """For a checkpoint at ``step``: writes this rank's generated batches step .. step + k
        - 1 into the checkpoint folder and, when a stop cut one short, the engine's weights it
        was due from (where the engine can give them back). None for k = 0."""
        if self.synchronous:
            return None

        def write(folder: Path) -> List[str]:
            with self._cv:
                held = {**self._batches, **self._taken}  # a step stopped before its update
                keep = {j: (b.rollouts, b.version) for j, b in held.items() if j >= step}
                keep = {j: b for j, b in keep.items() if j < step + self.k}
                version = self._version
            names = [rollouts_file(self.groups.global_rank)]
            save_rollouts(Path(folder) / names[0], keep, (self.prompts.lo, self.prompts.hi))
            ahead = range(step, min(step + self.k, self.total_steps))
            due = {self.version_of(j) for j in ahead if j not in keep} - {step}
            weights = self.engine.held_weights() if due == {version} else None
            if weights is not None:
                names.append(weights_file(self.groups.global_rank))
                save_held_weights(Path(folder) / names[1], weights, version)
            return names

        return write

    def load_pending(
        self, folder: Optional[Path]
    ) -> Tuple[Dict[int, Tuple[Rollouts, int]], Optional[HeldWeights]]:
        """This rank's batches and engine weights from checkpoint ``folder``, agreed over the
        job (``pipeline_resume.load_pending``); nothing for k = 0 or no folder."""
        if self.synchronous or folder is None:
            return {}, None
        return load_pending(folder, self.groups, (self.prompts.lo, self.prompts.hi), self.engine)

    # ------------------------------------------------------------------ the worker's side
    def _release(self, first: int, last: int) -> None:
        """Let the worker generate batches first .. last (those not generated already)."""
        todo = {j: self.prompts.for_step(j) for j in range(first, last + 1)}
        with self._cv:
            self._queue.update({j: p for j, p in todo.items() if j not in self._generated})
            self._cv.notify_all()

    def _wait(self, step: int) -> float:
        """Seconds waited until batch ``step`` is generated (0 when no batch < 0 is asked)."""
        if step < 0:
            return 0.0
        t0 = time.perf_counter()
        with self._cv:
            while step not in self._generated:
                if self._failure is not None:
                    j, e = self._failure
                    raise RuntimeError(
                        f"the rollout worker thread {WORKER_NAME} failed on the batch of step "
                        f"{j}: {type(e).__name__}: {e}"
                    ) from e
                if self._interrupted or self.stop_requested():
                    raise GenerationInterrupted("stop requested while waiting for rollouts")
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError(
                        f"the rollout worker thread {WORKER_NAME} is not running; the batch "
                        f"of step {step} will never come"
                    )
                self._cv.wait(timeout=POLL_S)
        waited = time.perf_counter() - t0
        self._waited_on[step] = self._waited_on.get(step, 0.0) + waited
        return waited

    def _work(self, device: Optional[int]) -> None:
        """The worker thread: the released batches in step order, each with the version the
        engine holds when it starts (the trainer refits only while nothing is released), on
        the trainer's CUDA ``device`` (None: a CPU process)."""
        import torch

        # A new thread's OpenMP team size is the library default until torch's first parallel
        # op there sets the process's (torch.set_num_threads) one; torch.get_num_threads does
        # that now. Otherwise vLLM's CPU attention plans its work with the default (2 on two
        # cores) and runs it after a torch op has set 1: "Check failed: thread_num (2 vs. 1)".
        torch.get_num_threads()
        idle_since = time.perf_counter()
        side = worker_stream(torch, device)
        while True:
            with self._cv:
                while not self._closed and not self._queue:
                    self._cv.wait()
                if self._closed:
                    return
                step = min(self._queue)
                prompts, version = self._queue.pop(step), self._version
            t0 = time.perf_counter()
            try:
                fault_point("pipeline.generate")
                with side():
                    ro = generate_groups(self.engine, prompts, self.n, self.gen)
            except GenerationInterrupted:
                with self._cv:
                    self._interrupted = True
                    self._cv.notify_all()
                return
            except BaseException as e:  # reported to the trainer, which raises it
                with self._cv:
                    self._failure = (step, e)
                    self._cv.notify_all()
                return
            done = time.perf_counter()
            with self._cv:
                self._batches[step] = GeneratedBatch(ro, version, done - t0, t0 - idle_since)
                self._generated.add(step)
                self._cv.notify_all()
            idle_since = done


def _job_wait(groups: ParallelGroups) -> GenerationWait:
    """A wait over every process of the job (``groups`` spans them), the world group's
    timeout as its base; one process (no group): waits for nobody."""
    import torch.distributed as dist

    if all(g is None for g in (groups.dp, groups.tp, groups.pp, groups.cp)):
        return GenerationWait("pipeline", 1, 0, 0.0)
    return GenerationWait.of_group("pipeline", dist.group.WORLD)
