"""Stop signals with a live vLLM engine on the GPU, and the watchdog on vLLM's GPU client.

- ``vllm.watchdog``: each rank's engine in its own process; the watchdog finds vLLM's client
  internals (a vLLM whose internals moved fails it); SIGTERM to the engine core mid-generation:
  GenerationInterrupted naming the aborted rollouts, the engine stopped without a fault, a
  release calls nothing. CPU twin: ``tests/backends/test_vllm_engine.py`` (the same function).
- ``vllm.stop_signal``: the RL run with ``rollout=vllm``, SIGTERM to the trainer ranks alone
  after step 1's generation (the engine lives, as one ignoring SIGUSR1 under sbatch): the
  checkpoint of step 1 is written with the engine asleep (GPU memory outside the trainer's
  allocator under half the engine's budget) and ``resume=true`` gives the uninterrupted
  run's rewards and kept tokens. CPU twin: ``tests/trainer/test_vllm_stop.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from typing import Any, Dict, List
from unittest import mock

import torch

from nemo_d3s.selfcheck.base import Check, Context, megatron_backend, within
from nemo_d3s.selfcheck.report import CheckFailed
from nemo_d3s.selfcheck.rl_checks import rl_overrides
from nemo_d3s.selfcheck.vllm_checks import (
    close_engine,
    engine_in_its_own_process,
    need_vllm,
    vllm_engine,
)

__all__ = ["CHECKS", "sigterm_mid_call"]

GMU = 0.3  # the engine's share of its GPU here


def check_watchdog(ctx: Context) -> Dict[str, Any]:
    from nemo_d3s.backends.engines import build_rollout_engine

    need_vllm()
    with megatron_backend(ctx, tensor_model_parallel_size=1) as pol:
        with engine_in_its_own_process():
            engine = build_rollout_engine("vllm", pol, {"gpu_memory_utilization": GMU})
        try:
            problems, out = sigterm_mid_call(vllm_engine(engine))
        finally:
            close_engine(engine)
    ctx.agree(problems, out)
    return out


def sigterm_mid_call(v: Any) -> tuple:
    """SIGTERM to the engine core of ``v`` (a VLLMEngine in its own process) once a long
    generation is in flight: (problems, measured); the CPU twin's test calls it too."""
    from multiprocessing import connection

    from nemo_d3s.backends.base import GenerationConfig, GenerationInterrupted

    dog = v.watchdog
    out: Dict[str, Any] = {"watching": dog is not None and dog.thread is not None}
    if not out["watching"]:
        return ["the watchdog does not watch this vLLM's client (its internals moved)"], out
    (core,) = [p for p in dog.processes if p.name.startswith("EngineCore")]
    result: Dict[str, Any] = {}

    def call() -> None:
        try:
            result["rollouts"] = v.generate(
                ["count to a thousand"] * 64, 8, GenerationConfig(max_new_tokens=600), range(64)
            )
        except Exception as e:  # judged below
            result["error"] = e

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    while worker.is_alive() and v.llm.llm_engine.get_num_unfinished_requests() == 0:
        time.sleep(0.01)
    t0 = time.perf_counter()
    os.kill(core.pid, signal.SIGTERM)
    worker.join(timeout=300)
    out["seconds_to_return"] = time.perf_counter() - t0
    err = result.get("error")
    problems: List[str] = []
    if worker.is_alive():
        return ["the generation still waits on the engine that shut down"], out
    out["aborted"] = isinstance(err, GenerationInterrupted) and "aborted" in str(err)
    # or the engine core ended on the signal mid-step before it could abort the requests
    # (seen on a loaded 2-core machine): interrupted too, and no rollout came back either way
    out["engine_stopped"] = isinstance(
        err, GenerationInterrupted
    ) and "stopped with the job" in str(err)
    if not (out["aborted"] or out["engine_stopped"]) or "rollouts" in result:
        problems.append(f"the call ended with {err!r} (rollouts: {'rollouts' in result})")
    if not connection.wait([core.sentinel], timeout=300):
        return problems + ["the engine core did not end"], out
    dog.settle()
    out["exit_code"] = core.exitcode
    if not (v.stopped and not v.alive()):
        problems.append(f"the engine is not counted as stopped ({dog.ended!r}, {dog.death!r})")
    v.release()  # nothing to call: an engine that answers no more would hold it forever
    return problems, out


def _train(ctx: Context, out: Any, extra: List[str]) -> Any:
    """``trainer.loop.train`` of the self-check's RL config with ``rollout=vllm``."""
    from nemo_d3s.train import compose_config
    from nemo_d3s.trainer.loop import train

    vllm = ["rollout=vllm", f"rollout.gpu_memory_utilization={GMU}"]
    return train(compose_config(rl_overrides(ctx, str(out), extra=[*vllm, *extra])))


def check_stop_signal(ctx: Context) -> Dict[str, Any]:
    from nemo_d3s.fault_points import reset_fault_points
    from nemo_d3s.trainer.checkpoint import CheckpointManager
    from nemo_d3s.trainer.metrics import read_jsonl

    need_vllm()
    ref, run = ctx.work_dir / "vllm_stop_ref", ctx.work_dir / "vllm_stop"
    if ctx.rank == 0:
        for d in (ref, run):
            shutil.rmtree(d, ignore_errors=True)
    ctx.barrier()
    _train(ctx, ref, [])
    held: List[float] = []
    real_save = CheckpointManager.save

    def save(self, backend, state):  # the GPU memory outside the trainer's allocator, now
        free, total = torch.cuda.mem_get_info(ctx.device)
        held.append((total - free - torch.cuda.memory_reserved(ctx.device)) / total)
        return real_save(self, backend, state)

    reset_fault_points()
    os.environ["NEMO_D3S_FAULT"] = "step.generated@1=term"
    try:
        with mock.patch.object(CheckpointManager, "save", save):
            state = _train(ctx, run, [])
    finally:
        os.environ.pop("NEMO_D3S_FAULT", None)
    out: Dict[str, Any] = {"interrupted_at": state.step, "held_share_at_save": held}
    if not (state.extra.get("interrupted") and state.step == 1 and len(held) == 1):
        raise CheckFailed("the run did not stop at a checkpoint of step 1", out)
    _train(ctx, run, ["resume=true"])
    want, got = read_jsonl(ref / "metrics.jsonl"), read_jsonl(run / "metrics.jsonl")
    keys = ("reward_mean", "n_kept_tokens")
    out["resumed_rows_equal"] = [{k: r.get(k) for k in keys} for r in got] == [
        {k: r.get(k) for k in keys} for r in want
    ]
    # (an engine on another rank's GPU: this GPU holds only contexts either way)
    within("held_share_at_save", held[0], GMU / 2, out)
    if not out["resumed_rows_equal"]:
        raise CheckFailed("the resumed run's rewards or kept tokens differ", out)
    return out


CHECKS = [
    Check(
        "vllm.watchdog",
        True,
        check_watchdog,
        "the watchdog on vLLM's GPU client: SIGTERM to the engine mid-generation returns no "
        "rollout, the engine counts as stopped, nothing waits on it",
    ),
    Check(
        "vllm.stop_signal",
        True,
        check_stop_signal,
        "SIGTERM to the trainer after a generation with the engine alive: checkpoint at "
        "step 1 with the engine asleep (memory), resume equals an uninterrupted run",
    ),
]
